"""LayerNorm backward in one pass over the rows, with the residual's gradient added in.

In a Hiera block each LayerNorm's input ``x`` also feeds the residual add, so autograd needs

    dx = d_res + rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy * xhat))     (per row, xhat = (x-mean)*rstd)
    dw = sum over rows of dy * xhat,  db = sum over rows of dy

Inductor computes ``dx`` in one kernel and ``dw``/``db`` in another that reads ``dy`` and ``x``
again, then finishes its split sums in two more. Here one kernel reads ``dy``, ``x`` and ``d_res``
once, writes ``dx``, and keeps ``dw``/``db`` as per-program fp32 column sums over its rows; a small
second kernel adds those partial rows up (in a fixed order: the result does not depend on timing).

Chain: kernels -> ``layer_norm_backward`` (launcher) -> custom op ``hiera_autopatch::layer_norm_backward``
(opaque to torch.compile, captured by CUDA graphs) -> ``ops/layer_norm.py`` (the autograd Function).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from ._runtime import HAS_TRITON, launch_fields, tl, triton
from ._runtime import interpreting as _interpreting
from ._runtime import on_device as _on_device
from ._runtime import pdl as _pdl

MAX_WIDTH = 4096  # one row in registers: BLOCK_C = next_pow2(C) <= 4096
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the backward kernel is launched; as text ``2x4096x2[x8][p]`` (the benchmark scripts'
    variants): programs per SM x tile elements x sums kind [x warps] [p: prefetch]."""

    programs_per_sm: int = 2  # each program over its share of the rows
    tile_elements: int = 4096  # rows a step x BLOCK_C
    acc_2d: bool = True  # weight-gradient sums kept per row slot (2), or column sums each step (1)
    num_warps: Optional[int] = None  # None: 4, or 8 for tiles over 4096 elements
    prefetch: bool = False  # load the next row step's tiles before this step's math (see the kernel)

    @classmethod
    def parse(cls, text: str) -> "Launch":
        prefetch = text.endswith("p")
        per_sm, tile, *rest = launch_fields(text[:-1] if prefetch else text)
        if len(rest) > 2 or (rest and rest[0] not in (1, 2)):
            raise ValueError(f"LayerNorm launch {text!r}: programs per SM x tile elements [x 1|2 [x warps]][p]")
        return cls(per_sm, tile, not rest or rest[0] == 2, rest[1] if len(rest) > 1 else None, prefetch)

    def __str__(self) -> str:
        text = f"{self.programs_per_sm}x{self.tile_elements}x{2 if self.acc_2d else 1}"
        return text + (f"x{self.num_warps}" if self.num_warps else "") + ("p" if self.prefetch else "")

    def warps(self, block_r: int, block_c: int) -> int:
        return self.num_warps or (4 if block_r * block_c <= 4096 else 8)


LAUNCH = Launch()
"""The shipped launch: the best of scripts/bench_layer_norm.py's sweep on an H100 over Hiera-B MAE's
norms (benchmarks/results/h100_bench_layer_norm_variants.json: 1.98 ms a step against Inductor's
2.35; more programs an SM, larger tiles, or column sums each step were slower)."""

BEST_BY_WIDTH: Dict[int, Launch] = {
    # h200_bench_layer_norm_prefetch.json (with the dx sums), a call against LAUNCH's: stage 1's
    # norms 0.049 vs 0.053 ms (4 a step), stage 2's 0.038 vs 0.061 (6 a step); ~0.15 ms a step, isolated
    96: Launch(4, 2048, prefetch=True),
    192: Launch(2, 4096, num_warps=8, prefetch=True),
}
"""The widths where a launch beat ``LAUNCH`` in session 26's sweep on an H200; at 384, 512 and 768
``LAUNCH`` was the fastest."""

LAUNCH_BY_WIDTH: Dict[int, Launch] = dict(BEST_BY_WIDTH)
"""Launches for some row widths, over ``LAUNCH``. ``BEST_BY_WIDTH`` since session 32: in the graphed
step timed in interleaved rounds on an H100 it was faster in both pairs, by a round median of 0.16
and 0.02 ms (31 and 24 of 40 rounds; h100_profile_ln_pdl_mask_interleaved_session32.json,
``scripts/profile_step.py``'s ``+ln_by_width``)."""


def launch_for(width: int) -> Launch:
    """The launch for rows of ``width``: ``LAUNCH_BY_WIDTH``'s, else ``LAUNCH``."""
    return LAUNCH_BY_WIDTH.get(width, LAUNCH)


if HAS_TRITON:
    from ._runtime import pdl_start

    @triton.jit
    def _load_row_step(DY, X, MEAN, RSTD, DRES, r0, end, cols, c_ok, C: tl.constexpr,
                       BLOCK_R: tl.constexpr, HAS_RES: tl.constexpr):
        # One row step's inputs as stored: dy, x, d_res (BLOCK_R, BLOCK_C; without HAS_RES dy
        # again, unused), mean, rstd (BLOCK_R,). Rows past ``end``: masked, nothing read.
        rows = r0 + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        r_ok = rows < end
        mask = r_ok[:, None] & c_ok[None, :]  # (BLOCK_R, BLOCK_C)
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0)
        x = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_RES:
            res = tl.load(DRES + offs, mask=mask, other=0.0)
        else:
            res = dy
        mean = tl.load(MEAN + rows, mask=r_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=r_ok, other=0.0)
        return dy, x, res, mean, rstd

    @triton.jit
    def _layer_norm_bwd_kernel(
        DY, X, MEAN, RSTD, W, DRES, DX, PART,
        n_rows, rows_per_program,
        C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_RES: tl.constexpr,
        ACC_2D: tl.constexpr, DX_SUM: tl.constexpr, PARTS: tl.constexpr, PREFETCH: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        # Rows [pid * rows_per_program, ...) of dy, x, d_res, dx: (n_rows, C), contiguous.
        # PART (programs, 2*C or 3*C) fp32: this program's sums of dy*xhat (columns 0..C), dy
        # (C..2C) and, with DX_SUM, dx as stored (2C..3C: the bias gradient of the Linear whose
        # output's gradient dx is); PARTS: 3 with DX_SUM, else 2. PREFETCH: each step's tiles are
        # loaded one step ahead (registers hold two steps' inputs), so a program's few steps do not
        # each wait for their loads; without it the loads are issued at the step that uses them.
        # PDL: launched with programmatic dependent launch (_runtime.pdl_start).
        pdl_start(PDL)
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        c_ok = cols < C
        w = tl.load(W + cols, mask=c_ok, other=0.0).to(tl.float32)
        # ACC_2D: per-(row slot, column) sums, reduced over the slots once at the end (more
        # registers); else column sums, reduced over each step's rows
        if ACC_2D:
            dw_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
            db_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
            ds_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_C], tl.float32)
            db_acc = tl.zeros([BLOCK_C], tl.float32)
            ds_acc = tl.zeros([BLOCK_C], tl.float32)
        first = pid * rows_per_program
        end = tl.minimum(first + rows_per_program, n_rows)
        if PREFETCH:
            dy_next, x_next, res_next, mean_next, rstd_next = _load_row_step(
                DY, X, MEAN, RSTD, DRES, first, end, cols, c_ok, C, BLOCK_R, HAS_RES)
        for r0 in range(first, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
            r_ok = rows < end
            mask = r_ok[:, None] & c_ok[None, :]  # (BLOCK_R, BLOCK_C)
            offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
            if PREFETCH:
                dy, x, res, mean, rstd = dy_next, x_next, res_next, mean_next, rstd_next
                dy_next, x_next, res_next, mean_next, rstd_next = _load_row_step(
                    DY, X, MEAN, RSTD, DRES, r0 + BLOCK_R, end, cols, c_ok, C, BLOCK_R, HAS_RES)
                dy = dy.to(tl.float32)
                x = x.to(tl.float32)
                mean = mean.to(tl.float32)
                rstd = rstd.to(tl.float32)
            else:
                dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
                mean = tl.load(MEAN + rows, mask=r_ok, other=0.0).to(tl.float32)  # (BLOCK_R,)
                rstd = tl.load(RSTD + rows, mask=r_ok, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = w[None, :] * dy
            c1 = tl.sum(xhat * wdy, 1) / C  # (BLOCK_R,)
            c2 = tl.sum(wdy, 1) / C
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if HAS_RES:
                if PREFETCH:
                    dx += res.to(tl.float32)
                else:
                    dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
            dx_out = dx.to(DX.dtype.element_ty)
            tl.store(DX + offs, dx_out, mask=mask)
            if ACC_2D:
                dw_acc += dy * xhat
                db_acc += dy
                if DX_SUM:
                    ds_acc += dx_out.to(tl.float32)  # rows past the end: 0; columns past C: never stored
            else:
                dw_acc += tl.sum(dy * xhat, 0)
                db_acc += tl.sum(dy, 0)
                if DX_SUM:
                    ds_acc += tl.sum(dx_out.to(tl.float32), 0)
        part = PART + pid.to(tl.int64) * (PARTS * C) + cols
        if ACC_2D:
            tl.store(part, tl.sum(dw_acc, 0), mask=c_ok)
            tl.store(part + C, tl.sum(db_acc, 0), mask=c_ok)
            if DX_SUM:
                tl.store(part + 2 * C, tl.sum(ds_acc, 0), mask=c_ok)
        else:
            tl.store(part, dw_acc, mask=c_ok)
            tl.store(part + C, db_acc, mask=c_ok)
            if DX_SUM:
                tl.store(part + 2 * C, ds_acc, mask=c_ok)

    @triton.jit
    def _sum_parts_kernel(PART, DW, DB, DS, n_parts, C: tl.constexpr, PARTS: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
        # PART (n_parts, PARTS*C) fp32 -> its column sums: columns 0..C to DW, C..2C to DB and,
        # with PARTS 3, 2C..3C to DS.
        pdl_start(PDL)
        cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)  # (BLOCK_W,) of PARTS*C
        c_ok = cols < PARTS * C
        total = tl.zeros([BLOCK_W], tl.float32)
        for p0 in range(0, n_parts, BLOCK_P):
            parts = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
            mask = (parts < n_parts)[:, None] & c_ok[None, :]
            total += tl.sum(tl.load(PART + parts[:, None] * (PARTS * C) + cols[None, :], mask=mask,
                                    other=0.0), 0)
        tl.store(DW + cols, total.to(DW.dtype.element_ty), mask=cols < C)
        tl.store(DB + (cols - C), total.to(DB.dtype.element_ty), mask=(cols >= C) & (cols < 2 * C))
        if PARTS == 3:
            tl.store(DS + (cols - 2 * C), total.to(DS.dtype.element_ty), mask=c_ok & (cols >= 2 * C))


def supports(x: torch.Tensor, weight: Optional[torch.Tensor]) -> bool:
    """Our backward can take this LayerNorm: a last-dim norm with a weight and a bias, on CUDA (or
    under the Triton interpreter), width <= 4096."""
    return (
        HAS_TRITON
        and (x.is_cuda or _interpreting())
        and x.dtype in _SUPPORTED_DTYPES
        and weight is not None
        and weight.dim() == 1
        and 0 < x.shape[-1] == weight.shape[0] <= MAX_WIDTH
        and x.numel() > 0
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _programs(device: torch.device, row_steps: int, launch: Launch) -> int:
    if device.type != "cuda":
        return min(row_steps, 4)  # the interpreter: a few programs, each over several steps
    return min(row_steps, launch.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                        weight: torch.Tensor, d_res: Optional[torch.Tensor] = None, dx_sum: bool = False,
                        ) -> Tuple[torch.Tensor, ...]:
    """-> (dx, dw, db) of ``layer_norm(x, (C,), weight, bias)`` given the output's gradient ``dy``,
    the forward's per-row ``mean`` and ``rstd`` (``aten.native_layer_norm``'s), and, when ``x`` also
    fed a residual add, that add's gradient ``d_res`` (added into dx). dx in x's dtype and shape,
    dw and db in weight's dtype. ``dx_sum``: (dx, dw, db, ds), ``ds`` (C,) the column sums of dx as
    stored, in dx's dtype: the bias gradient of a Linear whose output was ``x``."""
    C = x.shape[-1]
    dy2 = dy.reshape(-1, C).contiguous()  # (N, C)
    x2 = x.reshape(-1, C).contiguous()
    res2 = d_res.reshape(-1, C).contiguous() if d_res is not None else dy2  # (not read without HAS_RES)
    n_rows = x2.shape[0]
    launch = launch_for(C)
    block_c = _next_pow2(C)
    block_r = max(1, min(launch.tile_elements // block_c, _next_pow2(n_rows)))  # rows a step
    row_steps = triton.cdiv(n_rows, block_r)
    programs = _programs(x.device, row_steps, launch)
    rows_per_program = triton.cdiv(row_steps, programs) * block_r
    programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(x2)
    parts = 3 if dx_sum else 2  # sums kept per column: dw, db[, ds]
    part = torch.empty(programs, parts * C, device=x.device, dtype=torch.float32)  # every row written
    dw = torch.empty(C, device=x.device, dtype=weight.dtype)
    db = torch.empty(C, device=x.device, dtype=weight.dtype)
    ds = torch.empty(C, device=x.device, dtype=x.dtype) if dx_sum else db  # (not written without)
    block_w = 32  # columns a finishing program: parts*C/32 programs over the partial rows
    pdl = _pdl(x)
    with _on_device(x):
        _layer_norm_bwd_kernel[(programs,)](
            dy2, x2, mean.reshape(-1), rstd.reshape(-1), weight, res2, dx, part,
            n_rows, rows_per_program,
            C=C, BLOCK_R=block_r, BLOCK_C=block_c, HAS_RES=d_res is not None, ACC_2D=launch.acc_2d,
            DX_SUM=dx_sum, PARTS=parts, PREFETCH=launch.prefetch, PDL=pdl,
            num_warps=launch.warps(block_r, block_c), launch_pdl=pdl,
        )
        _sum_parts_kernel[(triton.cdiv(parts * C, block_w),)](
            part, dw, db, ds, programs, C=C, PARTS=parts, BLOCK_P=128, BLOCK_W=block_w, PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )
    if dx_sum:
        return dx.view(x.shape), dw, db, ds
    return dx.view(x.shape), dw, db


@torch.library.custom_op("hiera_autopatch::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                           weight: torch.Tensor, d_res: Optional[torch.Tensor]
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_norm_backward`` as a custom op (what the autograd Function calls)."""
    return layer_norm_backward(dy, x, mean, rstd, weight, d_res)


@layer_norm_backward_op.register_fake
def _backward_shapes(dy, x, mean, rstd, weight, d_res):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, weight.new_empty(weight.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("hiera_autopatch::layer_norm_backward_dx_sum", mutates_args=())
def layer_norm_backward_dx_sum_op(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                  weight: torch.Tensor, d_res: Optional[torch.Tensor]
                                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_norm_backward(..., dx_sum=True)`` as a custom op: what ``ops/layer_norm``'s graph
    pass puts in place of ``layer_norm_backward_op`` where the step also sums dx over its rows."""
    return layer_norm_backward(dy, x, mean, rstd, weight, d_res, dx_sum=True)


@layer_norm_backward_dx_sum_op.register_fake
def _backward_dx_sum_shapes(dy, x, mean, rstd, weight, d_res):
    dx, dw, db = _backward_shapes(dy, x, mean, rstd, weight, d_res)
    return dx, dw, db, x.new_empty(x.shape[-1:])
