"""``(x, norm(x))`` for a block's LayerNorm whose input also feeds the residual add.

Autograd sums two gradients into such an ``x``: the residual path's and the norm's input
gradient. ``fork`` owns both uses, so its backward gets both and hands them to one kernel
(``triton/layer_norm.py``) that also takes the norm's weight and bias gradients on the same pass
over the rows. The forward is ``aten.native_layer_norm``, traced as before, so torch.compile
still fuses it with the residual add that produced ``x``.

Used only under torch.compile (our CUDA graphs included), like ``mlp.GeluMlp``: there the backward
kernels it replaces are Inductor's (input gradient, weight-gradient partial sums, and the ATen or
Triton sums that finish them).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from . import mlp
from .triton import layer_norm as triton_layer_norm

fused_backward = True
"""``fork``'s one-pass backward under torch.compile. False: ``(x, norm(x))``, Inductor's kernels
(``scripts/profile_step.py``'s ``+inductor_ln``; ``+fused_ln`` names the default)."""


class ForkLayerNorm(torch.autograd.Function):
    """x (..., C) -> (x, layer_norm(x)); backward: d_x = d_res + the norm's input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.set_materialize_grads(False)  # an unused residual output gives d_res None, not zeros
        return x.view_as(x), y

    @staticmethod
    def backward(ctx, d_res, dy):
        x, mean, rstd, weight = ctx.saved_tensors
        if dy is None:  # the norm's output unused: only the residual path's gradient
            return d_res, None, None, None
        dx, dw, db = triton_layer_norm.layer_norm_backward_op(dy, x, mean, rstd, weight, d_res)
        return dx, dw, db, None


def wanted(norm: nn.Module, x: torch.Tensor) -> bool:
    """``fork`` takes this call: switched on, under torch.compile, a plain affine LayerNorm over the
    last dim, without autocast (it would run the norm in fp32), hooks or grad-less weights."""
    return (
        fused_backward
        and torch.compiler.is_compiling()
        and torch.is_grad_enabled()
        and type(norm) is nn.LayerNorm
        and len(norm.normalized_shape) == 1
        and norm.weight is not None
        and norm.bias is not None
        and norm.weight.requires_grad
        and norm.bias.requires_grad
        and mlp.autocast_dtype(x.device.type) is None
        and x.dtype == norm.weight.dtype == norm.bias.dtype
        and mlp.no_hooks(norm)
        and triton_layer_norm.supports(x, norm.weight)
    )


def fork(norm: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x, norm(x))``, the same values; with ``wanted`` through ``ForkLayerNorm``. The caller uses
    the first output where it would have used ``x`` (the residual), so its gradient reaches the
    norm's backward."""
    if wanted(norm, x):
        return ForkLayerNorm.apply(x, norm.weight, norm.bias, norm.eps)
    return x, norm(x)
