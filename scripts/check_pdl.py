"""Our Triton kernels with programmatic dependent launch, compiled for Hopper (sm_90) without a GPU:
each must wait for the kernel before it (``griddepcontrol.wait``) before any global load or store.

    python scripts/check_pdl.py [--json out.json]

A kernel launched with ``launch_pdl`` may start while the previous one still runs, so a load before
the wait could read data not yet written. Every kernel of ``ops/triton`` is compiled with ``PDL``
on and off (bf16, a small Hiera-like shape) by Triton's compiler, and its PTX is read: with PDL,
the wait is the first grid-dependency instruction and comes before the first ``ld.global`` /
``st.global`` / atomic; without PDL there is none. Prints JSON; exits 1 if a kernel fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_shared_memory import compile_sm90  # noqa: E402

_MEMORY = re.compile(r"\b(ld|st|red|atom)\.global")


def kernels():
    """(name, jit function, constexprs, warps, pointer dtypes) of every kernel in ops/triton."""
    from hiera_autopatch.ops.triton import gelu as tgelu
    from hiera_autopatch.ops.triton import layer_norm as tln
    from hiera_autopatch.ops.triton import window_attention as wa

    gelu_pointers = {"DACT": None, "H": None, "ACT": None, "DH": None, "PART": "fp32", "OUT": None}
    ln_pointers = {"DY": None, "X": None, "W": None, "DRES": None, "DX": None, "MEAN": "fp32", "RSTD": "fp32",
                   "PART": "fp32", "DW": None, "DB": None, "DS": None}
    attention = dict(H=2, D=96, T=64, S=1, G=1, BLOCK_D=128, DOT_PRECISION="tf32")
    block_r, block_c = tgelu.tile(1536)
    return [
        ("gelu_bwd_bias", tgelu._gelu_bwd_bias_kernel,
         dict(F=1536, BLOCK_R=block_r, BLOCK_C=block_c, SQRT1_2=tgelu._SQRT1_2, BETA=tgelu._BETA, PREFETCH=False),
         4, gelu_pointers),
        ("gelu_column_sums", tgelu._column_sums_kernel, dict(F=1536, BLOCK_P=64, BLOCK_W=32), 4, gelu_pointers),
        ("layer_norm_bwd", tln._layer_norm_bwd_kernel,
         dict(C=384, BLOCK_R=8, BLOCK_C=512, HAS_RES=True, ACC_2D=True, DX_SUM=True, PARTS=3, PREFETCH=False),
         4, ln_pointers),
        ("layer_norm_sum_parts", tln._sum_parts_kernel, dict(C=384, PARTS=3, BLOCK_P=128, BLOCK_W=32), 4, ln_pointers),
        ("attention_fwd", wa._window_attention_fwd_kernel, dict(attention, BLOCK_M=64, BLOCK_N=64), 4, None),
        ("attention_bwd_dkdv", wa._window_attention_bwd_dkdv_kernel,
         dict(attention, BLOCK_M=16, BLOCK_N=32, POOL_AMAX=False, SINGLE_KV=False, BIAS_GRAD=True), 4, None),
        ("attention_bwd_delta", wa._window_attention_bwd_delta_kernel,
         dict(H=2, D=96, Tq=64, BLOCK_R=64, BLOCK_D=128), 4, {"DOUT": None, "OUT": None, "DELTA": "fp32"}),
        ("attention_bwd_dq", wa._window_attention_bwd_dq_kernel,
         dict(attention, BLOCK_M=16, BLOCK_N=32, POOL_AMAX=False, BIAS_GRAD=True), 4, None),
    ]


def order(ptx: str) -> dict:
    """Line numbers of the first grid-dependency wait, launch-dependents and global memory access."""
    lines = ptx.splitlines()

    def first(test):
        return next((i for i, line in enumerate(lines) if test(line)), None)

    return {"wait": first(lambda line: "griddepcontrol.wait" in line),
            "launch_dependents": first(lambda line: "griddepcontrol.launch_dependents" in line),
            "memory": first(lambda line: _MEMORY.search(line) is not None)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results, failed = {"command": " ".join(sys.argv), "target": "sm_90, bf16", "kernels": {}}, []
    for name, kernel, constexprs, warps, pointers in kernels():
        entry = {}
        for pdl in (False, True):
            compiled = compile_sm90(kernel, "bf16", dict(constexprs, PDL=pdl), warps, 3, pointers=pointers)
            entry["pdl" if pdl else "plain"] = order(compiled.asm["ptx"])
        with_pdl, plain = entry["pdl"], entry["plain"]
        entry["ok"] = (plain["wait"] is None and plain["launch_dependents"] is None
                       and with_pdl["wait"] is not None and with_pdl["memory"] is not None
                       and with_pdl["wait"] < with_pdl["memory"])
        if not entry["ok"]:
            failed.append(name)
        results["kernels"][name] = entry
        print(name, json.dumps(entry), flush=True)
    results["failed"] = failed
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
