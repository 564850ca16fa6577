"""Shared memory of our window-attention kernels, compiled for Hopper (sm_90) without a GPU.

    python scripts/check_shared_memory.py [--shapes decoder,stage3-global-mae] [--dtypes bf16,fp32]
        [--config '{"BLOCK_N": 128}'] [--json out.json]

For each Hiera-B shape (``window_attention.HIERA_B_SHAPES``) and dtype, the configs the launchers
would pick (``full_config`` with the dtype's item size: ``TUNED`` for 2-byte dtypes) are compiled
by Triton's own compiler and ptxas for sm_90, and the shared memory each kernel needs is read back.
An H200 block may use at most 227 KB; a config past it fails at launch (OutOfResources), which the
CPU interpreter never shows. Prints one line per shape and dtype; exits 1 if any kernel does not fit.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

HOPPER_SHARED_BYTES = 227 * 1024  # what one block may use on sm_90
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
_POINTERS = {"QKV": None, "OUT": None, "DOUT": None, "DQKV": None, "LSE": "fp32", "DELTA": "fp32", "DBIAS": "fp32"}
_FLOATS = {"qk_scale", "sm_scale"}


def ptxas_usage(compiled) -> dict:
    """Registers a thread and spill bytes (stores, loads) of a compiled kernel, from ``ptxas -v``
    on its PTX for sm_90a (Triton's own ptxas)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as fh:
            fh.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, report).group(1))  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"),
            "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads")}


def compile_sm90(kernel, dtype: str, constexprs: dict, num_warps: int, num_stages: int, pointers=None):
    """``kernel`` (a @triton.jit function) compiled for sm_90 with these constexprs. ``pointers``:
    its pointer arguments -> element type (None: ``dtype``); default: the attention kernels'."""
    pointers = _POINTERS if pointers is None else pointers
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    parameters = inspect.signature(kernel.fn).parameters
    params = list(parameters)
    constexprs = {**{name: p.default for name, p in parameters.items()  # defaults (PDL=False)
                     if p.default is not inspect.Parameter.empty}, **constexprs}
    signature = {}
    for name in params:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + (pointers[name] or dtype)
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(params.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def check(wa, name: str, nw: int, T: int, H: int, D: int, S: int, dtype: str, config=None,
          registers: bool = False) -> dict:
    """Shared bytes of the forward, the dk/dv backward, (keys over several blocks) the dq kernel and
    (``KEY_TILES``, ``KEY_TILES_BWD``) the tiles forward and backward, at the launchers' config (``config``: keys that override it, as the launchers' argument);
    ``registers``: also each kernel's registers and spill bytes (``ptxas_usage``)."""
    cfg = wa.full_config(config, T, S, D, nw, DTYPES[dtype])
    common = dict(H=H, D=D, T=T, S=S, G=cfg["G"], BLOCK_D=max(16, wa._next_pow2(D)),
                  DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")  # fp32: as without allow_tf32
    fwd = dict(common, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
    bwd = dict(common, BLOCK_M=cfg["BLOCK_M_BWD"], BLOCK_N=cfg["BLOCK_N_BWD"], POOL_AMAX=False)
    single_kv = wa.backward_is_single_pass(cfg, T)
    kernels = {"fwd": (wa._window_attention_fwd_kernel, fwd, cfg["num_warps"], cfg["num_stages"])}
    for bias_grad in (False, True):  # without / with the qkv bias's partial sums
        suffix = "+bias" if bias_grad else ""
        variant = dict(bwd, BIAS_GRAD=bias_grad)
        kernels["bwd_dkdv" + suffix] = (wa._window_attention_bwd_dkdv_kernel, dict(variant, SINGLE_KV=single_kv),
                                        cfg["num_warps_bwd"], cfg["num_stages_bwd"])
        if not single_kv:
            kernels["bwd_dq" + suffix] = (wa._window_attention_bwd_dq_kernel, variant,
                                          cfg["num_warps_bwd"], cfg["num_stages_bwd"])
    if wa.uses_key_tiles(cfg, T, D, DTYPES[dtype], forward=True):
        tail = wa.query_tiles(T // S, cfg["BLOCK_M"])[1]
        fwd_tiles = dict(common, BLOCK_M=cfg["BLOCK_M"], TAIL_M=tail, N0=0, N1=0, N2=0)
        fwd_tiles.update(zip(("N0", "N1", "N2"), wa.key_tiles(T)))
        del fwd_tiles["G"]
        kernels["fwd_tiles"] = (wa._window_attention_fwd_tiles_kernel, fwd_tiles, cfg["num_warps"], cfg["num_stages"])
    if wa.uses_key_tiles(cfg, T, D, DTYPES[dtype]):
        n0, n1, n2 = wa.key_tiles(T)
        tiles = dict(common, BLOCK_M=cfg["BLOCK_M_BWD"], N0=n0, N1=n1, N2=n2, POOL_AMAX=False)
        del tiles["G"]
        kernels["bwd_key_tiles"] = (wa._window_attention_bwd_key_tiles_kernel, tiles,
                                    cfg["num_warps_bwd"], cfg["num_stages_bwd"])
    shared, usage = {}, {}
    for kernel_name, (kernel, constexprs, num_warps, num_stages) in kernels.items():
        compiled = compile_sm90(kernel, dtype, constexprs, num_warps, num_stages)
        shared[kernel_name] = int(compiled.metadata.shared)
        if registers:
            usage[kernel_name] = ptxas_usage(compiled)
    entry = {"shape": name, "dtype": dtype, "config": cfg, "shared_bytes": shared,
             "fits": max(shared.values()) <= HOPPER_SHARED_BYTES}
    if registers:
        entry["ptxas"] = usage
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="", help="comma list of HIERA_B_SHAPES names (default: all)")
    ap.add_argument("--dtypes", default="bf16,fp32", help=f"comma list of {', '.join(DTYPES)}")
    ap.add_argument("--config", default="", help="JSON of config keys to override, e.g. a tuner candidate")
    ap.add_argument("--registers", action="store_true",
                    help="also registers and spill bytes per kernel (ptxas -v on the PTX)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (set before triton imports)
    from hiera_autopatch.ops.triton import window_attention as wa

    if not wa.HAS_TRITON:
        print("check_shared_memory: triton is not installed", file=sys.stderr)
        return 2
    shapes = {s[0]: s for s in wa.HIERA_B_SHAPES}
    names = [n for n in args.shapes.split(",") if n] or list(shapes)
    unknown = [n for n in names if n not in shapes] + [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        ap.error(f"unknown shape or dtype: {', '.join(unknown)}")
    results = []
    for name in names:
        for dtype in args.dtypes.split(","):
            entry = check(wa, *shapes[name], dtype, json.loads(args.config) if args.config else None,
                          registers=args.registers)
            results.append(entry)
            kb = ", ".join(f"{kernel} {size / 1024:.0f} KB" for kernel, size in entry["shared_bytes"].items())
            if args.registers:
                kb += "; spill stores " + ", ".join(f"{kernel} {use['spill_store_bytes']} B"
                                                    for kernel, use in entry["ptxas"].items())
            print(f"{name:20s} {dtype}: {kb}{'' if entry['fits'] else '  > 227 KB: does not fit'}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"limit_bytes": HOPPER_SHARED_BYTES, "results": results}, fh, indent=1)
    return 0 if all(entry["fits"] for entry in results) else 1


if __name__ == "__main__":
    sys.exit(main())
