"""Registers and spills of the one-pass LayerNorm backward kernel, compiled for Hopper (sm_90)
without a GPU, per Hiera-B width and launch variant.

    python scripts/check_layer_norm_registers.py [--variants 2x4096x2,2x4096x2x8] [--json out.json]

Each variant (``scripts/bench_layer_norm.py``'s syntax: programs per SM x tile elements x sums
kind [x warps]) is compiled by Triton's compiler and ptxas for sm_90a, bf16, with the residual
gradient. ``programs_per_sm_by_registers`` is how many such programs fit an SM's 65,536 registers:
when it is below the variant's programs per SM, the extra programs wait for a free slot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer_norm import SHAPES, parse_variant  # noqa: E402
from check_shared_memory import compile_sm90, ptxas_usage  # noqa: E402

REGISTERS_PER_SM = 65536
POINTERS = {"DY": None, "X": None, "W": None, "DRES": None, "DX": None, "MEAN": "fp32", "RSTD": "fp32",
            "PART": "fp32"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="2x4096x2,2x4096x2x8,4x2048x2,4x2048x2x8")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from hiera_autopatch.ops.triton import layer_norm as tln

    results = {"command": " ".join(sys.argv), "target": "sm_90a, bf16, with the residual gradient",
               "shipped": f"{tln.PROGRAMS_PER_SM}x{tln.TILE_ELEMENTS}x{2 if tln.ACC_2D else 1}", "shapes": {}}
    for name, (_, width, _) in SHAPES.items():
        block_c = tln._next_pow2(width)
        entry = results["shapes"].setdefault(name, {"width": width})
        for variant in args.variants.split(","):
            per_sm, tile, acc_2d, warps = parse_variant(variant)
            block_r = max(1, tile // block_c)
            warps = warps or (4 if block_r * block_c <= 4096 else 8)
            compiled = compile_sm90(tln._layer_norm_bwd_kernel, "bf16",
                                    dict(C=width, BLOCK_R=block_r, BLOCK_C=block_c, HAS_RES=True, ACC_2D=acc_2d),
                                    warps, 2, pointers=POINTERS)
            use = ptxas_usage(compiled)
            use.update(warps=warps, programs_per_sm_by_registers=REGISTERS_PER_SM // (use["registers"] * 32 * warps))
            entry[variant] = use
            print(name, variant, json.dumps(use), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
