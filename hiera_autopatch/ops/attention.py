"""Mask-unit attention with 4-D q/k/v, so PyTorch's fused SDPA kernels run instead of the math path.

FAIR hands SDPA 5-D tensors ``(B, heads, windows, tokens, head_dim)``; every fused backend rejects
them. Folding windows into the batch gives ``(B*windows, heads, tokens, head_dim)``, which they
accept, while the token layout in and out stays FAIR's (window index fastest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import mlp
from .triton import window_attention as triton_attention

MAX_FUSED_BATCH = 65535
"""Flash and mem-efficient SDPA fail once the batch dim reaches 65,536: larger calls are split."""

backend = "auto"
"""``auto``, ``sdpa`` or ``triton``; set by the registry from ``HIERA_OPTIM_ATTENTION``."""

TRITON_MAX_KEYS = 128
"""``auto`` sends a call to our Triton kernel when each window's keys fit one 128-key block: all of
Hiera's mask-unit attention and its short global stages; with head_dim <= 64 up to
``TRITON_MAX_KEYS_SMALL_HEADS`` keys (the MAE decoder: 196 tokens, head_dim 32). Longer
sequences with wide heads (classification's 196-token stage 3, head_dim 96) go to SDPA, which was
faster there on the H200 (benchmarks/results/h200_attention_kernels.json).
Only inside torch.compile / our CUDA graphs: in plain eager the step is bound by kernel launches,
and a custom op's launch costs more host time than SDPA's (measured: eager step 93 vs 82 ms)."""

TRITON_MAX_KEYS_SMALL_HEADS = 256
"""The decoder's 196-token attention (head_dim 32): Triton 0.40 ms fwd+bwd vs cuDNN 0.86 ms with
its layout copies (benchmarks/results/h200_attention_sweep.json)."""


def triton_max_keys(head_dim: int) -> int:
    return TRITON_MAX_KEYS_SMALL_HEADS if head_dim <= 64 else TRITON_MAX_KEYS


choices: dict = {}
"""What ran, per call shape seen in this process: (windows, tokens per window, q_stride, heads,
head_dim, compiled) -> "triton" or "sdpa". ``hiera_autopatch.status()`` lists it."""


def _record(qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int, kernel: str) -> None:
    _, tokens, channels = qkv.shape
    key = (num_windows, tokens // num_windows, q_stride, heads, channels // (3 * heads))
    # under torch.compile with dynamic shapes a size is symbolic: not recorded (a symbolic dict key
    # would break the graph), and the batch size is left out of the key for that reason
    if all(type(value) is int for value in key):
        choices[key + (torch.compiler.is_compiling(),)] = kernel


def describe_choices() -> dict:
    """``choices`` as readable strings, e.g. "nw=19 T=64 S=1 H=1 D=96 compiled": "triton"."""
    return {
        f"nw={nw} T={t} S={s} H={h} D={d} {'compiled' if compiled else 'eager'}": kernel
        for (nw, t, s, h, d, compiled), kernel in choices.items()
    }


def use_triton(qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int) -> bool:
    """Which kernel runs this call: ours where it is faster and supports the shape, else SDPA."""
    if backend == "sdpa":
        return False
    if not triton_attention.supports(qkv, num_windows, heads, q_stride):
        return False
    if backend == "triton":
        return True
    head_dim = qkv.shape[2] // (3 * heads)
    return (
        qkv.is_cuda
        and torch.compiler.is_compiling()
        and qkv.shape[1] // num_windows <= triton_max_keys(head_dim)
    )


fused_bias_grad = False
"""Where our Triton kernel runs after a plain ``nn.Linear`` qkv with a bias: the bias's gradient
from column sums the backward kernels take while they write dqkv (``qkv_attention``), instead of
autograd's reduction, which reads dqkv again (two kernels a layer). Off: it lost on an H100 in both
interleaved pairs of one run, graphed step 34.56 / 34.56 ms with it against 33.78 / 34.33 without
(benchmarks/results/h100_profile_session15_each.json); the backward kernels, at 255 registers
already, spill more with the sums in most shapes (sm90_compile/window_attention_registers.json).
True: on (``scripts/profile_step.py``'s ``+kernel_bias_grad``), for A/Bs."""


def _plain_biased_linear(linear: torch.nn.Module) -> bool:
    return (type(linear) is torch.nn.Linear and linear.bias is not None and linear.bias.requires_grad
            and torch.is_grad_enabled() and mlp.no_hooks(linear))


def _kernel_may_take() -> bool:
    """Our kernel may take this call (``use_triton`` then decides from the qkv it would get)."""
    return backend == "triton" or (backend == "auto" and torch.compiler.is_compiling())


def qkv_attention(x: torch.Tensor, qkv_linear: torch.nn.Module, num_windows: int, heads: int,
                  q_stride: int, pool: str = "max") -> torch.Tensor:
    """``mask_unit_attention(qkv_linear(x), ...)``, the same values.

    When our kernel takes the call and ``qkv_linear`` is a plain Linear with a bias: qkv is
    ``F.linear`` with a detached bias (FAIR's values, bit for bit) and the bias goes to the kernel,
    whose backward gives its gradient (``fused_bias_grad``). Where the kernel then declines the
    call after all, the Linear runs again: only under torch.compile (which drops the unused
    product) or with ``HIERA_OPTIM_ATTENTION=triton`` on a call it does not support. Off by
    default: with ``fused_bias_grad`` False this is ``mask_unit_attention(qkv_linear(x), ...)``."""
    if fused_bias_grad and _kernel_may_take() and x.dim() == 3 and _plain_biased_linear(qkv_linear):
        qkv = F.linear(x, qkv_linear.weight, qkv_linear.bias.detach())  # (B, N, 3*H*D)
        if use_triton(qkv, num_windows, heads, q_stride):
            _record(qkv, num_windows, heads, q_stride, "triton")
            return triton_attention.window_attention(qkv, num_windows, heads, q_stride, pool,
                                                     bias=qkv_linear.bias)
    return mask_unit_attention(qkv_linear(x), num_windows, heads, q_stride, pool)


def pool_q(q: torch.Tensor, q_stride: int, pool: str) -> torch.Tensor:
    """Max-pool q over the ``q_stride`` unrolled offsets. (..., T, D) -> (..., T // q_stride, D).

    ``pool="max"`` is FAIR's ``max(dim).values`` (gradient to one index on ties),
    ``pool="amax"`` is timm's (gradient split among ties).
    """
    *lead, tokens, head_dim = q.shape
    q = q.view(*lead, q_stride, tokens // q_stride, head_dim)  # (..., S, T/S, D)
    if pool == "amax":
        return q.amax(dim=-3)
    return q.max(dim=-3).values


sdpa_backend = None
"""None: PyTorch picks SDPA's kernel. ``flash``, ``efficient`` or ``cudnn``: pin it (experiments)."""


def _pinned_backend(q: torch.Tensor):
    """The SDPA backend to pin for this call, or None to let PyTorch pick.

    fp16 on CPU gets the math backend, the one FAIR's 5-D call gets: PyTorch's CPU flash kernel
    loses fp16 gradients that fall below fp16's normal range (~6e-5, common in an unscaled MAE loss's
    backward): relative q/k grad error 2.8e-2 vs the math backend's 9.5e-3 on Hiera's window shapes
    against fp64 (torch 2.14 CPU), which tripled a Hiera-B MAE step's error on early-block weights.
    """
    from torch.nn.attention import SDPBackend

    if q.device.type == "cpu" and q.dtype == torch.float16:
        return SDPBackend.MATH
    if sdpa_backend is not None and q.is_cuda:
        return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}[sdpa_backend]
    return None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    pinned = _pinned_backend(q)
    if pinned is None:
        return F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([pinned]):
        return F.scaled_dot_product_attention(q, k, v)


def sdpa_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on (batch, heads, tokens, head_dim), split past the batch limit."""
    if q.shape[0] <= MAX_FUSED_BATCH:
        return _sdpa(q, k, v)
    outs = [_sdpa(qc, kc, vc) for qc, kc, vc in
            zip(q.split(MAX_FUSED_BATCH), k.split(MAX_FUSED_BATCH), v.split(MAX_FUSED_BATCH))]
    return torch.cat(outs)


def mask_unit_attention(
    qkv: torch.Tensor, num_windows: int, heads: int, q_stride: int, pool: str = "max"
) -> torch.Tensor:
    """Attention within each mask unit (``num_windows == 1``: global attention).

    qkv: (B, N, 3 * heads * head_dim), the qkv Linear's output, token n = t * num_windows + w.
    Returns (B, N // q_stride, heads * head_dim) in FAIR's layout, ready for the output Linear.
    """
    if use_triton(qkv, num_windows, heads, q_stride):
        _record(qkv, num_windows, heads, q_stride, "triton")
        return triton_attention.window_attention(qkv, num_windows, heads, q_stride, pool)
    _record(qkv, num_windows, heads, q_stride, "sdpa")
    batch, tokens, channels = qkv.shape
    head_dim = channels // (3 * heads)
    per_window = tokens // num_windows
    # (B, T, nw, 3, H, D) -> (3, B, nw, H, T, D) -> (3, B*nw, H, T, D): one copy when nw > 1
    qkv = qkv.view(batch, per_window, num_windows, 3, heads, head_dim).permute(3, 0, 2, 4, 1, 5)
    qkv = qkv.reshape(3, batch * num_windows, heads, per_window, head_dim)
    q, k, v = qkv.unbind(0)  # each (B*nw, H, T, D)
    if q_stride > 1:
        q = pool_q(q, q_stride, pool)  # (B*nw, H, T/S, D)
    out = sdpa_4d(q, k, v)  # (B*nw, H, Tq, D)
    out = out.view(batch, num_windows, heads, -1, head_dim)  # (B, nw, H, Tq, D)
    # (B, Tq, nw, H, D) -> (B, Tq*nw, H*D): FAIR's x.transpose(1, 3).reshape(B, -1, dim_out)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, -1, heads * head_dim)
