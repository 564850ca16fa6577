"""Experiment, off by default: the MLP's GEMMs with FAIR's erf-GELU in their epilogue.

The graphed step runs a Hiera MLP as cuBLAS GEMMs plus Inductor's elementwise GELU kernels (3.5 ms
of Hiera-B MAE's 28 ms step on the H200, benchmarks/results/h200_profile_final.json). Those kernels
only move bytes a GEMM epilogue already holds in registers:

    forward   hidden = x @ w1^T + b1            (M, Hid)   saved for backward
              act    = gelu(hidden)             (M, Hid)   fc2's input
    backward  d_act  = d_out @ w2               (M, Hid)   fc2's data gradient
              d_hid  = gelu'(hidden) * d_act    (M, Hid)
              act    = gelu(hidden)             (M, Hid)   recomputed for fc2's weight gradient

``linear_gelu`` computes the forward pair in one GEMM; ``matmul_gelu_backward`` the backward pair
(d_act never reaches memory). Each rounds as the unfused ops do: GELU of the bf16 ``hidden``, GELU'
times the bf16 ``d_act``. Whether this beats cuBLAS + Inductor on Hiera's shapes is what
``scripts/bench_gemm_gelu.py`` measures (kernel against kernel) and ``scripts/profile_step.py``'s
``+gemm_gelu`` switch (the whole graphed step, through ``ops/mlp.py``); until it does, it stays off.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ._runtime import HAS_TRITON, tl, triton
from ._runtime import interpreting as _interpreting
from ._runtime import on_device as _on_device

DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4,
                  "TMA": 0}
"""TMA 1: tiles fetched by tensor descriptors (needs 16-byte aligned rows: K and N multiples of 8
in bf16); 0: by pointers. PERSISTENT p (with TMA): p programs per SM walk the tiles. Untimed:
scripts/bench_gemm_gelu.py tries them."""


# ------------------------------------------------------------------------------------------------
# PyTorch references: the unfused ops the kernels stand in for
# ------------------------------------------------------------------------------------------------


def linear_gelu_reference(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor]):
    """x (M, C), w1 (Hid, C), b1 (Hid,) -> hidden, gelu(hidden), each (M, Hid)."""
    hidden = F.linear(x, w1, b1)
    return hidden, F.gelu(hidden)


def matmul_gelu_backward_reference(d_out: torch.Tensor, w2: torch.Tensor, hidden: torch.Tensor):
    """d_out (M, C), w2 (C, Hid), hidden (M, Hid) -> d_hidden, gelu(hidden), each (M, Hid)."""
    d_act = d_out.matmul(w2)
    return torch.ops.aten.gelu_backward(d_act, hidden), F.gelu(hidden)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _gelu(h):
        # exact (erf) GELU in fp32, as nn.GELU() / F.gelu(approximate="none")
        return 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))

    @triton.jit
    def _gelu_grad(h):
        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327  # 1 / sqrt(2 pi)
        return cdf + h * pdf

    @triton.jit
    def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # (row block, column block) of program pid: GROUP_M row blocks walk the column blocks
        # together, so the B tiles they share are still in L2
        n_m = tl.cdiv(M, BLOCK_M)
        n_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * n_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(n_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows

    @triton.jit
    def _load_b_tile(b_desc, k0, off_n, B_IS_KN: tl.constexpr):
        # (BLOCK_K, BLOCK_N) tile of B at (k0, off_n): b_desc holds w2 (K, N) when B_IS_KN, else
        # w1 (N, K), used transposed
        if B_IS_KN:
            b = b_desc.load([k0, off_n])
        else:
            b = tl.trans(b_desc.load([off_n, k0]))  # (BLOCK_N, BLOCK_K) -> (BLOCK_K, BLOCK_N)
        return b

    @triton.jit
    def _tma_tile_product(a_desc, b_desc, off_m, off_n, K, B_IS_KN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # (BLOCK_M, BLOCK_N) fp32 tile of A @ B at (off_m, off_n), A and B tiles fetched by tensor
        # descriptors (zero padding past the edges)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k0])  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(a, _load_b_tile(b_desc, k0, off_n, B_IS_KN), acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def _epilogue(acc, pid_m, pid_n, M, N, BIAS, HIDDEN, OUT, ACT, PART,
                  BACKWARD: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # acc (BLOCK_M, BLOCK_N) fp32 tile of the product. OUT, ACT (and HIDDEN): (M, N) contiguous.
        # forward:  OUT = hidden = acc + bias, ACT = gelu(hidden)
        # backward: OUT = gelu'(HIDDEN) * acc,  ACT = gelu(HIDDEN); with HAS_BIAS also PART
        #           (row blocks, N) fp32: row pid_m holds this tile's column sums of OUT as stored
        #           (the bias gradient of the Linear whose output HIDDEN is, summed later)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        n_ok = offs_n < N
        mask = (offs_m < M)[:, None] & n_ok[None, :]
        offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # (BM, BN) into (M, N)
        out_type = OUT.dtype.element_ty
        if BACKWARD:
            d_act = acc.to(out_type).to(tl.float32)  # d_act as the unfused matmul rounds it
            hidden = tl.load(HIDDEN + offs, mask=mask, other=0.0).to(tl.float32)
            d_hidden = (_gelu_grad(hidden) * d_act).to(out_type)
            tl.store(OUT + offs, d_hidden, mask=mask)
            tl.store(ACT + offs, _gelu(hidden).to(out_type), mask=mask)
            if HAS_BIAS:
                column_sums = tl.sum(tl.where(mask, d_hidden.to(tl.float32), 0.0), 0)  # (BLOCK_N,)
                tl.store(PART + pid_m.to(tl.int64) * N + offs_n, column_sums, mask=n_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            hidden = acc.to(out_type)
            tl.store(OUT + offs, hidden, mask=mask)
            tl.store(ACT + offs, _gelu(hidden.to(tl.float32)).to(out_type), mask=mask)

    @triton.jit
    def _gemm_gelu_kernel(
        A, B, BIAS, HIDDEN, OUT, ACT, PART,
        M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BACKWARD: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # acc = A (M, K) @ B (K, N), both read through strides (B = w1^T in forward, w2 in backward)
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
        b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BK, BN)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        _epilogue(acc, pid_m, pid_n, M, N, BIAS, HIDDEN, OUT, ACT, PART, BACKWARD, HAS_BIAS, BLOCK_M, BLOCK_N)

    @triton.jit
    def _gemm_gelu_tma_kernel(
        a_desc, b_desc, BIAS, HIDDEN, OUT, ACT, PART,
        M, N, K,
        B_IS_KN: tl.constexpr, BACKWARD: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # The same product with A and B tiles fetched by tensor descriptors (Hopper's TMA; zero
        # padding past the edges).
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_tile_product(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, B_IS_KN, DOT_PRECISION,
                                BLOCK_M, BLOCK_N, BLOCK_K)
        _epilogue(acc, pid_m, pid_n, M, N, BIAS, HIDDEN, OUT, ACT, PART, BACKWARD, HAS_BIAS, BLOCK_M, BLOCK_N)

    @triton.jit
    def _gemm_gelu_persistent_kernel(
        a_desc, b_desc, BIAS, HIDDEN, OUT, ACT, PART,
        M, N, K,
        B_IS_KN: tl.constexpr, BACKWARD: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        N_PROGRAMS: tl.constexpr,
    ):
        # The TMA product, persistent: N_PROGRAMS programs walk the tiles, and the tile and K loops
        # are flattened into one software pipeline, so the next tile's loads overlap this tile's
        # epilogue (with Hiera's K of 96-1536 the epilogue is a large share of each tile).
        # Warp-specialised instead (tl.range's warp_specialize, Triton 3.6), it hung on an H100
        # (benchmarks/results/failed/h100_gemm_gelu_ws_hang.json; the code is in commit e2c25c5).
        n_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), n_tiles, N_PROGRAMS, flatten=True):
            pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _tma_tile_product(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, B_IS_KN, DOT_PRECISION,
                                    BLOCK_M, BLOCK_N, BLOCK_K)
            _epilogue(acc, pid_m, pid_n, M, N, BIAS, HIDDEN, OUT, ACT, PART, BACKWARD, HAS_BIAS, BLOCK_M, BLOCK_N)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------


def _config(config: Optional[Dict[str, int]]) -> Dict[str, int]:
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0, cfg
    return cfg


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _launch(a, b, b_is_kn: bool, bias, hidden, n_out, backward: bool, config) -> Tuple[torch.Tensor, torch.Tensor]:
    """a (M, K) @ B -> (out, act), each (M, n_out); B = b (K, N) if b_is_kn, else b (N, K) transposed."""
    M, K = a.shape
    cfg = _config(config)
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    out = torch.empty(M, n_out, device=a.device, dtype=a.dtype)
    act = torch.empty_like(out)
    grid = (triton.cdiv(M, BM) * triton.cdiv(n_out, BN),)
    precision = "ieee" if a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    common = dict(BACKWARD=backward, HAS_BIAS=bias is not None, DOT_PRECISION=precision,
                  BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg["GROUP_M"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # backward: ``bias`` is the (row blocks, n_out) fp32 buffer of the bias gradient's partial sums
    tensors = (bias if bias is not None else out, hidden if hidden is not None else out, out, act,
               bias if bias is not None else out)
    with _on_device(a):
        if cfg.get("TMA"):
            from triton.tools.tensor_descriptor import TensorDescriptor

            a_desc = TensorDescriptor.from_tensor(a, [BM, BK])
            b_desc = TensorDescriptor.from_tensor(b, [BK, BN] if b_is_kn else [BN, BK])
            if cfg.get("PERSISTENT"):
                n_programs = min(grid[0], _sm_count(a.device) * cfg["PERSISTENT"])
                _gemm_gelu_persistent_kernel[(n_programs,)](a_desc, b_desc, *tensors, M, n_out, K, B_IS_KN=b_is_kn,
                                                            N_PROGRAMS=n_programs, **common)
            else:
                _gemm_gelu_tma_kernel[grid](a_desc, b_desc, *tensors, M, n_out, K, B_IS_KN=b_is_kn, **common)
        else:
            # B's (k, n) element: b[k, n], or b[n, k] for the transposed weight
            b_strides = (b.stride(0), b.stride(1)) if b_is_kn else (b.stride(1), b.stride(0))
            _gemm_gelu_kernel[grid](a, b, *tensors, M, n_out, K, a.stride(0), a.stride(1), *b_strides, **common)
    return out, act


def linear_gelu(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                config: Optional[Dict[str, int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``linear_gelu_reference`` in one GEMM: x (M, C), w1 (Hid, C) -> hidden, gelu(hidden)."""
    return _launch(x, w1, False, b1, None, w1.shape[0], False, config)


def matmul_gelu_backward(d_out: torch.Tensor, w2: torch.Tensor, hidden: torch.Tensor,
                         config: Optional[Dict[str, int]] = None, bias_grad: bool = False):
    """``matmul_gelu_backward_reference`` in one GEMM: d_out (M, C), w2 (C, Hid), hidden (M, Hid)
    -> d_hidden, gelu(hidden), each (M, Hid); ``bias_grad``: also d_hidden's column sums (Hid,) in
    its dtype (autograd's ``sum(0)`` of the stored gradient, accumulated in fp32, in a fixed order)."""
    hidden = hidden.contiguous()
    M, Hid = hidden.shape
    assert (M, Hid) == (d_out.shape[0], w2.shape[1]), (hidden.shape, d_out.shape, w2.shape)
    if not bias_grad:
        return _launch(d_out, w2, True, None, hidden, Hid, True, config)
    from .gelu import _column_sums_kernel

    part = torch.empty(triton.cdiv(M, _config(config)["BLOCK_M"]), Hid, device=hidden.device,
                       dtype=torch.float32)  # (row blocks, Hid): every row written
    d_hidden, act = _launch(d_out, w2, True, part, hidden, Hid, True, config)
    d_bias = torch.empty(Hid, device=hidden.device, dtype=hidden.dtype)
    with _on_device(hidden):
        _column_sums_kernel[(triton.cdiv(Hid, 32),)](part, d_bias, part.shape[0], F=Hid, BLOCK_P=64, BLOCK_W=32,
                                                     num_warps=4)
    return d_hidden, act, d_bias


# ------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (Inductor keeps them as one call each); ops/mlp.py's GeluMlp
# calls them in its forward and backward for the widths in ``CONFIG_BY_WIDTH``
# ------------------------------------------------------------------------------------------------


def supports(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """2-D inputs of one float dtype, on CUDA (or on the CPU in Triton's interpreter, for tests)."""
    return (HAS_TRITON and (x.is_cuda or _interpreting()) and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(w.dtype == x.dtype and w.device == x.device for w in weights))


CONFIG_BY_WIDTH: Dict[int, Dict[str, Dict[str, int]]] = {}
"""fc1's output width -> {"fwd": config, "bwd": config} (either may be missing): in the MLPs of these
widths, fc1 (fwd) and fc2's data gradient (bwd) carry GELU in their epilogue (ops/mlp.GeluMlp,
compiled steps only). Empty as shipped: an experiment, timed in the step by
``scripts/profile_step.py``'s ``+gemm_gelu``."""



def best_by_width(bench: dict) -> Dict[int, Dict[str, Dict[str, int]]]:
    """``CONFIG_BY_WIDTH`` from a ``scripts/bench_gemm_gelu.py`` result: each pass's best config where
    it beat what the step runs."""
    table: Dict[int, Dict[str, Dict[str, int]]] = {}
    for entry in bench["shapes"].values():
        for phase in ("fwd", "bwd"):
            if entry.get(phase, {}).get("saving_ms_per_step", 0.0) > 0:
                table.setdefault(entry["Hid"], {})[phase] = entry[phase]["best"]["config"]
    return table


@torch.library.custom_op("hiera_autopatch::linear_gelu", mutates_args=())
def linear_gelu_op(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``linear_gelu`` at ``CONFIG_BY_WIDTH``'s forward config for w1's width."""
    return linear_gelu(x.contiguous(), w1, b1, CONFIG_BY_WIDTH.get(w1.shape[0], {}).get("fwd"))


@linear_gelu_op.register_fake
def _linear_gelu_shapes(x, w1, b1):
    out = x.new_empty(x.shape[0], w1.shape[0])
    return out, torch.empty_like(out)


@torch.library.custom_op("hiera_autopatch::matmul_gelu_backward", mutates_args=())
def matmul_gelu_backward_op(d_out: torch.Tensor, w2: torch.Tensor, hidden: torch.Tensor
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``matmul_gelu_backward(..., bias_grad=True)`` at ``CONFIG_BY_WIDTH``'s backward config:
    (d_hidden, gelu(hidden), fc1's bias gradient)."""
    config = CONFIG_BY_WIDTH.get(hidden.shape[-1], {}).get("bwd")
    return matmul_gelu_backward(d_out.contiguous(), w2, hidden, config, bias_grad=True)


@matmul_gelu_backward_op.register_fake
def _matmul_gelu_backward_shapes(d_out, w2, hidden):
    out = hidden.new_empty(hidden.shape)
    return out, torch.empty_like(out), hidden.new_empty(hidden.shape[-1:])
