"""MAE patch embedding for the kept tokens only.

FAIR embeds every token (``conv(x * pixel_mask)`` over the whole image), adds the position
embedding, unrolls, and then drops the masked units: with mask ratio 0.6, 60% of the convolution,
of the position-embedding add and of the unroll copies is thrown away. Here the tokens that survive
are known first (FAIR's unroll and keep applied to token ids), and the convolution is computed at
those tokens only, as a gather of their pixel windows and one matrix product with the conv weight.
Same math: the masked pixels are zeroed exactly as FAIR zeroes them, so a kept token next to a
masked unit sees the same zeros in its window.

On by default (``kept_only``, which the registry sets from ``HIERA_OPTIM_KEPT_EMBED``): on the
H200 it took a CUDA-graphed Hiera-B MAE step from 36.5 to 33.8 ms
(benchmarks/results/h200_profile_kept_embed.json). ``scripts/profile_step.py`` A/Bs it with
the mode suffixes ``+kept_embed`` / ``+full_embed``; where the convolution is not a plain one
(``usable``) or FAIR's embedding code differs, FAIR's full embedding runs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import masking

kept_only = True
"""Embed only the kept tokens of an MAE step (False: FAIR's full embedding). See the module docstring."""

aligned = True
"""Pad the matrix product's reduction dim (``C_in * prod(kernel)``: 147 for Hiera's 3-channel 7x7
conv) with zero columns to a multiple of ``ALIGN_COLUMNS``. cuBLAS needs that alignment for its Hopper
GEMMs: unpadded bf16 rows are 294 bytes apart. This product and its weight gradient are the MAE
step's only such matmuls (benchmarks/results/cpu_flops_session15.json), and the
graphed H200 step ran one GEMM and one weight-gradient GEMM on sm75 ``align1`` kernels, 0.08 +
0.07 ms a step (benchmarks/results/h200_profile_final.json). The zeros add exact zeros, and the
weight's padded gradient columns are dropped. Timed together with ``fusion_head.as_matmul``
(see there). False: unpadded (``scripts/profile_step.py``'s ``+unaligned_embed``)."""

ALIGN_COLUMNS = 8
"""16-byte rows in bf16/fp16, the dtypes the GEMM runs in on a GPU (autocast included; fp32 rows
are then 32 bytes)."""


def usable(conv: nn.Module) -> bool:
    """A plain zero-padded Conv2d/Conv3d: what the gather + matmul below reproduces."""
    return (
        type(conv) in (nn.Conv2d, nn.Conv3d)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and all(d == 1 for d in conv.dilation)
        and not isinstance(conv.padding, str)
        and not (conv._forward_hooks or conv._forward_pre_hooks)
    )


def kept_token_ids(unroll: nn.Module, num_tokens: int, keep_idx: torch.Tensor, num_units: int) -> torch.Tensor:
    """Spatial (row-major) index of each token FAIR's encoder keeps, in the order it keeps them.

    FAIR's own ``unroll`` and our ``keep_mask_units`` applied to the ids 0..N-1.
    keep_idx: (B, n_keep) -> (B, n_keep * mu_size) int64.
    """
    ids = torch.arange(num_tokens, device=keep_idx.device).view(1, num_tokens, 1)  # (1, N, 1)
    ids = unroll(ids).expand(keep_idx.shape[0], -1, -1)  # (B, N, 1), unrolled order
    return masking.keep_mask_units(ids, keep_idx, num_units)[..., 0]  # (B, n_keep * mu)


def _kernel_offsets(kernel: Sequence[int], device) -> torch.Tensor:
    """Every offset inside the kernel, row-major like the conv weight's (kd, kh, kw): (K, dims)."""
    grids = torch.meshgrid(*[torch.arange(k, device=device) for k in kernel], indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], dim=-1)


def embed_tokens(x: torch.Tensor, pixel_keep: torch.Tensor, conv: nn.Module, token_ids: torch.Tensor,
                 token_shape: Sequence[int]) -> torch.Tensor:
    """``conv(x * pixel_keep)`` at the tokens ``token_ids`` only, as FAIR's PatchEmbed lays it out.

    x: (B, C_in, *spatial); pixel_keep: bool, broadcastable to x; token_ids: (B, T) row-major
    indices into ``token_shape`` (the conv's output grid). Returns (B, T, C_out).
    """
    batch, in_chans = x.shape[:2]
    dims = len(token_shape)
    x = x * pixel_keep  # FAIR's do_masked_conv: masked pixels are zeros in every window
    x = F.pad(x, [p for pad in reversed(conv.padding) for p in (pad, pad)])  # (B, C_in, *padded)
    padded = x.shape[2:]
    # token coordinates on the output grid: (B, T, dims)
    coords, rest = [], token_ids
    for size in reversed(token_shape):
        coords.append(rest % size)
        rest = rest // size
    coords = torch.stack(coords[::-1], dim=-1)
    stride = torch.tensor(conv.stride, device=x.device)
    offsets = _kernel_offsets(conv.kernel_size, x.device)  # (K, dims)
    pixels = coords[:, :, None, :] * stride + offsets  # (B, T, K, dims), padded coordinates
    flat = pixels[..., 0]
    for d in range(1, dims):
        flat = flat * padded[d] + pixels[..., d]  # (B, T, K) row-major index into padded
    tokens, taps = flat.shape[1], flat.shape[2]
    index = flat.reshape(batch, 1, tokens * taps).expand(batch, in_chans, tokens * taps)
    windows = x.flatten(2).gather(2, index)  # (B, C_in, T*K)
    windows = windows.view(batch, in_chans, tokens, taps).transpose(1, 2)  # (B, T, C_in, K)
    windows = windows.reshape(batch, tokens, in_chans * taps)  # (B, T, C_in*K), the weight's order
    weight = conv.weight.reshape(conv.out_channels, in_chans * taps)  # (C_out, C_in*K)
    pad = -(in_chans * taps) % ALIGN_COLUMNS if aligned else 0
    if pad:  # (B, T, C_in*K + pad) and (C_out, C_in*K + pad): zero columns, zero products
        windows, weight = F.pad(windows, (0, pad)), F.pad(weight, (0, pad))
    return F.linear(windows, weight, conv.bias)  # (B, T, C_out)


def position_rows(pos_embed: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows ``token_ids`` of a (1, N, C) position embedding: (B, T, C), in its dtype.

    Gathered from an fp32 copy: the gradient is a scatter-add over the batch, which a GPU may do
    with atomics in the tensor's dtype; FAIR's broadcast add sums the batch in an fp32 reduction.
    (On CPU the bf16 errors were the same either way.)
    """
    table = pos_embed.reshape(-1, pos_embed.shape[-1])  # (N, C)
    return table.float()[token_ids].to(pos_embed.dtype)
