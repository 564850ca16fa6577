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

import operator
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from . import mlp
from .triton import layer_norm as triton_layer_norm

fused_backward = True
"""``fork``'s one-pass backward under torch.compile. False: ``(x, norm(x))``, Inductor's kernels
(``scripts/profile_step.py``'s ``+inductor_ln``; ``+fused_ln`` names the default)."""

dx_sums = True
"""In our graphed step, ``fold_dx_sums`` (below) runs as Inductor's post-grad pass. False: the
bias gradients stay Inductor's reductions (``scripts/profile_step.py``'s ``+no_dx_sum``)."""


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


# --- the bias gradient that sums dx ------------------------------------------------------------
#
# In a block, the gradient ``dx`` this backward writes is also the gradient of the Linear whose
# output was ``x`` (attention's proj for norm2, the previous block's fc2 for norm1), and autograd
# takes that Linear's bias gradient as ``dx.view(-1, C).sum(0)``: a reduction that reads dx again.
# The kernel has each dx row in registers already, so ``fold_dx_sums`` swaps such an op for
# ``layer_norm_backward_dx_sum``, whose fourth output is that sum, and drops the reduction.

_VIEWS = ("view", "reshape", "_unsafe_view")


def _row_sums(dx: torch.fx.Node) -> List[torch.fx.Node]:
    """The ``aten.sum`` nodes that sum ``dx`` (through views that keep its last dim) over every dim
    but the last, in dx's dtype: each equals dx's column sums."""
    aten = torch.ops.aten
    width = dx.meta["val"].shape[-1]
    found, frontier = [], [dx]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            target = getattr(user.target, "overloadpacket", None)
            val = user.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            if target in [getattr(aten, v) for v in _VIEWS] and user.args[0] is node and val.shape[-1:] == (width,):
                frontier.append(user)
            elif user.target is aten.sum.dim_IntList and user.args[0] is node and "dtype" not in user.kwargs:
                rank = node.meta["val"].dim()
                dims = sorted(d % rank for d in user.args[1])
                if dims == list(range(rank - 1)) and val.dtype == dx.meta["val"].dtype and val.numel() == width:
                    found.append(user)
    return found


def fold_dx_sums(graph: torch.fx.Graph) -> int:
    """Post-grad pass: each ``layer_norm_backward`` whose dx is also summed over its rows becomes
    ``layer_norm_backward_dx_sum``, and those sums read its fourth output. Returns how many ops."""
    op = torch.ops.hiera_autopatch.layer_norm_backward.default
    fused = torch.ops.hiera_autopatch.layer_norm_backward_dx_sum.default
    folded = 0
    for node in list(graph.nodes):
        if node.target is not op:
            continue
        outputs = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        dx = outputs.get(0)
        sums = _row_sums(dx) if dx is not None and "val" in dx.meta else []
        if not sums:
            continue
        dx_val = dx.meta["val"]
        with dx_val.fake_mode:
            ds_val = dx_val.new_empty(dx_val.shape[-1:])  # (C,)
        with graph.inserting_after(node):
            new = graph.call_function(fused, node.args, node.kwargs)
        new.meta = {**node.meta, "val": (*node.meta["val"], ds_val)}
        for index, user in outputs.items():
            user.args = (new, index)
        with graph.inserting_after(new):
            ds = graph.call_function(operator.getitem, (new, 3))
        ds.meta = {**dx.meta, "val": ds_val}
        for total in sums:
            with graph.inserting_before(total):
                view = graph.call_function(torch.ops.aten.view.default, (ds, list(total.meta["val"].shape)))
            view.meta = dict(total.meta)
            total.replace_all_uses_with(view)
            graph.erase_node(total)
        graph.erase_node(node)
        folded += 1
    return folded


def dx_sums_pass() -> Optional[object]:
    """``fold_dx_sums`` as an Inductor ``CustomGraphPass`` (its uuid: this file's hash, for the FX
    graph cache); None where this torch has no such class."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    except ImportError:
        return None

    class FoldDxSums(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fold_dx_sums(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__, triton_layer_norm.__file__))

    return FoldDxSums()
