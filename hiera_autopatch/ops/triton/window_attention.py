"""Mask-unit (windowed) attention for Hiera in Triton: q max-pool fused, FAIR's token layout in and out.

What it computes is exactly FAIR's ``MaskUnitAttention.forward`` between the ``qkv`` and ``proj``
Linears (``window_attention_reference`` below is that code, op for op):

    qkv  (B, N, 3*H*D), N = T*nw, token n = t*nw + w (window index fastest), channel s*H*D + h*D + d
    q, k, v = qkv.reshape(B, T, nw, 3, H, D).permute(3, 0, 4, 2, 1, 5)      # each (B, H, nw, T, D)
    q = q.view(B, H, nw, S, T//S, D).max(dim=3).values   (S > 1; "amax": .amax(dim=3), timm)
    x = softmax(q k^T / sqrt(D)) v                                           # (B, H, nw, Tq, D)
    out = x.transpose(1, 3).reshape(B, Tq*nw, H*D)          # token tq*nw + w, channel h*D + d

The kernels read q/k/v straight out of ``qkv`` with strides (no permute copies), pool q in
registers, and write ``out`` (and, in backward, ``dqkv`` in ``qkv``'s layout) directly.

Design, for Hiera's short windows (T = 16..196 keys, head_dim 32..128):
- A program owns one (batch, head, group of G windows) and one block of its queries. The G windows
  are packed block-diagonally: query rows are the group's G*Tq queries (window-major), key columns
  its G*T keys, and scores across windows are masked. With T=16, G=4 fills a 64-key tile; the
  wasted multiplies are cheap because this attention is memory-bound (~10 FLOP per byte).
- Keys are visited in blocks with an online softmax (flash attention), skipping key blocks that
  hold none of the query block's windows; when a group's keys fit one block (the usual case) the
  loop runs once.
- Forward saves the log-sum-exp per query row (base 2). Backward recomputes P. When a group's keys
  fit one block, one kernel computes dk, dv and dq (delta = rowsum(P * dP), no read of ``out``);
  otherwise a small kernel computes delta = rowsum(dout * out), then a dk/dv kernel and a dq kernel
  run.
- Tiles kernels (config keys ``KEY_TILES`` forward, ``KEY_TILES_BWD`` backward; off unless
  ``TUNED`` sets them for a shape), for one window a program: the window's keys in up to three
  power-of-two tiles (``key_tiles``: the decoder's 196 keys as 128+64+16 rows) instead of one tile
  padded to 256, and the forward's queries in full blocks plus a smaller last one (``query_tiles``:
  3 x 64 + 16). About a fifth of the decoder's multiplies and accumulator rows, and half of
  stage 3's (76 tokens: 80 rows, not 128), were spent on padding. Built in session 33, compiled for
  sm_90 (no more spill bytes than the one-tile kernels at the decoder and stage-3 shapes); not yet
  timed on a GPU.
- dq goes back through the pool: for "max" to the first maximal of the S values (what torch's
  ``max(dim).values`` backward does), for "amax" split evenly among the tied maxima.

Chain (Liger-Kernel style): kernels -> ``window_attention_forward``/``window_attention_backward``
-> custom ops with autograd (``hiera_autopatch::window_attention``) -> ``window_attention``;
``supports`` says which calls it takes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ._runtime import HAS_TRITON, tl, triton
from ._runtime import interpreting as _interpreting
from ._runtime import on_device as _on_device
from ._runtime import pdl as _pdl

POOL_MODES = ("max", "amax")
MAX_HEAD_DIM = 128  # BLOCK_D = next_pow2(D) <= 128 keeps the q/k/v tiles in registers/shared
_LOG2E = 1.4426950408889634



# ------------------------------------------------------------------------------------------------
# PyTorch reference: FAIR's exact ops (for tests and for the fallback path)
# ------------------------------------------------------------------------------------------------


def window_attention_reference(
    qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int, pool: str = "max"
) -> torch.Tensor:
    """FAIR ``MaskUnitAttention.forward`` from after ``self.qkv`` to before ``self.proj``."""
    B, N, C3 = qkv.shape
    D = C3 // (3 * heads)
    # (3, B, H, nw, T, D)
    qkv = qkv.reshape(B, -1, num_windows, 3, heads, D).permute(3, 0, 4, 2, 1, 5)
    q, k, v = qkv[0], qkv[1], qkv[2]
    if q_stride > 1:
        # (B, H, nw, S, Tq, D) -> (B, H, nw, Tq, D)
        q = q.view(B, heads, num_windows, q_stride, -1, D)
        q = q.max(dim=3).values if pool == "max" else q.amax(dim=3)
    x = F.scaled_dot_product_attention(q, k, v)  # (B, H, nw, Tq, D)
    return x.transpose(1, 3).reshape(B, -1, heads * D)  # (B, Tq*nw, H*D)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------

if HAS_TRITON:
    from ._runtime import pdl_start
    # finite "minus infinity" for masked scores: a fully masked row gives finite weights, never NaN
    _MASKED = tl.constexpr(-1.0e30)

    @triton.jit
    def _program_coords(pid, H: tl.constexpr, n_groups, n_blocks):
        # pid -> (b, group, h, block), block fastest
        blk = pid % n_blocks
        rest = pid // n_blocks
        h = rest % H
        rest = rest // H
        grp = rest % n_groups
        b = rest // n_groups
        return b, grp, h, blk

    @triton.jit
    def _group_positions(blk, w0, NW, G: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
        # Position i of this block = flat index p = blk*BLOCK + i over the group's G*L queries
        # (L = Tq, BLOCK = BLOCK_M) or keys (L = T, BLOCK = BLOCK_N), window-major: p = g*L + t,
        # window w = w0 + g. Returns (g, t, w, ok), each (BLOCK,).
        p = blk * BLOCK + tl.arange(0, BLOCK)
        g = p // L
        t = p % L
        ok = (p < G * L) & (w0 + g < NW)
        return g, t, w0 + g, ok

    @triton.jit
    def _load_pooled_q(q_ptr, tq, w, mask, offs_d, NW, ROW: tl.constexpr, Tq: tl.constexpr,
                       S: tl.constexpr):
        # q_ptr: qkv of this batch element at channel h*D (the q part).
        # Pool slot s of pooled row tq is token t = s*Tq + tq (FAIR: q.view(B, H, nw, S, Tq, D)),
        # stored at qkv row t*nw + w.                                  -> (BLOCK_M, BLOCK_D)
        q = tl.load(q_ptr + (tq * NW + w)[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
        for s in tl.static_range(1, S):
            rows = (s * Tq + tq) * NW + w  # (BLOCK_M,)
            q_s = tl.load(q_ptr + rows[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
            # (the cast is a no-op when compiled; the interpreter widens bf16 maxima to fp32)
            q = tl.maximum(q, q_s, propagate_nan=tl.PropagateNan.ALL).to(q_s.dtype)
        return q

    @triton.jit
    def _column_sums(stored, mask):
        # (ROWS, BLOCK_D) values as stored (in dqkv's dtype) -> (BLOCK_D,) fp32 sums of the rows in mask
        return tl.sum(tl.where(mask, stored.to(tl.float32), 0.0), 0)

    @triton.jit
    def _store_dq_through_pool(dq_ptr, q_ptr, dq, q_max, tq, w, mask, offs_d, NW,
                               ROW: tl.constexpr, Tq: tl.constexpr, S: tl.constexpr,
                               POOL_AMAX: tl.constexpr):
        # dq: (BLOCK_M, BLOCK_D) fp32 gradient of the pooled q. Writes all S pool slots (zeros where
        # a slot gets no gradient) so that dqkv needs no zero-fill. Returns the column sums of what
        # it wrote, (BLOCK_D,) fp32: this block's share of the q bias gradient.
        if S == 1:
            rows = tq * NW + w
            stored = dq.to(dq_ptr.dtype.element_ty)
            tl.store(dq_ptr + rows[:, None] * ROW + offs_d[None, :], stored, mask=mask)
            sums = _column_sums(stored, mask)
        elif POOL_AMAX:
            # amax backward: split evenly among the tied maxima
            n_ties = tl.zeros_like(dq)
            for s in tl.static_range(S):
                rows = (s * Tq + tq) * NW + w
                q_s = tl.load(q_ptr + rows[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
                n_ties += tl.where(q_s == q_max, 1.0, 0.0)
            share = dq / tl.maximum(n_ties, 1.0)
            sums = tl.zeros_like(offs_d).to(tl.float32)
            for s in tl.static_range(S):
                rows = (s * Tq + tq) * NW + w
                q_s = tl.load(q_ptr + rows[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
                stored = tl.where(q_s == q_max, share, 0.0).to(dq_ptr.dtype.element_ty)
                tl.store(dq_ptr + rows[:, None] * ROW + offs_d[None, :], stored, mask=mask)
                sums += _column_sums(stored, mask)
        else:
            # max(dim).values backward: all of it to the first maximal slot
            taken = tl.zeros_like(dq)  # 1.0 once a slot has taken the gradient
            sums = tl.zeros_like(offs_d).to(tl.float32)
            for s in tl.static_range(S):
                rows = (s * Tq + tq) * NW + w
                q_s = tl.load(q_ptr + rows[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
                first = (q_s == q_max) & (taken == 0.0)
                taken = tl.where(first, 1.0, taken)
                stored = tl.where(first, dq, 0.0).to(dq_ptr.dtype.element_ty)
                tl.store(dq_ptr + rows[:, None] * ROW + offs_d[None, :], stored, mask=mask)
                sums += _column_sums(stored, mask)
        return sums

    @triton.jit
    def _window_attention_fwd_kernel(
        QKV, OUT, LSE,
        NW, n_groups, n_q_blocks, qk_scale,
        H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl_start(PDL)  # PDL: launched with programmatic dependent launch (_runtime.pdl_start)
        Tq: tl.constexpr = T // S
        ROW: tl.constexpr = 3 * H * D  # qkv row stride (elements)
        OUT_ROW: tl.constexpr = H * D  # out row stride
        b, grp, h, mb = _program_coords(tl.program_id(0), H, n_groups, n_q_blocks)
        w0 = grp * G
        b64 = b.to(tl.int64)
        q_ptr = QKV + b64 * (NW * T * ROW) + h * D  # (T*nw rows, ROW) of batch b, q of head h
        k_ptr = q_ptr + H * D
        v_ptr = q_ptr + 2 * H * D

        offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        d_ok = offs_d < D
        g_q, tq, w_q, q_ok = _group_positions(mb, w0, NW, G, Tq, BLOCK_M)  # (BLOCK_M,) each
        q_mask = q_ok[:, None] & d_ok[None, :]  # (BLOCK_M, BLOCK_D)
        q = _load_pooled_q(q_ptr, tq, w_q, q_mask, offs_d, NW, ROW, Tq, S)  # (BLOCK_M, BLOCK_D)

        m_i = tl.full([BLOCK_M], _MASKED, tl.float32)  # running row max (base-2 logits)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # key blocks that hold the windows of this query block
        m_first = mb * BLOCK_M
        m_last = tl.minimum(m_first + BLOCK_M, G * Tq) - 1
        kb_lo = (m_first // Tq) * T // BLOCK_N
        kb_hi = ((m_last // Tq + 1) * T + BLOCK_N - 1) // BLOCK_N
        for kb in range(kb_lo, kb_hi):
            g_k, t_k, w_k, k_ok = _group_positions(kb, w0, NW, G, T, BLOCK_N)  # (BLOCK_N,) each
            k_mask = k_ok[:, None] & d_ok[None, :]
            k_rows = t_k * NW + w_k  # (BLOCK_N,) qkv rows
            k = tl.load(k_ptr + k_rows[:, None] * ROW + offs_d[None, :], mask=k_mask, other=0.0)
            v = tl.load(v_ptr + k_rows[:, None] * ROW + offs_d[None, :], mask=k_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BM, BN)
            same = (g_q[:, None] == g_k[None, :]) & k_ok[None, :]
            s = tl.where(same, s, _MASKED)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        # out (B, Tq*nw, H*D): row tq*nw + w, channel h*D + d
        o_rows = tq * NW + w_q
        o_ptr = OUT + b64 * (NW * Tq * OUT_ROW) + h * D
        tl.store(o_ptr + o_rows[:, None] * OUT_ROW + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=q_mask)
        # lse (B, H, nw, Tq), base 2
        lse_off = ((b64 * H + h) * NW + w_q) * Tq + tq
        tl.store(LSE + lse_off, m_i + tl.log2(l_i), mask=q_ok)

    @triton.jit
    def _softmax_key_tile(q, k, v, FIRST: tl.constexpr, N: tl.constexpr, T: tl.constexpr, m_i, l_i, acc,
                          qk_scale, DOT_PRECISION: tl.constexpr):
        # one key tile into the running softmax of a query tile: (row max, row sum, P V), base 2
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N)
        s = tl.where((FIRST + tl.arange(0, N) < T)[None, :], s, _MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _forward_query_tile(QKV, OUT, LSE, b64, w, h, first, NW, qk_scale,
                            M: tl.constexpr, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                            S: tl.constexpr, BLOCK_D: tl.constexpr,
                            N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
        # pooled queries first .. first+M-1 of window w, head h, against the window's keys in tiles
        Tq: tl.constexpr = T // S
        ROW: tl.constexpr = 3 * H * D
        OUT_ROW: tl.constexpr = H * D
        q_ptr = QKV + b64 * (NW * T * ROW) + h * D
        k_ptr = q_ptr + H * D
        v_ptr = q_ptr + 2 * H * D
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        tq = first + tl.arange(0, M)  # (M,)
        q_ok = tq < Tq
        q_mask = q_ok[:, None] & d_ok[None, :]
        q = _load_pooled_q(q_ptr, tq, tq * 0 + w, q_mask, offs_d, NW, ROW, Tq, S)  # (M, BLOCK_D)
        m_i = tl.full([M], _MASKED, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_D], tl.float32)
        _, _, k, v = _key_tile(k_ptr, v_ptr, w, NW, 0, N0, T, offs_d, d_ok, ROW)
        m_i, l_i, acc = _softmax_key_tile(q, k, v, 0, N0, T, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        if N1 > 0:
            _, _, k, v = _key_tile(k_ptr, v_ptr, w, NW, N0, N1, T, offs_d, d_ok, ROW)
            m_i, l_i, acc = _softmax_key_tile(q, k, v, N0, N1, T, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        if N2 > 0:
            _, _, k, v = _key_tile(k_ptr, v_ptr, w, NW, N0 + N1, N2, T, offs_d, d_ok, ROW)
            m_i, l_i, acc = _softmax_key_tile(q, k, v, N0 + N1, N2, T, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        out = acc / l_i[:, None]
        o_ptr = OUT + b64 * (NW * Tq * OUT_ROW) + h * D
        tl.store(o_ptr + (tq * NW + w)[:, None] * OUT_ROW + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=q_mask)
        tl.store(LSE + ((b64 * H + h) * NW + w) * Tq + tq, m_i + tl.log2(l_i), mask=q_ok)

    @triton.jit
    def _window_attention_fwd_tiles_kernel(
        QKV, OUT, LSE, NW, n_q_tiles, qk_scale,
        H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
        BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_D: tl.constexpr,
        N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl_start(PDL)
        # One (batch, window, head, query tile): BLOCK_M queries, the last tile TAIL_M (0: BLOCK_M),
        # so the decoder's 196 queries take 3 x 64 + 16 rows, not 4 x 64; the window's keys in up to
        # three tiles (N0, N1, N2), as the key-tiles backward holds them. Same out and lse as
        # ``_window_attention_fwd_kernel`` with G = 1.
        b, w, h, mb = _program_coords(tl.program_id(0), H, NW, n_q_tiles)
        b64 = b.to(tl.int64)
        if TAIL_M > 0:
            if mb < n_q_tiles - 1:
                _forward_query_tile(QKV, OUT, LSE, b64, w, h, mb * BLOCK_M, NW, qk_scale, BLOCK_M, H, D, T, S,
                                    BLOCK_D, N0, N1, N2, DOT_PRECISION)
            else:
                _forward_query_tile(QKV, OUT, LSE, b64, w, h, mb * BLOCK_M, NW, qk_scale, TAIL_M, H, D, T, S,
                                    BLOCK_D, N0, N1, N2, DOT_PRECISION)
        else:
            _forward_query_tile(QKV, OUT, LSE, b64, w, h, mb * BLOCK_M, NW, qk_scale, BLOCK_M, H, D, T, S,
                                BLOCK_D, N0, N1, N2, DOT_PRECISION)

    @triton.jit
    def _backward_pointers(QKV, DQKV, DOUT, b64, h, NW, T: tl.constexpr, Tq: tl.constexpr,
                           H: tl.constexpr, D: tl.constexpr):
        # head h of batch element b: q, k, v in qkv, dq in dqkv (dk, dv follow at +H*D, +2*H*D),
        # dout; each at its first row, channel h*D
        qkv_off = b64 * (NW * T * 3 * H * D) + h * D
        q_ptr = QKV + qkv_off
        do_ptr = DOUT + b64 * (NW * Tq * H * D) + h * D
        return q_ptr, q_ptr + H * D, q_ptr + 2 * H * D, DQKV + qkv_off, do_ptr

    @triton.jit
    def _window_attention_bwd_dkdv_kernel(
        QKV, DOUT, LSE, DELTA, DQKV, DBIAS,
        NW, n_groups, n_k_blocks, part_blocks, qk_scale, sm_scale,
        H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        POOL_AMAX: tl.constexpr, SINGLE_KV: tl.constexpr, BIAS_GRAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl_start(PDL)
        # One key block: dk, dv over all query blocks that see it. SINGLE_KV (the group's keys fit
        # this one block): each query row's P is complete here, so also delta and dq.
        # BIAS_GRAD: the column sums of the dq, dk, dv it writes go to DBIAS (rows, 3*H*D) fp32,
        # row (b*n_groups + group)*part_blocks + block, for the qkv bias gradient.
        Tq: tl.constexpr = T // S
        ROW: tl.constexpr = 3 * H * D
        OUT_ROW: tl.constexpr = H * D
        b, grp, h, nb = _program_coords(tl.program_id(0), H, n_groups, n_k_blocks)
        w0 = grp * G
        b64 = b.to(tl.int64)
        q_ptr, k_ptr, v_ptr, dq_ptr, do_ptr = _backward_pointers(QKV, DQKV, DOUT, b64, h, NW, T, Tq, H, D)
        dk_ptr = dq_ptr + H * D
        dv_ptr = dq_ptr + 2 * H * D
        lse_ptr = LSE + (b64 * H + h) * NW * Tq  # (nw, Tq) of this (b, h)
        delta_ptr = DELTA + (b64 * H + h) * NW * Tq

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        g_k, t_k, w_k, k_ok = _group_positions(nb, w0, NW, G, T, BLOCK_N)  # (BLOCK_N,) each
        k_mask = k_ok[:, None] & d_ok[None, :]  # (BLOCK_N, BLOCK_D)
        k_rows = t_k * NW + w_k
        k = tl.load(k_ptr + k_rows[:, None] * ROW + offs_d[None, :], mask=k_mask, other=0.0)
        v = tl.load(v_ptr + k_rows[:, None] * ROW + offs_d[None, :], mask=k_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dq_sums = tl.zeros([BLOCK_D], tl.float32)  # SINGLE_KV: column sums of the dq written

        # query blocks that hold the windows of this key block
        n_first = nb * BLOCK_N
        n_last = tl.minimum(n_first + BLOCK_N, G * T) - 1
        mb_lo = (n_first // T) * Tq // BLOCK_M
        mb_hi = ((n_last // T + 1) * Tq + BLOCK_M - 1) // BLOCK_M
        for mb in range(mb_lo, mb_hi):
            g_q, tq, w_q, q_ok = _group_positions(mb, w0, NW, G, Tq, BLOCK_M)  # (BLOCK_M,) each
            q_mask = q_ok[:, None] & d_ok[None, :]  # (BLOCK_M, BLOCK_D)
            q = _load_pooled_q(q_ptr, tq, w_q, q_mask, offs_d, NW, ROW, Tq, S)
            o_rows = tq * NW + w_q
            do = tl.load(do_ptr + o_rows[:, None] * OUT_ROW + offs_d[None, :], mask=q_mask,
                         other=0.0)  # (BLOCK_M, BLOCK_D)
            lse = tl.load(lse_ptr + w_q * Tq + tq, mask=q_ok, other=0.0)  # (BLOCK_M,)

            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BM, BN)
            same = (g_q[:, None] == g_k[None, :]) & q_ok[:, None] & k_ok[None, :]
            p = tl.where(same, tl.exp2(s - lse[:, None]), 0.0)  # softmax probabilities
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BM, BN)
            if SINGLE_KV:
                delta = tl.sum(p * dp, 1)  # = rowsum(dout * out), with full rows of P here
            else:
                delta = tl.load(delta_ptr + w_q * Tq + tq, mask=q_ok, other=0.0)
            ds = p * (dp - delta[:, None])  # d(loss)/d(q.k), without the scale
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
            if SINGLE_KV:
                dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * sm_scale
                dq_sums += _store_dq_through_pool(dq_ptr, q_ptr, dq, q, tq, w_q, q_mask, offs_d, NW,
                                                  ROW, Tq, S, POOL_AMAX)

        dk = (dk * sm_scale).to(DQKV.dtype.element_ty)
        dv = dv.to(DQKV.dtype.element_ty)
        tl.store(dk_ptr + k_rows[:, None] * ROW + offs_d[None, :], dk, mask=k_mask)
        tl.store(dv_ptr + k_rows[:, None] * ROW + offs_d[None, :], dv, mask=k_mask)
        if BIAS_GRAD:
            part = DBIAS + ((b64 * n_groups + grp) * part_blocks + nb) * ROW + h * D + offs_d
            if SINGLE_KV:
                tl.store(part, dq_sums, mask=d_ok)
            tl.store(part + H * D, _column_sums(dk, k_mask), mask=d_ok)
            tl.store(part + 2 * H * D, _column_sums(dv, k_mask), mask=d_ok)

    @triton.jit
    def _window_attention_bwd_delta_kernel(
        DOUT, OUT, DELTA, NW, n_rows,
        H: tl.constexpr, D: tl.constexpr, Tq: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl_start(PDL)
        # delta = rowsum(dout * out) per (query, head), for backward when keys span several blocks.
        # dout, out: (B, Tq*nw, H*D), row tq*nw + w; delta: (B, H, nw, Tq) fp32.
        h = tl.program_id(1)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) flat rows b*Tq*nw + ..
        offs_d = tl.arange(0, BLOCK_D)
        r_ok = r < n_rows
        mask = r_ok[:, None] & (offs_d < D)[None, :]
        r64 = r.to(tl.int64)
        offs = r64[:, None] * (H * D) + h * D + offs_d[None, :]  # (BLOCK_R, BLOCK_D)
        do = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(do * o, 1)  # (BLOCK_R,)
        b = r64 // (Tq * NW)
        tq = (r64 % (Tq * NW)) // NW
        w = r64 % NW
        tl.store(DELTA + ((b * H + h) * NW + w) * Tq + tq, delta, mask=r_ok)

    @triton.jit
    def _window_attention_bwd_dq_kernel(
        QKV, DOUT, LSE, DELTA, DQKV, DBIAS,
        NW, n_groups, n_q_blocks, part_blocks, qk_scale, sm_scale,
        H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        POOL_AMAX: tl.constexpr, BIAS_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_start(PDL)
        # One query block: dq over the key blocks it sees (only when keys span several blocks).
        # BIAS_GRAD: the column sums of the dq it writes go to DBIAS, as in the dk/dv kernel.
        Tq: tl.constexpr = T // S
        ROW: tl.constexpr = 3 * H * D
        OUT_ROW: tl.constexpr = H * D
        b, grp, h, mb = _program_coords(tl.program_id(0), H, n_groups, n_q_blocks)
        w0 = grp * G
        b64 = b.to(tl.int64)
        q_ptr, k_ptr, v_ptr, dq_ptr, do_ptr = _backward_pointers(QKV, DQKV, DOUT, b64, h, NW, T, Tq, H, D)
        lse_ptr = LSE + (b64 * H + h) * NW * Tq
        delta_ptr = DELTA + (b64 * H + h) * NW * Tq

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        g_q, tq, w_q, q_ok = _group_positions(mb, w0, NW, G, Tq, BLOCK_M)  # (BLOCK_M,) each
        q_mask = q_ok[:, None] & d_ok[None, :]
        q = _load_pooled_q(q_ptr, tq, w_q, q_mask, offs_d, NW, ROW, Tq, S)  # (BLOCK_M, BLOCK_D)
        o_rows = tq * NW + w_q
        do = tl.load(do_ptr + o_rows[:, None] * OUT_ROW + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + w_q * Tq + tq, mask=q_ok, other=0.0)  # (BLOCK_M,)
        delta = tl.load(delta_ptr + w_q * Tq + tq, mask=q_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        m_first = mb * BLOCK_M
        m_last = tl.minimum(m_first + BLOCK_M, G * Tq) - 1
        kb_lo = (m_first // Tq) * T // BLOCK_N
        kb_hi = ((m_last // Tq + 1) * T + BLOCK_N - 1) // BLOCK_N
        for kb in range(kb_lo, kb_hi):
            g_k, t_k, w_k, k_ok = _group_positions(kb, w0, NW, G, T, BLOCK_N)
            k_mask = k_ok[:, None] & d_ok[None, :]
            k_rows = t_k * NW + w_k
            k = tl.load(k_ptr + k_rows[:, None] * ROW + offs_d[None, :], mask=k_mask, other=0.0)
            v = tl.load(v_ptr + k_rows[:, None] * ROW + offs_d[None, :], mask=k_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            same = (g_q[:, None] == g_k[None, :]) & q_ok[:, None] & k_ok[None, :]
            p = tl.where(same, tl.exp2(s - lse[:, None]), 0.0)  # (BLOCK_M, BLOCK_N)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

        dq_sums = _store_dq_through_pool(dq_ptr, q_ptr, dq * sm_scale, q, tq, w_q, q_mask, offs_d, NW,
                                         ROW, Tq, S, POOL_AMAX)
        if BIAS_GRAD:
            part = DBIAS + ((b64 * n_groups + grp) * part_blocks + mb) * ROW + h * D + offs_d
            tl.store(part, dq_sums, mask=d_ok)

    @triton.jit
    def _key_tile(k_ptr, v_ptr, w, NW, FIRST: tl.constexpr, N: tl.constexpr, T: tl.constexpr,
                  offs_d, d_ok, ROW: tl.constexpr):
        # keys FIRST .. FIRST+N-1 of window w -> their qkv rows (N,), mask (N, BLOCK_D), k, v
        t = FIRST + tl.arange(0, N)
        rows = t * NW + w
        mask = (t < T)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * ROW + offs_d[None, :], mask=mask, other=0.0)
        return rows, mask, k, v

    @triton.jit
    def _tile_probs(q, do, lse, q_ok, k, FIRST: tl.constexpr, N: tl.constexpr, T: tl.constexpr, v,
                    qk_scale, DOT_PRECISION: tl.constexpr):
        # P and dP of one query block against one key tile, each (BLOCK_M, N) fp32
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        k_ok = FIRST + tl.arange(0, N) < T
        p = tl.where(q_ok[:, None] & k_ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        return p, dp

    @triton.jit
    def _tile_grads(p, dp, delta, q, do, k, dk, dv, DOT_PRECISION: tl.constexpr):
        # one key tile's share: dk, dv accumulated (N, BLOCK_D) fp32; its part of dq (BLOCK_M, BLOCK_D)
        ds = p * (dp - delta[:, None])  # d(loss)/d(q.k), without the scale
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
        return dk, dv, tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    @triton.jit
    def _window_attention_bwd_key_tiles_kernel(
        QKV, DOUT, LSE, DQKV, NW, qk_scale, sm_scale,
        H: tl.constexpr, D: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
        N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
        POOL_AMAX: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl_start(PDL)
        # One (batch, window, head) whole, as the one-pass dk/dv kernel does with G=1, but its T keys
        # held in up to three power-of-two tiles (N0 >= N1 >= N2, 0 = no tile) instead of one padded
        # tile: the decoder's 196 keys as 128+64+16 rows, not 256. Each query block's P and dP are
        # taken per tile; delta (= rowsum(P * dP)) adds the tiles' row sums; dq adds their dS K.
        Tq: tl.constexpr = T // S
        ROW: tl.constexpr = 3 * H * D
        OUT_ROW: tl.constexpr = H * D
        b, w, h, _ = _program_coords(tl.program_id(0), H, NW, 1)
        b64 = b.to(tl.int64)
        q_ptr, k_ptr, v_ptr, dq_ptr, do_ptr = _backward_pointers(QKV, DQKV, DOUT, b64, h, NW, T, Tq, H, D)
        lse_ptr = LSE + ((b64 * H + h) * NW + w) * Tq  # (Tq,) of this (b, h, w)

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        rows0, mask0, k0, v0 = _key_tile(k_ptr, v_ptr, w, NW, 0, N0, T, offs_d, d_ok, ROW)
        dk0 = tl.zeros([N0, BLOCK_D], tl.float32)
        dv0 = tl.zeros([N0, BLOCK_D], tl.float32)
        if N1 > 0:
            rows1, mask1, k1, v1 = _key_tile(k_ptr, v_ptr, w, NW, N0, N1, T, offs_d, d_ok, ROW)
            dk1 = tl.zeros([N1, BLOCK_D], tl.float32)
            dv1 = tl.zeros([N1, BLOCK_D], tl.float32)
        if N2 > 0:
            rows2, mask2, k2, v2 = _key_tile(k_ptr, v_ptr, w, NW, N0 + N1, N2, T, offs_d, d_ok, ROW)
            dk2 = tl.zeros([N2, BLOCK_D], tl.float32)
            dv2 = tl.zeros([N2, BLOCK_D], tl.float32)

        for mb in range(0, (Tq + BLOCK_M - 1) // BLOCK_M):
            tq = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
            q_ok = tq < Tq
            w_q = tq * 0 + w
            q_mask = q_ok[:, None] & d_ok[None, :]  # (BLOCK_M, BLOCK_D)
            q = _load_pooled_q(q_ptr, tq, w_q, q_mask, offs_d, NW, ROW, Tq, S)
            do = tl.load(do_ptr + (tq * NW + w)[:, None] * OUT_ROW + offs_d[None, :], mask=q_mask,
                         other=0.0)  # (BLOCK_M, BLOCK_D)
            lse = tl.load(lse_ptr + tq, mask=q_ok, other=0.0)  # (BLOCK_M,)

            p0, dp0 = _tile_probs(q, do, lse, q_ok, k0, 0, N0, T, v0, qk_scale, DOT_PRECISION)
            delta = tl.sum(p0 * dp0, 1)  # (BLOCK_M,), the tiles' shares of rowsum(P * dP)
            if N1 > 0:
                p1, dp1 = _tile_probs(q, do, lse, q_ok, k1, N0, N1, T, v1, qk_scale, DOT_PRECISION)
                delta += tl.sum(p1 * dp1, 1)
            if N2 > 0:
                p2, dp2 = _tile_probs(q, do, lse, q_ok, k2, N0 + N1, N2, T, v2, qk_scale, DOT_PRECISION)
                delta += tl.sum(p2 * dp2, 1)
            dk0, dv0, dq = _tile_grads(p0, dp0, delta, q, do, k0, dk0, dv0, DOT_PRECISION)
            if N1 > 0:
                dk1, dv1, dq1 = _tile_grads(p1, dp1, delta, q, do, k1, dk1, dv1, DOT_PRECISION)
                dq += dq1
            if N2 > 0:
                dk2, dv2, dq2 = _tile_grads(p2, dp2, delta, q, do, k2, dk2, dv2, DOT_PRECISION)
                dq += dq2
            _store_dq_through_pool(dq_ptr, q_ptr, dq * sm_scale, q, tq, w_q, q_mask, offs_d, NW,
                                   ROW, Tq, S, POOL_AMAX)

        dk_ptr = dq_ptr + H * D
        dv_ptr = dq_ptr + 2 * H * D
        tl.store(dk_ptr + rows0[:, None] * ROW + offs_d[None, :], (dk0 * sm_scale).to(DQKV.dtype.element_ty), mask=mask0)
        tl.store(dv_ptr + rows0[:, None] * ROW + offs_d[None, :], dv0.to(DQKV.dtype.element_ty), mask=mask0)
        if N1 > 0:
            tl.store(dk_ptr + rows1[:, None] * ROW + offs_d[None, :], (dk1 * sm_scale).to(DQKV.dtype.element_ty), mask=mask1)
            tl.store(dv_ptr + rows1[:, None] * ROW + offs_d[None, :], dv1.to(DQKV.dtype.element_ty), mask=mask1)
        if N2 > 0:
            tl.store(dk_ptr + rows2[:, None] * ROW + offs_d[None, :], (dk2 * sm_scale).to(DQKV.dtype.element_ty), mask=mask2)
            tl.store(dv_ptr + rows2[:, None] * ROW + offs_d[None, :], dv2.to(DQKV.dtype.element_ty), mask=mask2)


# ------------------------------------------------------------------------------------------------
# Host launchers
# ------------------------------------------------------------------------------------------------

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def supports(qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int) -> bool:
    """True when the Triton kernel handles this call; otherwise use PyTorch SDPA."""
    if not HAS_TRITON or not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        return False
    if qkv.dtype not in _SUPPORTED_DTYPES:
        return False
    if not (qkv.is_cuda or (_interpreting() and qkv.device.type == "cpu")):
        return False
    B, N, C3 = qkv.shape
    if heads <= 0 or num_windows <= 0 or q_stride <= 0 or C3 % (3 * heads) != 0:
        return False
    D = C3 // (3 * heads)
    if not (1 <= D <= MAX_HEAD_DIM) or N % num_windows != 0:
        return False
    T = N // num_windows
    if T == 0 or T % q_stride != 0:
        return False
    if B * num_windows * heads >= 2**31 // 4:  # program ids stay int32
        return False
    return True


HIERA_B_SHAPES = (
    # (name, nw, T, H, D, S) of every attention call in Hiera-B at 224 px. MAE keeps 19 of 49 mask
    # units (stages 1-2) and 76 tokens in stage 3 (19 units x 4); classification keeps all 49 (196
    # tokens in stage 3). The benchmark and the GPU tests run these.
    ("stage1-mae", 19, 64, 1, 96, 1),
    ("stage2-pool", 19, 64, 2, 96, 4),
    ("stage2", 19, 16, 2, 96, 1),
    ("stage3-pool", 19, 16, 4, 96, 4),
    ("stage3-global-mae", 1, 76, 4, 96, 1),
    ("stage4-pool-global", 1, 76, 8, 96, 4),
    ("stage4-global-mae", 1, 19, 8, 96, 1),
    ("stage4-mae", 1, 76, 8, 96, 1),  # MAE (q_pool=2): stage 4 is global over stage 3's 76 tokens
    ("decoder", 1, 196, 16, 32, 1),
    ("stage1-cls", 49, 64, 1, 96, 1),
    ("stage3-global-cls", 1, 196, 4, 96, 1),
)

TUNED: Dict[Tuple[int, int, int], Dict[str, int]] = {
    # (T, S, D) -> configs that beat the rule below on the H200, forward and backward timed apart
    # (scripts/tune_attention.py, benchmarks/results/h200_tune_attention.json; B=128, bf16)
    (196, 1, 32): {  # MAE decoder: forward 0.088 ms vs 0.105, backward 0.241 ms vs 0.296
        "BLOCK_M": 128, "BLOCK_N": 32, "num_stages": 3,
        "BLOCK_M_BWD": 16, "BLOCK_N_BWD": 256, "num_warps_bwd": 4, "num_stages_bwd": 3},
    (76, 1, 96): {  # Hiera-B MAE stages 3 and 4, global: forward 0.015 ms vs 0.030; backward
        # 0.041 ms vs 0.060 at 32x128 (stage 3, h200_tune_attention_encoder.json): all 76 queries
        # and keys in one tile, one pass
        "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8,
        "BLOCK_M_BWD": 128, "BLOCK_N_BWD": 128, "num_warps_bwd": 8},
    # q-pooled mask-unit windows, forward in 32-key blocks (h200_tune_attention_encoder_small.json);
    # backward keeps the rule's 16x64 blocks (no tried config beat them by more than 1%)
    (64, 4, 96): {  # stage 2's first block: forward 0.053 ms vs 0.108
        "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_M_BWD": 16, "BLOCK_N_BWD": 64},
    (16, 4, 96): {  # stage 3's first block (4 windows a program): forward 0.031 ms vs 0.059
        "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 2, "BLOCK_M_BWD": 16, "BLOCK_N_BWD": 64},
    (76, 4, 96): {  # stage 4's first block (q-pooled, global over 76 keys; one call a step), timed
        # on an H100 (h100_tune_attention_stage4_pool.json): forward 0.026 ms vs 0.040, backward
        # 0.111 vs 0.158 (keys in 32-blocks: the delta, dk/dv and dq kernels)
        "BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 2,
        "BLOCK_M_BWD": 16, "BLOCK_N_BWD": 32, "num_warps_bwd": 2},
}


def default_config(T: int, q_stride: int, D: int, num_windows: int = 1 << 30, itemsize: int = 2) -> Dict[str, int]:
    """Block sizes for one (T, S, D, nw). Memory-bound: the aim is full tiles, not fewer FLOPs.

    G windows per program so that a group's keys fill a 64-key tile (T=16 -> G=4; never more
    than nw); keys in blocks of at most 128; at least 16 rows/cols (tl.dot's minimum). Warps: 4,
    and 8 for a backward that holds 128x128 k/v/dk/dv tiles; on the H200 sweep this was the best
    choice for every Hiera-B shape, or within 2% of it. ``TUNED`` overrides blocks per shape
    (measured at this rule's G, in bf16: 2-byte dtypes only).

    ``itemsize`` 4 (fp32): tiles take twice the bytes, so a key block holds at most 32 KB of k (64
    keys at head_dim 96) and ``TUNED`` does not apply. Compiled for sm_90 (Triton 3.8), the largest
    fp32 kernel of a Hiera-B shape then takes 168 KB of shared memory, of the 227 KB an H200 block
    may use; TUNED's 128x128 forward took 256 KB in fp32, the rule's stage-4 pooled backward 240 KB.
    """
    Tq = T // q_stride
    G = max(1, min(64 // T, num_windows))
    block_d = max(16, _next_pow2(D))
    config = {"G": G,
              "BLOCK_M": max(16, min(64, _next_pow2(G * Tq))),
              "BLOCK_N": max(16, min(128, _next_pow2(G * T), 32768 // (block_d * itemsize))),
              "num_warps": 4, "num_stages": 2}
    config["KEY_TILES"] = config["KEY_TILES_BWD"] = 0
    if itemsize == 2:
        config.update(TUNED.get((T, q_stride, D), {}))
    # backward holds k, v, dk, dv (BLOCK_N x BLOCK_D) and P, dP, dS (BLOCK_M x BLOCK_N) at once
    block_n_bwd = config.get("BLOCK_N_BWD", config["BLOCK_N"])
    config.setdefault("num_warps_bwd", 8 if block_n_bwd * block_d >= 128 * 128 else 4)
    return config


def _dims(qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int):
    B, N, C3 = qkv.shape
    D = C3 // (3 * heads)
    T = N // num_windows
    return B, N, D, T, T // q_stride


BWD_KEYS = {"BLOCK_M_BWD": "BLOCK_M", "BLOCK_N_BWD": "BLOCK_N", "num_stages_bwd": "num_stages"}
"""Backward block sizes and stages; each defaults to its forward value (the lse layout does not
depend on blocks, so the two passes can tile differently)."""

_CONFIG_KEYS = ("G", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "KEY_TILES",
                "BLOCK_M_BWD", "BLOCK_N_BWD", "num_warps_bwd", "num_stages_bwd", "KEY_TILES_BWD")


def full_config(config: Optional[Dict[str, int]], T: int, q_stride: int, D: int,
                num_windows: int, itemsize: int = 2) -> Dict[str, int]:
    """``default_config`` updated with ``config``, every key of ``_CONFIG_KEYS`` filled in.

    A backward key the caller leaves out follows the forward one, unless ``default_config`` set it
    and the caller did not touch the forward one either."""
    explicit = config or {}
    cfg = default_config(T, q_stride, D, num_windows, itemsize)
    cfg.update(explicit)
    for bwd_key, fwd_key in BWD_KEYS.items():
        if bwd_key not in explicit and (fwd_key in explicit or bwd_key not in cfg):
            cfg[bwd_key] = cfg[fwd_key]
    for bm, bn in (("BLOCK_M", "BLOCK_N"), ("BLOCK_M_BWD", "BLOCK_N_BWD")):
        for block in (cfg[bm], cfg[bn]):
            assert block >= 16 and block & (block - 1) == 0, cfg
    return {key: int(cfg[key]) for key in _CONFIG_KEYS}



def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 dots unless the user allowed tf32 for matmuls (as PyTorch does)
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def window_attention_forward(
    qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int,
    config: Optional[Dict[str, int]] = None, out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """qkv (B, N, 3*H*D) -> out (B, Tq*nw, H*D), lse (B, H, nw, Tq) fp32 (base-2 log-sum-exp)."""
    qkv = qkv.contiguous()
    B, N, D, T, Tq = _dims(qkv, num_windows, heads, q_stride)
    cfg = full_config(config, T, q_stride, D, num_windows, qkv.dtype.itemsize)
    G, BM, BN, BD = cfg["G"], cfg["BLOCK_M"], cfg["BLOCK_N"], max(16, _next_pow2(D))
    if out is None:
        out = torch.empty(B, Tq * num_windows, heads * D, device=qkv.device, dtype=qkv.dtype)
    lse = torch.empty(B, heads, num_windows, Tq, device=qkv.device, dtype=torch.float32)
    n_groups = triton.cdiv(num_windows, G)
    n_q_blocks = triton.cdiv(G * Tq, BM)
    grid = (B * n_groups * heads * n_q_blocks,)
    sm_scale = D ** -0.5
    pdl = _pdl(qkv)
    if uses_key_tiles(cfg, T, D, qkv.dtype.itemsize, forward=True):
        n_q_tiles, tail = query_tiles(Tq, BM)
        n0, n1, n2 = key_tiles(T)
        with _on_device(qkv):
            _window_attention_fwd_tiles_kernel[(B * num_windows * heads * n_q_tiles,)](
                qkv, out, lse, num_windows, n_q_tiles, sm_scale * _LOG2E,
                H=heads, D=D, T=T, S=q_stride, BLOCK_M=BM, TAIL_M=tail, BLOCK_D=BD, N0=n0, N1=n1, N2=n2,
                DOT_PRECISION=_dot_precision(qkv.dtype), PDL=pdl, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], launch_pdl=pdl,
            )
        return out, lse
    with _on_device(qkv):
        _window_attention_fwd_kernel[grid](
            qkv, out, lse,
            num_windows, n_groups, n_q_blocks, sm_scale * _LOG2E,
            H=heads, D=D, T=T, S=q_stride, G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
            DOT_PRECISION=_dot_precision(qkv.dtype), PDL=pdl, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], launch_pdl=pdl,
        )
    return out, lse


MAX_KEY_TILE_ROWS = 256
"""The tiles kernels hold a window's keys, rounded up to 16, in at most this many rows..."""

MAX_KEY_TILE_BYTES = 64 * 1024
"""... and its k in at most this many bytes (256 keys at head_dim 128 in bf16). Compiled for sm_90,
the tiles backward of a 196-key window at head_dim 96 took 180 KB of shared memory in bf16 and
245 KB in fp32, past the 227 KB a block may use (scripts/check_shared_memory.py)."""


def key_tiles(T: int) -> Tuple[int, int, int]:
    """T keys in three power-of-two tiles (N0 >= N1 >= N2, 0: no tile), at least 16 rows each
    (tl.dot's minimum), summing to T rounded up to 16 where three tiles can: 196 -> (128, 64, 16),
    76 -> (64, 16, 0); past three, the last tile takes the rest rounded up to a power of two."""
    left = -(-T // 16) * 16
    tiles = []
    while left > 0 and len(tiles) < 2:
        tile = 1 << (left.bit_length() - 1)  # largest power of two <= left
        tiles.append(tile)
        left -= tile
    if left > 0:
        tiles.append(max(16, _next_pow2(left)))
    return tuple(tiles + [0] * (3 - len(tiles)))


def uses_key_tiles(cfg: Dict[str, int], T: int, D: int, itemsize: int, bias_grad: bool = False,
                   forward: bool = False) -> bool:
    """The backward runs ``_window_attention_bwd_key_tiles_kernel`` (``forward``: the forward runs
    ``_window_attention_fwd_tiles_kernel``): asked for (``KEY_TILES_BWD`` / ``KEY_TILES``), one
    window a program, the window's keys within ``MAX_KEY_TILE_ROWS`` and ``MAX_KEY_TILE_BYTES``, and,
    backward, no bias sums wanted (that kernel does not take them; the one-tile kernel does)."""
    asked = cfg["KEY_TILES"] if forward else cfg["KEY_TILES_BWD"] and not bias_grad
    rows = sum(key_tiles(T))
    return (bool(asked) and cfg["G"] == 1 and rows <= MAX_KEY_TILE_ROWS
            and rows * max(16, _next_pow2(D)) * itemsize <= MAX_KEY_TILE_BYTES)


def query_tiles(Tq: int, block_m: int) -> Tuple[int, int]:
    """(query tiles, rows of the last one; 0: all ``block_m``) of the tiles forward: full tiles of
    ``block_m`` queries, then the rest in the smallest power of two (>= 16) that holds it, where
    that is smaller than ``block_m``: 196 at 64 -> (4, 16), 76 at 64 -> (2, 16), 64 at 64 -> (1, 0)."""
    full, rest = divmod(Tq, block_m)
    tail = max(16, _next_pow2(rest)) if rest else 0
    if tail >= block_m:
        return full + 1, 0
    return full + (1 if rest else 0), tail


def backward_is_single_pass(cfg: Dict[str, int], T: int) -> bool:
    """A group's keys fit one backward key block: one kernel, delta and dq taken from full rows of P."""
    return cfg["G"] * T <= cfg["BLOCK_N_BWD"]


def _backward_blocks(cfg: Dict[str, int], num_windows: int, T: int, Tq: int) -> Tuple[int, int, int, int]:
    """(groups, key blocks, query blocks, rows of bias partial sums per group) of the backward grid.
    One pass: the dk/dv kernel's programs, one row each. Otherwise the dk/dv and the dq kernels each
    write their own programs' rows."""
    n_groups = -(-num_windows // cfg["G"])
    n_k_blocks = -(-cfg["G"] * T // cfg["BLOCK_N_BWD"])
    n_q_blocks = -(-cfg["G"] * Tq // cfg["BLOCK_M_BWD"])
    part_blocks = n_k_blocks if backward_is_single_pass(cfg, T) else max(n_k_blocks, n_q_blocks)
    return n_groups, n_k_blocks, n_q_blocks, part_blocks


def bias_part_buffer(qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int,
                     config: Optional[Dict[str, int]] = None) -> torch.Tensor:
    """What ``window_attention_backward(bias_part=...)`` fills: (rows, 3*H*D) fp32 partial column
    sums of dqkv, whose sum over rows is the gradient of a bias added to qkv. Zero-filled only when
    some rows are not written (keys over several blocks: the dk/dv and dq kernels' grids differ)."""
    rows, every_row_written = _bias_part_rows(qkv, num_windows, heads, q_stride, config)
    alloc = torch.empty if every_row_written else torch.zeros
    return alloc(rows, qkv.shape[2], device=qkv.device, dtype=torch.float32)


def _bias_part_rows(qkv, num_windows, heads, q_stride, config) -> Tuple[int, bool]:
    B, N, D, T, Tq = _dims(qkv, num_windows, heads, q_stride)
    cfg = full_config(config, T, q_stride, D, num_windows, qkv.dtype.itemsize)
    n_groups, _, _, part_blocks = _backward_blocks(cfg, num_windows, T, Tq)
    return B * n_groups * part_blocks, backward_is_single_pass(cfg, T)


def window_attention_backward(
    dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    num_windows: int, heads: int, q_stride: int, pool: str = "max",
    config: Optional[Dict[str, int]] = None, dqkv: Optional[torch.Tensor] = None,
    bias_part: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """-> dqkv (B, N, 3*H*D) in qkv's layout; every element written. ``bias_part`` (from
    ``bias_part_buffer``): also fill it with dqkv's partial column sums, as the kernels write dqkv."""
    if pool not in POOL_MODES:
        raise ValueError(f"pool must be one of {POOL_MODES}, got {pool!r}")
    qkv = qkv.contiguous()
    dout = dout.contiguous()
    B, N, D, T, Tq = _dims(qkv, num_windows, heads, q_stride)
    cfg = full_config(config, T, q_stride, D, num_windows, qkv.dtype.itemsize)
    G, BM, BN, BD = cfg["G"], cfg["BLOCK_M_BWD"], cfg["BLOCK_N_BWD"], max(16, _next_pow2(D))
    if dqkv is None:
        dqkv = torch.empty_like(qkv)
    n_groups, n_k_blocks, n_q_blocks, part_blocks = _backward_blocks(cfg, num_windows, T, Tq)
    single_kv = backward_is_single_pass(cfg, T)
    sm_scale = D ** -0.5
    pdl = _pdl(qkv)
    if uses_key_tiles(cfg, T, D, qkv.dtype.itemsize, bias_part is not None):
        n0, n1, n2 = key_tiles(T)
        with _on_device(qkv):
            _window_attention_bwd_key_tiles_kernel[(B * num_windows * heads,)](
                qkv, dout, lse, dqkv, num_windows, sm_scale * _LOG2E, sm_scale,
                H=heads, D=D, T=T, S=q_stride, BLOCK_M=BM, BLOCK_D=BD, N0=n0, N1=n1, N2=n2,
                POOL_AMAX=pool == "amax", DOT_PRECISION=_dot_precision(qkv.dtype), PDL=pdl,
                num_warps=cfg["num_warps_bwd"], num_stages=cfg["num_stages_bwd"], launch_pdl=pdl,
            )
        return dqkv
    common = dict(H=heads, D=D, T=T, S=q_stride, G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
                  POOL_AMAX=pool == "amax", BIAS_GRAD=bias_part is not None,
                  DOT_PRECISION=_dot_precision(qkv.dtype), PDL=pdl,
                  num_warps=cfg["num_warps_bwd"], num_stages=cfg["num_stages_bwd"], launch_pdl=pdl)
    part = dqkv if bias_part is None else bias_part  # (a pointer the kernels then never touch)
    with _on_device(qkv):
        if single_kv:
            delta = lse  # unused (the kernel takes delta from P * dP)
        else:
            delta = torch.empty_like(lse)  # (B, H, nw, Tq) fp32
            out = out.contiguous()
            n_rows = B * Tq * num_windows
            block_r = 64
            _window_attention_bwd_delta_kernel[(triton.cdiv(n_rows, block_r), heads)](
                dout, out, delta, num_windows, n_rows,
                H=heads, D=D, Tq=Tq, BLOCK_R=block_r, BLOCK_D=BD, PDL=pdl, num_warps=4, launch_pdl=pdl,
            )
        _window_attention_bwd_dkdv_kernel[(B * n_groups * heads * n_k_blocks,)](
            qkv, dout, lse, delta, dqkv, part,
            num_windows, n_groups, n_k_blocks, part_blocks, sm_scale * _LOG2E, sm_scale,
            SINGLE_KV=single_kv, **common,
        )
        if not single_kv:
            _window_attention_bwd_dq_kernel[(B * n_groups * heads * n_q_blocks,)](
                qkv, dout, lse, delta, dqkv, part,
                num_windows, n_groups, n_q_blocks, part_blocks, sm_scale * _LOG2E, sm_scale, **common,
            )
    return dqkv


# ------------------------------------------------------------------------------------------------
# Autograd function and functional entry point
# ------------------------------------------------------------------------------------------------


def _config_list(config: Optional[Dict[str, int]], qkv: torch.Tensor, num_windows: int, heads: int,
                 q_stride: int) -> List[int]:
    B, N, D, T, Tq = _dims(qkv, num_windows, heads, q_stride)
    resolved = full_config(config, T, q_stride, D, num_windows, qkv.dtype.itemsize)
    return [resolved[key] for key in _CONFIG_KEYS]


# Custom ops (not an autograd.Function): torch.compile treats them as opaque kernels and CUDA
# graphs capture them, so the same kernel serves eager, compiled and graphed steps.
@torch.library.custom_op("hiera_autopatch::window_attention", mutates_args=())
def _forward_op(qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int, pool: str,
                config: List[int], bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    # bias: the one already added into qkv (see window_attention); only its gradient is ours
    return window_attention_forward(qkv, num_windows, heads, q_stride, dict(zip(_CONFIG_KEYS, config)))


@_forward_op.register_fake
def _forward_shapes(qkv, num_windows, heads, q_stride, pool, config, bias):
    B, N, D, T, Tq = _dims(qkv, num_windows, heads, q_stride)
    out = qkv.new_empty(B, Tq * num_windows, heads * D)  # (B, Tq*nw, H*D)
    lse = qkv.new_empty(B, heads, num_windows, Tq, dtype=torch.float32)  # (B, H, nw, Tq)
    return out, lse


@torch.library.custom_op("hiera_autopatch::window_attention_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 num_windows: int, heads: int, q_stride: int, pool: str,
                 config: List[int], bias_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> dqkv, and with ``bias_grad`` its partial column sums (else an empty (0, 3*H*D))."""
    config = dict(zip(_CONFIG_KEYS, config))
    part = (bias_part_buffer(qkv, num_windows, heads, q_stride, config) if bias_grad
            else qkv.new_empty(0, qkv.shape[2], dtype=torch.float32))
    dqkv = window_attention_backward(dout, qkv, out, lse, num_windows, heads, q_stride, pool, config,
                                     bias_part=part if bias_grad else None)
    return dqkv, part


@_backward_op.register_fake
def _backward_shapes(dout, qkv, out, lse, num_windows, heads, q_stride, pool, config, bias_grad):
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)  # (B, N, 3*H*D)
    rows = _bias_part_rows(qkv, num_windows, heads, q_stride, dict(zip(_CONFIG_KEYS, config)))[0]
    return dqkv, qkv.new_empty(rows if bias_grad else 0, qkv.shape[2], dtype=torch.float32)


def _save_for_backward(ctx, inputs, output):
    qkv, num_windows, heads, q_stride, pool, config, bias = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(qkv, out, lse)
    ctx.args = (num_windows, heads, q_stride, pool, config)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    bias_grad = ctx.bias_dtype is not None and ctx.needs_input_grad[6]
    dqkv, part = _backward_op(dout, qkv, out, lse, *ctx.args, bias_grad)
    # the bias's gradient as addmm's backward gives it: dqkv summed over rows (in fp32, rounded to
    # qkv's dtype), then in the bias's own dtype (fp32 under autocast)
    dbias = part.sum(0).to(qkv.dtype).to(ctx.bias_dtype) if bias_grad else None
    return dqkv, None, None, None, None, None, dbias


_forward_op.register_autograd(_backward, setup_context=_save_for_backward)


def window_attention(
    qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int, pool: str = "max",
    config: Optional[Dict[str, int]] = None, bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Hiera mask-unit attention: qkv (B, N, 3*H*D) -> (B, (N // S), H*D), FAIR's layouts.

    ``pool``: "max" (FAIR, gradient to the first maximal slot) or "amax" (timm, split on ties).
    ``bias``: the (3*H*D,) bias the caller already added into ``qkv`` through a detached copy
    (``F.linear(x, w, bias.detach())``): its gradient, dqkv summed over rows, then comes from sums
    the backward kernels take as they write dqkv, instead of a reduction that reads dqkv again.
    Call ``supports(...)`` first; it is not checked here.
    """
    if pool not in POOL_MODES:
        raise ValueError(f"pool must be one of {POOL_MODES}, got {pool!r}")
    config_list = _config_list(config, qkv, num_windows, heads, q_stride)
    return _forward_op(qkv.contiguous(), num_windows, heads, q_stride, pool, config_list, bias)[0]
