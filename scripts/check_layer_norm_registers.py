"""Registers and spills of the row-loop kernels (the one-pass LayerNorm backward, and with
``--gelu`` the GELU backward + bias sum), compiled for Hopper (sm_90) without a GPU, per Hiera-B
width and launch variant.

    python scripts/check_layer_norm_registers.py [--variants 2x4096x2,2x4096x2x8] [--gelu 4096x128x4] [--json out.json]

Each LayerNorm variant (``ops/triton/layer_norm.Launch``'s text: programs per SM x tile elements x
sums kind [x warps] [p: prefetch]) is compiled by Triton's compiler and ptxas for sm_90a, bf16,
with the residual gradient, without and with the dx column sums (``dx_sum``, the step's folded
bias gradients). ``programs_per_sm_by_registers`` is how many such programs fit an SM's 65,536
registers: when it is below the variant's programs per SM, the extra programs wait for a free slot.
GELU variants: ``ops/triton/gelu.Launch``'s text (tile elements x most partial-sum rows x warps [p]).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer_norm import SHAPES  # noqa: E402
from check_shared_memory import compile_sm90, ptxas_usage  # noqa: E402

REGISTERS_PER_SM = 65536
POINTERS = {"DY": None, "X": None, "W": None, "DRES": None, "DX": None, "MEAN": "fp32", "RSTD": "fp32",
            "PART": "fp32"}
GELU_POINTERS = {"DACT": None, "H": None, "ACT": None, "DH": None, "PART": "fp32"}
GELU_WIDTHS = {"stage1": 384, "stage2": 768, "stage3": 1536, "stage4": 3072, "decoder": 2048}


def usage(compiled, warps: int) -> dict:
    """ptxas's registers and spills, and the programs an SM's registers hold."""
    use = ptxas_usage(compiled)
    use.update(warps=warps, programs_per_sm_by_registers=REGISTERS_PER_SM // (use["registers"] * 32 * warps))
    return use


def layer_norm_kernel(launch, width: int, dx_sum: bool):
    from hiera_autopatch.ops.triton import layer_norm as tln

    block_c = tln._next_pow2(width)
    block_r = max(1, launch.tile_elements // block_c)
    warps = launch.warps(block_r, block_c)
    constexprs = dict(C=width, BLOCK_R=block_r, BLOCK_C=block_c, HAS_RES=True, ACC_2D=launch.acc_2d,
                      DX_SUM=dx_sum, PARTS=3 if dx_sum else 2, PREFETCH=launch.prefetch)
    return compile_sm90(tln._layer_norm_bwd_kernel, "bf16", constexprs, warps, 3, pointers=POINTERS), warps


def gelu_kernel(launch, width: int):
    from hiera_autopatch.ops.triton import gelu as tgelu

    block_r, block_c = tgelu.tile(width, launch)
    constexprs = dict(F=width, BLOCK_R=block_r, BLOCK_C=block_c, SQRT1_2=tgelu._SQRT1_2, BETA=tgelu._BETA,
                      PREFETCH=launch.prefetch)
    return compile_sm90(tgelu._gelu_bwd_bias_kernel, "bf16", constexprs, launch.num_warps, 3,
                        pointers=GELU_POINTERS), launch.num_warps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="2x4096x2,2x4096x2p,2x4096x2x8,2x4096x2x8p,4x2048x2,4x2048x2p,4x2048x2x8p")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="Hiera-B shapes (both kernels), comma list")
    parser.add_argument("--gelu", default="", help="GELU kernel launches, comma list (none by default)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from hiera_autopatch.ops.triton import gelu as tgelu
    from hiera_autopatch.ops.triton import layer_norm as tln

    results = {"command": " ".join(sys.argv), "target": "sm_90a, bf16, with the residual gradient",
               "shipped": str(tln.LAUNCH), "gelu_shipped": str(tgelu.LAUNCH), "shapes": {}, "gelu": {}}
    shapes = args.shapes.split(",")
    for name in shapes:
        width = SHAPES[name][1]
        entry = results["shapes"].setdefault(name, {"width": width})
        for variant in args.variants.split(","):
            for dx_sum in (False, True):
                compiled, warps = layer_norm_kernel(tln.Launch.parse(variant), width, dx_sum)
                key = variant + ("+dx_sum" if dx_sum else "")
                entry[key] = usage(compiled, warps)
                print(name, key, json.dumps(entry[key]), flush=True)
    for name in shapes:
        width = GELU_WIDTHS[name]
        entry = results["gelu"].setdefault(name, {"width": width})
        for variant in filter(None, args.gelu.split(",")):
            compiled, warps = gelu_kernel(tgelu.Launch.parse(variant), width)
            entry[variant] = usage(compiled, warps)
            print("gelu", name, variant, json.dumps(entry[variant]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
