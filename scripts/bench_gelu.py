"""GELU backward with fc1's bias gradient, per Hiera-B MAE MLP shape: our one-pass kernel
(``ops/triton/gelu.py``) against what Inductor compiles for the same math in the graphed step
(``gelu(h)``, ``gelu_backward(d_act, h)`` and its ``sum(0)``, with the step's Inductor options).

    python scripts/bench_gelu.py --json out.json [--batch 128] [--variants 8192x256x8,4096x256x4]

Each timing is a CUDA-graph replay of the one call (scripts/_timing.py), bf16, and every variant's
outputs are checked against Inductor's before it is timed. Prints JSON: per shape the ms of each
variant, and the bytes each must move at least (h, d_act read; act, dh written) over its time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (  # noqa: E402
    kernel_ms, launch_bench_parser, record_best, record_step_totals, results_header, save_json, time_launches,
)

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
    parser = launch_bench_parser(__doc__, SHAPES, "4096x128x4,8192x256x8,4096x256x4,8192x128x8,2048x128x4,2048x64x4,4096x64x4,4096x128x8",
                                 "tile elements x most partial-sum rows x warps [p: prefetch] (ops/triton/gelu.Launch)")
    args = parser.parse_args(argv)

    from hiera_autopatch.ops import step_graph
    from hiera_autopatch.ops.triton import gelu as tgelu

    variants = args.variants.split(",")
    for variant in variants:
        tgelu.Launch.parse(variant)  # a typo fails here, before any timing

    torch.manual_seed(0)
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    results = results_header(args.batch, device)
    results["shipped"] = str(tgelu.LAUNCH)
    results["shipped_by_width"] = {width: str(launch) for width, launch in tgelu.LAUNCH_BY_WIDTH.items()}

    def inductor_backward(d_act, h):
        dh = torch.ops.aten.gelu_backward(d_act, h)
        return torch.nn.functional.gelu(h), dh, dh.sum(0)

    for name in args.shapes.split(","):
        tokens, width, per_step = SHAPES[name]
        rows = args.batch * tokens
        h = torch.randn(rows, width, device=device, dtype=dtype) * 2
        d_act = torch.randn_like(h)
        torch._dynamo.reset()
        options = {k: v for k, v in step_graph.default_options().items() if k != "post_grad_custom_post_pass"}
        compiled = torch.compile(inductor_backward, options=options, fullgraph=True)
        expected = compiled(d_act, h)
        entry = {"rows": rows, "width": width, "per_step": per_step,
                 "min_bytes": 4 * rows * width * h.element_size()}
        entry["inductor_ms"] = kernel_ms(lambda: compiled(d_act, h), device)
        time_launches(tgelu, variants, lambda: tgelu.gelu_backward_bias(d_act, h), expected, entry, device)
        record_best(entry, per_step)
        results["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
        save_json(args.json, results)
    record_step_totals(results, variants, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
