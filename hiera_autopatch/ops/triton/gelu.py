"""Exact GELU's backward, its recomputed output and the bias gradient before it, in one pass.

``ops/mlp.GeluMlp`` saves fc1's output ``h`` (N, F) and recomputes GELU in backward. From ``h``
and the gradient of GELU's output ``d_act`` its backward needs

    act = gelu(h)                  (fc2's weight gradient: d_out^T @ act)
    dh  = d_act * gelu'(h)         (fc1's output gradient)
    db1 = dh.sum(0)                (fc1's bias gradient)

Inductor computes ``act`` and ``dh`` in one kernel and ``db1`` in a second that reads ``dh`` back
from memory. Here one kernel writes ``act`` and ``dh`` and keeps each program's column sums of
``dh`` (as stored, in fp32) in a row of partials; a small second kernel adds those rows up, in a
fixed order (the result does not depend on timing).

The formulas are the ones Inductor and ATen use for the exact (erf) GELU, in fp32:
``gelu(h) = h * 0.5 * (1 + erf(h / sqrt2))``, ``gelu'(h) = cdf + h * pdf`` with
``cdf = 0.5 * (1 + erf(h / sqrt2))`` and ``pdf = exp(-h^2 / 2) / sqrt(2 pi)``.

Chain: kernels -> ``gelu_backward_bias`` (launcher) -> custom op ``hiera_autopatch::gelu_backward_bias``
(opaque to torch.compile, captured by CUDA graphs) -> ``ops/mlp.GeluMlp.backward``. Where the forward
kept GELU's output (``ops/mlp.keep_act_widths``), ``hiera_autopatch::gelu_grad_bias`` runs the same
kernel without writing it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import torch

from ._runtime import HAS_TRITON, launch_fields, tl, triton
from ._runtime import interpreting as _interpreting
from ._runtime import on_device as _on_device
from ._runtime import pdl as _pdl

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SQRT1_2 = math.sqrt(0.5)
_BETA = 0.5 * math.sqrt(0.5) * 2 / math.sqrt(math.pi)  # 1 / sqrt(2 pi): pdf = _BETA * exp(-h^2 / 2)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the kernel is launched; as text ``4096x128x4[p]`` (scripts/bench_gelu.py's variants):
    tile elements x most partial-sum rows x warps [p: prefetch]."""

    tile_elements: int = 4096  # a tile: rows x up to 256 columns
    max_parts: int = 128  # a program walks enough row tiles that at most this many rows of partial sums are left
    num_warps: int = 4
    prefetch: bool = False  # load the next row tile's inputs before this tile's math (see the kernel)

    @classmethod
    def parse(cls, text: str) -> "Launch":
        prefetch = text.endswith("p")
        fields = launch_fields(text[:-1] if prefetch else text)
        if len(fields) != 3:
            raise ValueError(f"GELU launch {text!r}: tile elements x most partial-sum rows x warps[p]")
        return cls(*fields, prefetch=prefetch)

    def __str__(self) -> str:
        return f"{self.tile_elements}x{self.max_parts}x{self.num_warps}" + ("p" if self.prefetch else "")


LAUNCH = Launch()
"""The shipped launch (benchmarks/results/h100_bench_gelu.json: 3.17 ms a step against 3.98 for
the first, 8192x256x8)."""

BEST_BY_WIDTH: Dict[int, Launch] = {
    # h100_bench_gelu.json, Hiera-B MAE's MLPs at batch 128: ~0.29 ms a step over LAUNCH, isolated
    384: Launch(4096, 128, 8), 768: Launch(4096, 128, 8),  # stages 1-2
    1536: Launch(2048, 128, 4),  # stage 3
    2048: Launch.parse("2048x64x4p"),  # decoder: session 30, see below
    3072: Launch(2048, 64, 4),  # stage 4
}
"""The per-width pick of session 21's sweep on an H100, with the decoder's width prefetching since
session 30: 0.154 against 0.171 ms a call in isolation (h100_bench_gelu_session29.json), and in the
graphed step on an H200 faster by a median 0.03-0.16 ms a step in each interleaved pair that did not
hold the first capture's place (h200_profile_interleaved_captures_session30.json,
h200_profile_interleaved_session30.json; scripts/profile_step.py's ``--interleave``)."""

LAUNCH_BY_WIDTH: Dict[int, Launch] = dict(BEST_BY_WIDTH)
"""Launches for some row widths (fc1's output width), over ``LAUNCH``: ``BEST_BY_WIDTH`` as shipped
(session 26). The graphed step on an H200 was faster with it in all four interleaved pairs, by
0.22-1.66 ms (h200_profile_pdl_gelu_keep_inductor.json, h200_profile_gelu_by_width.json), and the
bench 27.6 against 27.8 ms without a per-step sync, 28.5 against 28.5 with one, two runs on one
machine (h200_bench_graphs_session26_gelu_by_width.json, h200_bench_graphs_session26.json): a small
gain, not resolved beyond the pairs' spread. ``{}``: ``LAUNCH`` for every width
(``scripts/profile_step.py``'s ``+gelu_one_launch``)."""


def launch_for(width: int) -> Launch:
    """The launch for rows of ``width``: ``LAUNCH_BY_WIDTH``'s, else ``LAUNCH``."""
    return LAUNCH_BY_WIDTH.get(width, LAUNCH)


if HAS_TRITON:
    from ._runtime import pdl_start

    @triton.jit
    def _gelu_bwd_bias_kernel(
        DACT, H, ACT, DH, PART, n_rows, rows_per_program,
        F: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
        SQRT1_2: tl.constexpr, BETA: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
        STORE_ACT: tl.constexpr = True,
    ):
        # Rows [pid_r * rows_per_program, ...) x columns [pid_c * BLOCK_C, ...) of d_act, h, act,
        # dh: (n_rows, F), contiguous. PART (row programs, F) fp32: this program's column sums of dh.
        # PREFETCH: each tile's h and d_act are loaded one tile ahead (masked past the rows).
        # PDL: launched with programmatic dependent launch (_runtime.pdl_start). STORE_ACT False: act
        # is not written (the forward kept GELU's output; ACT is then any pointer, never touched).
        pdl_start(PDL)
        pid_r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        c_ok = cols < F
        total = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)  # per row slot, reduced once at the end
        first = pid_r * rows_per_program
        end = tl.minimum(first + rows_per_program, n_rows)
        if PREFETCH:
            rows = first + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
            mask = (rows < end)[:, None] & c_ok[None, :]
            offs = rows.to(tl.int64)[:, None] * F + cols[None, :]  # (BLOCK_R, BLOCK_C)
            h_next = tl.load(H + offs, mask=mask, other=0.0)
            d_act_next = tl.load(DACT + offs, mask=mask, other=0.0)
        for r0 in range(first, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
            mask = (rows < end)[:, None] & c_ok[None, :]
            offs = rows.to(tl.int64)[:, None] * F + cols[None, :]  # (BLOCK_R, BLOCK_C)
            if PREFETCH:
                h = h_next.to(tl.float32)
                d_act = d_act_next.to(tl.float32)
                mask_next = (rows + BLOCK_R < end)[:, None] & c_ok[None, :]
                h_next = tl.load(H + offs + BLOCK_R * F, mask=mask_next, other=0.0)
                d_act_next = tl.load(DACT + offs + BLOCK_R * F, mask=mask_next, other=0.0)
            else:
                h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
                d_act = tl.load(DACT + offs, mask=mask, other=0.0).to(tl.float32)
            erf = tl.math.erf(h * SQRT1_2)
            act = h * 0.5 * (1.0 + erf)
            cdf = 0.5 * (1.0 + erf)
            pdf = BETA * tl.exp(h * h * -0.5)
            dh = (d_act * (cdf + h * pdf)).to(DH.dtype.element_ty)
            if STORE_ACT:
                tl.store(ACT + offs, act.to(ACT.dtype.element_ty), mask=mask)
            tl.store(DH + offs, dh, mask=mask)
            total += dh.to(tl.float32)  # masked slots: h = d_act = 0, so dh = 0
        tl.store(PART + pid_r.to(tl.int64) * F + cols, tl.sum(total, 0), mask=c_ok)

    @triton.jit
    def _column_sums_kernel(PART, OUT, n_parts, F: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
        # PART (n_parts, F) fp32 -> OUT (F,): the column sums, rows added in order.
        pdl_start(PDL)
        cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)  # (BLOCK_W,)
        c_ok = cols < F
        total = tl.zeros([BLOCK_W], tl.float32)
        for p0 in range(0, n_parts, BLOCK_P):
            parts = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
            mask = (parts < n_parts)[:, None] & c_ok[None, :]
            total += tl.sum(tl.load(PART + parts[:, None] * F + cols[None, :], mask=mask, other=0.0), 0)
        tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=c_ok)


def supports(h: torch.Tensor) -> bool:
    """Our kernel can take this fc1 output: on CUDA (or under the Triton interpreter), a float dtype."""
    return HAS_TRITON and (h.is_cuda or _interpreting()) and h.dtype in _SUPPORTED_DTYPES and h.numel() > 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile(width: int, launch: Optional[Launch] = None) -> Tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for rows of ``width`` (``launch``: default the shipped one): up to 256
    columns, 128 where that divides the width and 256 does not (384: three full tiles, not two with
    one half empty)."""
    block_c = min(256, _next_pow2(width))
    if width % block_c and width % 128 == 0:
        block_c = 128
    return max(1, (launch or launch_for(width)).tile_elements // block_c), block_c


def gelu_backward_bias(d_act: torch.Tensor, h: torch.Tensor, store_act: bool = True
                       ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """-> (gelu(h), d_act * gelu'(h), that gradient's sum over all but the last dim) for the exact
    GELU; the first two in h's shape and dtype, the sum (F,) in h's dtype (autograd's ``sum(0)`` of
    the stored gradient, accumulated in fp32). ``store_act=False``: GELU's output is neither
    written nor returned (None), for a forward that kept it."""
    width = h.shape[-1]
    h2 = h.reshape(-1, width).contiguous()  # (N, F)
    d_act2 = d_act.reshape(-1, width).to(h.dtype).contiguous()
    n_rows = h2.shape[0]
    launch = launch_for(width)
    block_r, block_c = tile(width, launch)
    row_steps = triton.cdiv(n_rows, block_r)
    parts_max = launch.max_parts if h.is_cuda else 3  # the interpreter: a few programs, several steps each
    rows_per_program = triton.cdiv(row_steps, min(row_steps, parts_max)) * block_r
    n_parts = triton.cdiv(n_rows, rows_per_program)
    dh = torch.empty_like(h2)
    act = torch.empty_like(h2) if store_act else dh  # not stored: any pointer will do
    part = torch.empty(n_parts, width, device=h.device, dtype=torch.float32)  # every row written
    db = torch.empty(width, device=h.device, dtype=h.dtype)
    pdl = _pdl(h)
    with _on_device(h):
        _gelu_bwd_bias_kernel[(n_parts, triton.cdiv(width, block_c))](
            d_act2, h2, act, dh, part, n_rows, rows_per_program,
            F=width, BLOCK_R=block_r, BLOCK_C=block_c, SQRT1_2=_SQRT1_2, BETA=_BETA,
            PREFETCH=launch.prefetch, PDL=pdl, STORE_ACT=store_act, num_warps=launch.num_warps, launch_pdl=pdl,
        )
        _column_sums_kernel[(triton.cdiv(width, 32),)](part, db, n_parts, F=width, BLOCK_P=64, BLOCK_W=32,
                                                        PDL=pdl, num_warps=4, launch_pdl=pdl)
    return (act.view(h.shape) if store_act else None), dh.view(h.shape), db


@torch.library.custom_op("hiera_autopatch::gelu_backward_bias", mutates_args=())
def gelu_backward_bias_op(d_act: torch.Tensor, h: torch.Tensor
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gelu_backward_bias`` as a custom op: one opaque node for torch.compile and CUDA graphs."""
    return gelu_backward_bias(d_act, h)


@gelu_backward_bias_op.register_fake
def _gelu_backward_bias_shapes(d_act, h):
    act = torch.empty_like(h, memory_format=torch.contiguous_format)
    return act, torch.empty_like(act), h.new_empty(h.shape[-1:])


@torch.library.custom_op("hiera_autopatch::gelu_grad_bias", mutates_args=())
def gelu_grad_bias_op(d_act: torch.Tensor, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``gelu_backward_bias`` without GELU's output, for a forward that kept it: (dh, db)."""
    _, dh, db = gelu_backward_bias(d_act, h, store_act=False)
    return dh, db


@gelu_grad_bias_op.register_fake
def _gelu_grad_bias_shapes(d_act, h):
    return torch.empty_like(h, memory_format=torch.contiguous_format), h.new_empty(h.shape[-1:])
