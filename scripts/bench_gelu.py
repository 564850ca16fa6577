"""GELU backward with fc1's bias gradient, per Hiera-B MAE MLP shape: our one-pass kernel
(``ops/triton/gelu.py``) against what Inductor compiles for the same math in the graphed step
(``gelu(h)``, ``gelu_backward(d_act, h)`` and its ``sum(0)``, with the step's Inductor options).

    python scripts/bench_gelu.py --json out.json [--batch 128] [--variants 8192x256x8,4096x256x4]

Each timing is a CUDA-graph replay of the one call (scripts/_timing.py), bf16, and every variant's
outputs are checked against Inductor's before it is timed. Prints JSON: per shape the ms of each
variant, and the bytes each must move at least (h, d_act read; act, dh written) over its time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import graph_replay_ms, record_best, record_step_totals, results_header, save_json  # noqa: E402

# name -> (tokens per sample: 19 kept mask units at ratio 0.6; 120 masked for the decoder's last
# MLP, which runs at the masked rows only; hidden width, MLPs a step)
SHAPES = {
    "stage1": (19 * 64, 384, 2),
    "stage2": (19 * 16, 768, 3),
    "stage3": (19 * 4, 1536, 16),
    "stage4": (19, 3072, 3),
    "decoder": (196, 2048, 7),
    "decoder-masked": (120, 2048, 1),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default="4096x128x4,8192x256x8,4096x256x4,8192x128x8,2048x128x4,2048x64x4,4096x64x4,4096x128x8",
                        help="tile elements x most partial-sum rows x warps, comma list (ops/triton/gelu.Launch)")
    args = parser.parse_args(argv)

    from hiera_autopatch.ops import step_graph
    from hiera_autopatch.ops.triton import gelu as tgelu

    shipped = tgelu.LAUNCH
    for variant in args.variants.split(","):
        tgelu.Launch.parse(variant)  # a typo fails here, before any timing

    torch.manual_seed(0)
    results = results_header(args.batch, "cuda")
    results["shipped"] = "x".join(str(v) for v in shipped)

    def inductor_backward(d_act, h):
        dh = torch.ops.aten.gelu_backward(d_act, h)
        return torch.nn.functional.gelu(h), dh, dh.sum(0)

    for name in args.shapes.split(","):
        tokens, width, per_step = SHAPES[name]
        rows = args.batch * tokens
        h = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 2
        d_act = torch.randn_like(h)
        torch._dynamo.reset()
        options = {k: v for k, v in step_graph.default_options().items() if k != "post_grad_custom_post_pass"}
        compiled = torch.compile(inductor_backward, options=options, fullgraph=True)
        expected = compiled(d_act, h)
        entry = {"rows": rows, "width": width, "per_step": per_step,
                 "min_bytes": 4 * rows * width * h.element_size()}
        entry["inductor_ms"] = graph_replay_ms(lambda: compiled(d_act, h))
        for variant in args.variants.split(","):
            tgelu.LAUNCH = tgelu.Launch.parse(variant)
            got = tgelu.gelu_backward_bias(d_act, h)
            errors = [float((g.float() - e.float()).norm() / e.float().norm()) for g, e in zip(got, expected)]
            entry[f"ours_{variant}_rel_err"] = errors
            if max(errors) > 2e-2:
                entry[f"ours_{variant}_ms"] = None  # wrong: not timed
                continue
            entry[f"ours_{variant}_ms"] = graph_replay_ms(lambda: tgelu.gelu_backward_bias(d_act, h))
        tgelu.LAUNCH = shipped
        record_best(entry, per_step)
        results["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
        save_json(args.json, results)
    record_step_totals(results, args.variants.split(","), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
