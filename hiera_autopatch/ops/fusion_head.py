"""MAE multi-scale fusion heads as one matrix product each.

FAIR's fusion heads are convolutions whose kernel equals their stride (a patchify), applied to
each mask unit's features of an early stage: ``apply_fusion_head`` permutes the features to
(B * units, C, *unit) and back. cuDNN runs them as implicit GEMMs; in the graphed H200 step the two
heads of Hiera-B took 0.37 ms a step, the larger head's input gradient 0.13 ms of it on an sm80
kernel (benchmarks/results/h200_profile_final.json). Here the features are regrouped into
kernel-sized patches (one copy) and multiplied with the weight in the same (taps, channels) order:
the same sums, run by cuBLAS, and the result lands in FAIR's (B, units, *unit_final, C) layout
without a permute back.

On by default (``as_matmul``). Together with the aligned patch-embedding matmul
(``patch_embed.aligned``), the graphed step on an H100 took 34.56 / 34.56 ms against 35.00 / 35.34
without the two, interleaved in one run (benchmarks/results/h100_profile_session15_each.json).
``scripts/profile_step.py``'s ``+conv_heads`` runs FAIR's convolutions, for A/Bs. A head that is
not a plain patchify convolution (``usable``) runs FAIR's code.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

as_matmul = True
"""Fusion heads as a matrix product (False: FAIR's ``apply_fusion_head``). See the module docstring."""


def usable(head: nn.Module, features: torch.Tensor) -> bool:
    """A plain convolution with kernel == stride and no padding, tiling each unit of ``features``
    (B, units, *unit, C) exactly: what ``patchify_head`` reproduces."""
    if type(head) not in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        return False
    unit = features.shape[2:-1]
    return (
        head.groups == 1
        and tuple(head.kernel_size) == tuple(head.stride)
        and not isinstance(head.padding, str)
        and all(p == 0 for p in head.padding)
        and all(d == 1 for d in head.dilation)
        and len(unit) == len(head.kernel_size)
        and all(u % k == 0 for u, k in zip(unit, head.kernel_size))
        and features.shape[-1] == head.in_channels
        and not (head._forward_hooks or head._forward_pre_hooks)
    )


def patchify_head(head: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """``apply_fusion_head(head, features)`` as one matmul.

    features: (B, U, *unit, C) -> (B, U, *out, C_out), out = unit // kernel."""
    batch, units, *unit, channels = features.shape
    kernel = list(head.kernel_size)
    out = [u // k for u, k in zip(unit, kernel)]
    dims = len(kernel)
    # (B, U, o1, k1, o2, k2, ..., C): each unit axis split into (output position, tap in the kernel)
    split = features.reshape(batch, units, *[n for o, k in zip(out, kernel) for n in (o, k)], channels)
    # (B, U, o1, o2, ..., k1, k2, ..., C): output positions first, then one window's taps and channels
    order = [0, 1, *range(2, 2 + 2 * dims, 2), *range(3, 3 + 2 * dims, 2), 2 + 2 * dims]
    patches = split.permute(order).reshape(-1, math.prod(kernel) * channels)  # (B*U*prod(out), K*C)
    # conv weight (C_out, C, k1, k2, ...) -> (C_out, k1, k2, ..., C) -> (C_out, K*C), the patches' order
    weight = head.weight.permute(0, *range(2, 2 + dims), 1).reshape(head.out_channels, -1)
    fused = F.linear(patches, weight, head.bias)  # (B*U*prod(out), C_out)
    return fused.view(batch, units, *out, head.out_channels)
