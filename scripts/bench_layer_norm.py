"""LayerNorm backward with the residual's gradient, per Hiera-B MAE shape: our one-pass kernel
(``ops/triton/layer_norm.py``) against what Inductor compiles for the same math in the graphed step
(``native_layer_norm_backward`` + the residual add, with the step's Inductor options).

    python scripts/bench_layer_norm.py --json out.json [--batch 128] [--variants 2x4096,4x8192]

Each timing is a CUDA-graph replay of the one call (scripts/_timing.py), bf16, and every variant's
dx, dw, db are checked against Inductor's before it is timed. Prints JSON: per shape the ms of each
variant, and the bytes each must move at least (dy, x, d_res read, dx written) over its time.
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

# name -> (tokens per sample: 19 kept mask units at ratio 0.6, width, block LayerNorms a step)
SHAPES = {
    "stage1": (19 * 64, 96, 4),
    "stage2": (19 * 16, 192, 6),
    "stage3": (19 * 4, 384, 32),
    "stage4": (19, 768, 6),
    "decoder": (196, 512, 16),
}


def main(argv=None) -> int:
    parser = launch_bench_parser(__doc__, SHAPES, "2x4096x2,1x4096x2,4x2048x2,8x2048x2,2x4096x2x8,4x2048x2x8,8x1024x2,2x4096x1",
                                 "programs per SM x tile elements (rows a step x padded width) x 2 (sums per row slot) "
                                 "or 1 (column sums each step) [x warps] [p: prefetch] (ops/triton/layer_norm.Launch)")
    parser.add_argument("--dx-sum", action="store_true",
                        help="also the dx column sums (the step's folded bias gradients), checked too")
    args = parser.parse_args(argv)

    from hiera_autopatch.ops import step_graph
    from hiera_autopatch.ops.triton import layer_norm as tln

    variants = args.variants.split(",")
    for variant in variants:
        tln.Launch.parse(variant)  # a typo fails here, before any timing

    torch.manual_seed(0)
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    results = results_header(args.batch, device)
    results["dx_sum"] = args.dx_sum
    results["inductor_options"] = {key: value for key, value in step_graph.default_options().items()
                                   if isinstance(value, (bool, int, float, str))}  # (not the graph pass)

    def inductor_backward(dy, x, mean, rstd, w, b, d_res):
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, (x.shape[-1],), mean, rstd, w, b,
                                                                [True, True, True])
        dx = (dx + d_res).to(x.dtype)
        return (dx, dw, db, dx.sum(0)) if args.dx_sum else (dx, dw, db)

    for name in args.shapes.split(","):
        tokens, width, per_step = SHAPES[name]
        rows = args.batch * tokens
        x = torch.randn(rows, width, device=device, dtype=dtype) * 2 + 0.5
        w = (1 + 0.3 * torch.randn(width, device=device)).to(dtype)
        b = (0.1 * torch.randn(width, device=device)).to(dtype)
        dy = torch.randn_like(x)
        d_res = torch.randn_like(x)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, (width,), w, b, 1e-6)
        torch._dynamo.reset()
        compiled = torch.compile(inductor_backward, options=step_graph.default_options(), fullgraph=True)
        expected = compiled(dy, x, mean, rstd, w, b, d_res)
        entry = {"rows": rows, "width": width, "per_step": per_step,
                 "min_bytes": 4 * rows * width * x.element_size()}
        entry["inductor_ms"] = kernel_ms(lambda: compiled(dy, x, mean, rstd, w, b, d_res), device)
        time_launches(tln, variants, lambda: tln.layer_norm_backward(dy, x, mean, rstd, w, d_res, dx_sum=args.dx_sum),
                      expected, entry, device)
        record_best(entry, per_step)
        results["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
        save_json(args.json, results)
    record_step_totals(results, variants, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
