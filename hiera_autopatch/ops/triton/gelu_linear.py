"""fc2's forward with the exact GELU applied as its input is loaded: ``gelu(h) @ w.T + b``.

``ops/mlp.GeluMlp``'s forward runs fc1 (cuBLAS), GELU (a pointwise kernel that reads fc1's output
``h`` and writes ``act``, both hidden-sized) and fc2 (cuBLAS, which reads ``act`` back). Here fc2's
GEMM loads ``h`` tiles, computes GELU in fp32 and rounds it to ``h``'s dtype in registers (the very
values the pointwise kernel would have stored), then multiplies: ``act`` is never written or read.

Experimental, off (``ops/mlp.gelu_prologue``): whether a Triton GEMM with this prologue beats
cuBLAS + the pointwise kernel on Hiera's shapes is what ``scripts/bench_gelu_linear.py`` measures.

Chain: kernel -> ``gelu_linear`` (launcher) -> custom op ``hiera_autopatch::gelu_linear`` (opaque to
torch.compile, captured by CUDA graphs) -> ``ops/mlp.GeluMlp.forward``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

import torch

from ._runtime import HAS_TRITON, launch_fields, tl, triton
from ._runtime import interpreting as _interpreting
from ._runtime import on_device as _on_device

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # fp32 would need IEEE dots: not worth a kernel
_SQRT1_2 = math.sqrt(0.5)


@dataclasses.dataclass(frozen=True)
class Launch:
    """Tiles and warps; as text ``128x128x64x8x3`` (scripts/bench_gelu_linear.py's variants):
    BLOCK_M x BLOCK_N x BLOCK_K x warps x pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def parse(cls, text: str) -> "Launch":
        fields = launch_fields(text)
        if len(fields) != 5:
            raise ValueError(f"gelu_linear launch {text!r}: BLOCK_M x BLOCK_N x BLOCK_K x warps x stages")
        return cls(*fields)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}x{self.num_warps}x{self.num_stages}"


LAUNCH = Launch()
LAUNCH_BY_WIDTH: Dict[int, Launch] = {}
"""Launches by fc2's output width (the block's dim), over ``LAUNCH``."""


def launch_for(width: int) -> Launch:
    """The launch for fc2 with ``width`` output features: ``LAUNCH_BY_WIDTH``'s, else ``LAUNCH``."""
    return LAUNCH_BY_WIDTH.get(width, LAUNCH)


if HAS_TRITON:

    @triton.jit
    def _gelu_linear_kernel(
        H, W, B, OUT, M, N, K,
        HAS_BIAS: tl.constexpr, SQRT1_2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # H (M, K) contiguous, W (N, K) contiguous (nn.Linear's weight), B (N,), OUT (M, N).
        # Programs walk GROUP_M row tiles down one column tile before the next, so W's tiles stay in L2.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
        pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        ks = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        r_ok, c_ok = rows < M, cols < N
        h_ptrs = H + rows.to(tl.int64)[:, None] * K + ks[None, :]  # (BLOCK_M, BLOCK_K)
        w_ptrs = W + cols.to(tl.int64)[None, :] * K + ks[:, None]  # (BLOCK_K, BLOCK_N): W^T's tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks + k0 < K
            h = tl.load(h_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            act = (h * 0.5 * (1.0 + tl.math.erf(h * SQRT1_2))).to(H.dtype.element_ty)  # as stored
            w = tl.load(w_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
            acc = tl.dot(act, w, acc)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = OUT + rows.to(tl.int64)[:, None] * N + cols[None, :]  # (BLOCK_M, BLOCK_N)
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


def supports(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Our kernel can take fc1's output ``h`` and fc2's weight ``w``: on CUDA (or in the Triton
    interpreter), half or bfloat16, one dtype, something to multiply."""
    return (HAS_TRITON and (h.is_cuda or _interpreting()) and h.dtype in _SUPPORTED_DTYPES
            and w.dtype == h.dtype and h.numel() > 0 and w.numel() > 0)


def gelu_linear(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                launch: Optional[Launch] = None) -> torch.Tensor:
    """``F.linear(F.gelu(h), w, b)`` for the exact GELU; (..., N) in h's dtype."""
    n_out, width = w.shape
    h2 = h.reshape(-1, width).contiguous()  # (M, K)
    w = w.contiguous()
    n_rows = h2.shape[0]
    out = torch.empty(n_rows, n_out, device=h.device, dtype=h.dtype)  # (M, N)
    launch = launch or launch_for(n_out)
    if not h.is_cuda:  # the interpreter: small tiles keep the tests quick
        launch = Launch(16, 16, 16, 1, 1)
    grid = (triton.cdiv(n_rows, launch.block_m) * triton.cdiv(n_out, launch.block_n),)
    bias = b.to(h.dtype).contiguous() if b is not None else out  # no bias: any pointer, never read
    with _on_device(h):
        _gelu_linear_kernel[grid](
            h2, w, bias, out, n_rows, n_out, width, HAS_BIAS=b is not None, SQRT1_2=_SQRT1_2,
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, GROUP_M=8,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
        )
    return out.view(*h.shape[:-1], n_out)


@torch.library.custom_op("hiera_autopatch::gelu_linear", mutates_args=())
def gelu_linear_op(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``gelu_linear`` as a custom op: one opaque node for torch.compile and CUDA graphs."""
    return gelu_linear(h, w, b)


@gelu_linear_op.register_fake
def _gelu_linear_shape(h, w, b):
    return h.new_empty(*h.shape[:-1], w.shape[0])
