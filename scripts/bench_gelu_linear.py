"""fc2 with GELU in its prologue (``ops/triton/gelu_linear.py``) against what the graphed step runs
now, per Hiera-B MAE MLP shape: Inductor's GELU kernel, then cuBLAS's fc2 (``F.linear(F.gelu(h),
w, b)`` compiled with the step's Inductor options).

    python scripts/bench_gelu_linear.py --json out.json [--batch 128] [--variants 128x128x64x8x3,...]

Each timing is a CUDA-graph replay of the one call (scripts/_timing.py), bf16, and every variant's
output is checked against the compiled reference before it is timed. Prints JSON: per shape the ms
of each variant and the bytes the unfused pair moves at least (h read, act written and read back,
the output written) over its time.
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
from bench_gelu import SHAPES  # noqa: E402  (tokens per sample, hidden width, MLPs a step)


def main(argv=None) -> int:
    parser = launch_bench_parser(__doc__, SHAPES, "128x128x64x8x3,128x64x64x4x4,64x128x64x4x4,128x256x64x8x3,128x32x64x4x4",
                                 "BLOCK_M x BLOCK_N x BLOCK_K x warps x stages (ops/triton/gelu_linear.Launch)")
    args = parser.parse_args(argv)

    from hiera_autopatch.ops import step_graph
    from hiera_autopatch.ops.triton import gelu_linear as tgl

    variants = args.variants.split(",")
    for variant in variants:
        tgl.Launch.parse(variant)  # a typo fails here, before any timing

    torch.manual_seed(0)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    results = results_header(args.batch, device)
    results["shipped"] = str(tgl.LAUNCH)

    def reference(h, w, b):
        return torch.nn.functional.linear(torch.nn.functional.gelu(h), w, b)

    for name in args.shapes.split(","):
        tokens, hidden, per_step = SHAPES[name]
        rows, width = args.batch * tokens, hidden // 4
        h = torch.randn(rows, hidden, device=device, dtype=dtype) * 2
        w = torch.randn(width, hidden, device=device, dtype=dtype) / hidden ** 0.5
        b = torch.randn(width, device=device, dtype=dtype)
        torch._dynamo.reset()
        options = {k: v for k, v in step_graph.default_options().items() if k != "post_grad_custom_post_pass"}
        compiled = torch.compile(reference, options=options, fullgraph=True) if device == "cuda" else reference
        expected = (compiled(h, w, b),)
        entry = {"rows": rows, "hidden": hidden, "width": width, "per_step": per_step,
                 "min_bytes": (3 * rows * hidden + rows * width) * h.element_size()}
        entry["inductor_ms"] = kernel_ms(lambda: compiled(h, w, b), device)
        time_launches(tgl, variants, lambda: (tgl.gelu_linear(h, w, b),), expected, entry, device)
        record_best(entry, per_step)
        results["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
        save_json(args.json, results)
    record_step_totals(results, variants, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
