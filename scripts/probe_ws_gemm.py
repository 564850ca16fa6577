"""Does Triton warp-specialise a plain persistent GEMM on this GPU, and how fast is it against cuBLAS?

    python scripts/probe_ws_gemm.py --variant ws [--gelu] [--json out.json]

One variant a process (so a hung kernel is cut by the caller's ``timeout`` alone): ``cublas``
(``x @ w.T``), ``persistent`` (our persistent TMA GEMM, tile and K loops flattened) or ``ws``
(the same tile loop under ``tl.range(..., warp_specialize=True)``, 4 warps a group: the only
setting at which Triton 3.6 partitions it for sm_90; with 64x128 tiles, compiled on the CPU
machine, not with 128-row or 256-column ones). Tiles are loaded and the output stored through
tensor descriptors, as Triton's own warp-specialised matmuls do. ``--gelu``: erf-GELU
applied to the tile before the store (an epilogue of elementwise math only). The Hiera-B MAE
decoder's fc1 shape (25,088 x 512 -> 2,048, bf16). Prints one JSON line: mean ms a call over 50
CUDA-event-timed calls and the relative error against cuBLAS (GELU applied to it with ``--gelu``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# the package's GELU-epilogue GEMM pieces: tile order, one output tile's product, exact GELU
from hiera_autopatch.ops.triton.gemm_gelu import _gelu, _tile, _tma_tile_product


@triton.jit
def _persistent_gemm(a_desc, b_desc, c_desc, M, N, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     N_PROGRAMS: tl.constexpr, WS: tl.constexpr, GELU: tl.constexpr):
    # C (M, N) = A (M, K) @ B (N, K)^T, N_PROGRAMS programs walking the tiles in GROUP_M row groups
    n_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles, N_PROGRAMS, flatten=not WS, warp_specialize=WS):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_tile_product(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, False, "tf32",
                                BLOCK_M, BLOCK_N, BLOCK_K)  # (BLOCK_M, BLOCK_N) fp32; b_desc holds B (N, K)
        if GELU:
            acc = _gelu(acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def persistent_gemm(x: torch.Tensor, w: torch.Tensor, block: str = "128x128x64", stages: int = 4,
                    ws: bool = False, gelu: bool = False, programs: int = 0) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T [then erf-GELU] by ``_persistent_gemm``; ``programs``: 0 = one per SM."""
    (M, K), N = x.shape, w.shape[0]
    bm, bn, bk = (int(v) for v in block.split("x"))
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if not programs:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(triton.cdiv(M, bm) * triton.cdiv(N, bn), programs)
    _persistent_gemm[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=8, N_PROGRAMS=programs, WS=ws, GELU=gelu, num_warps=4 if ws else 8, num_stages=stages)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("cublas", "persistent", "ws"), required=True)
    ap.add_argument("--gelu", action="store_true")
    ap.add_argument("--block", default="128x128x64", help="BLOCK_M x BLOCK_N x BLOCK_K")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    M, K, N = 25088, 512, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5
    reference = x @ w.T
    if args.gelu:
        reference = torch.nn.functional.gelu(reference)
    if args.variant == "cublas":
        def run():
            out = x @ w.T
            return torch.nn.functional.gelu(out) if args.gelu else out
    else:
        def run():
            return persistent_gemm(x, w, args.block, args.stages, args.variant == "ws", args.gelu)
    got = run()
    torch.cuda.synchronize()
    err = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
    for _ in range(5):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        run()
    end.record()
    end.synchronize()
    result = {"variant": args.variant, "gelu": args.gelu, "block": args.block, "stages": args.stages,
              "ms": start.elapsed_time(end) / 50, "rel_err": err, "gpu": torch.cuda.get_device_name(),
              "triton": triton.__version__, "torch": torch.__version__}
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
