"""The block MLP ``fc2(gelu(fc1(x)))`` saving one hidden-size tensor less for backward.

Autograd keeps three tensors for timm's ``Mlp``: fc1's input, fc1's output (for GELU's backward)
and GELU's output (for fc2's weight grad). The last two have the hidden size (4x the width), so
they are most of a Hiera block's saved activations. ``GeluMlp`` keeps only fc1's input and output
and recomputes GELU in backward. Every product is the one autograd computes, on the same tensors,
so the gradients are the same.

Used only under torch.compile (our CUDA graphs included): there Inductor folds the recomputation
into the GELU-backward kernel it runs anyway. H200, Hiera-B MAE, graphs: 37.0 ms/step at 6.3 GiB
with it (benchmarks/results/h200_profile_gaps.json) against 37.5 ms at 8.0 GiB without it in an
earlier run (h200_profile_ablation.json; two runs, not an interleaved A/B). In eager it is one more
kernel and a Python autograd node per block: 2-7 ms per step slower in an interleaved A/B
(h200_profile_block_decoder.json).

Under torch.compile the backward takes GELU, its gradient and fc1's bias gradient from one Triton
kernel (``triton/gelu.py``). In the graphed step Inductor instead runs GELU's backward twice: once
pointwise (GELU and its gradient) and once inside the bias-sum reduction. H100, Hiera-B MAE,
graphs, two interleaved pairs: 33.8 / 34.1 ms/step with our kernel against 36.0 / 35.2 without;
GPU time in reductions 1.13 ms against 3.37 (benchmarks/results/h100_profile_gelu.json).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as module_globals

from .triton import gelu as triton_gelu
from .triton import gemm_gelu

fused_gelu_backward = True
"""``GeluMlp``'s backward takes GELU, its gradient and fc1's bias gradient from one kernel
(``triton/gelu.py``) where it can. False: Inductor's kernels, the bias gradient a second pass
over fc1's output gradient (``scripts/profile_step.py``'s ``+inductor_gelu``)."""

keep_act_widths: frozenset = frozenset()
"""Hidden widths (fc1's output features) whose GELU output the forward keeps for fc2's weight
gradient instead of recomputing it in backward: the backward kernel then skips writing it again
(one hidden-size pass less) at the cost of that tensor's memory until backward. Empty as shipped:
keeping the decoder's (2048; ``scripts/profile_step.py``'s ``+keep_act``) was faster in one of two
interleaved pairs on an H200, 29.99 / 30.95 ms against 31.26 / 30.90, for ~0.9 GiB more peak memory
(session 26, h200_profile_pdl_gelu_keep_inductor.json). ``+keep_act_all`` keeps every width's."""


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: no device_type argument
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return None


def _no_dropout(module: nn.Module) -> bool:
    return type(module) is nn.Identity or (type(module) is nn.Dropout and (module.p == 0 or not module.training))


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def no_hooks(*modules: nn.Module) -> bool:
    """No forward or backward hook, global or on any of ``modules``: code that computes what they
    compute without calling them (or on fewer rows) changes nothing a hook would see."""
    if any(getattr(module_globals, "_global" + name, None) for name in _HOOK_DICTS):
        return False
    return not any(getattr(m, name, None) for m in modules for name in _HOOK_DICTS)


def wanted() -> bool:
    """Recompute GELU in this call: only while torch.compile traces (see the module docstring)."""
    return torch.compiler.is_compiling()


def plain(mlp: nn.Module) -> bool:
    """A timm-style Mlp (the caller checked its forward) that computes exactly
    ``fc2(gelu(fc1(x)))``: plain Linears, exact GELU, no dropout, no norm, no hooks."""
    fc1, act, fc2 = mlp.fc1, mlp.act, mlp.fc2
    return (
        type(fc1) is nn.Linear
        and type(fc2) is nn.Linear
        and type(act) is nn.GELU
        and act.approximate == "none"
        and type(mlp.norm) is nn.Identity
        and _no_dropout(mlp.drop1)
        and _no_dropout(mlp.drop2)
        and no_hooks(mlp, fc1, act, fc2, mlp.norm, mlp.drop1, mlp.drop2)
    )


class GeluMlp(torch.autograd.Function):
    """``fc2(gelu(fc1(x)))`` that saves x and fc1's output, and recomputes GELU in backward."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        keep_act = w1.shape[0] in keep_act_widths
        x2 = x.reshape(-1, x.shape[-1])  # (M, C)
        in_epilogue = (  # experiment: the passes whose GEMM carries GELU (ops/triton/gemm_gelu.py)
            gemm_gelu.CONFIG_BY_WIDTH.get(w1.shape[0], {})
            if torch.compiler.is_compiling() and not keep_act and b1 is not None and gemm_gelu.supports(x2, w1, b1, w2)
            else {})
        ctx.gemm_gelu = "bwd" in in_epilogue
        if "fwd" in in_epilogue:  # fc1 with GELU in its epilogue
            hidden2, act2 = gemm_gelu.linear_gelu_op(x2, w1, b1)  # (M, Hid) each
            hidden, act = hidden2.view(*x.shape[:-1], -1), act2.view(*x.shape[:-1], -1)  # (..., Hid)
        else:
            hidden = F.linear(x, w1, b1)  # (..., Hid)
            act = F.gelu(hidden)  # (..., Hid)
        out = F.linear(act, w2, b2)  # (..., C)
        ctx.save_for_backward(x, hidden, w1, w2, *([act] if keep_act else []))
        ctx.has_bias = (b1 is not None, b2 is not None)
        ctx.fused_gelu = fused_gelu_backward and torch.compiler.is_compiling()  # our kernel: compiled only
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, hidden, w1, w2, *kept = ctx.saved_tensors
        act = kept[0] if kept else None  # GELU's output, if the forward kept it
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        with torch.autocast(d_out.device.type, enabled=False):
            d_out2 = d_out.reshape(-1, d_out.shape[-1])  # (M, C)
            hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (M, Hid)
            d_x = d_w1 = d_b1 = d_w2 = d_b2 = None
            if need_b2 and ctx.has_bias[1]:
                d_b2 = d_out2.sum(0)
            in_epilogue = ctx.gemm_gelu and need_w2 and need_b1
            d_act = None if in_epilogue else d_out.matmul(w2)  # (..., Hid): GELU's output gradient
            if in_epilogue:
                # experiment: fc2's data gradient with GELU's gradient, GELU and fc1's bias sums in its epilogue
                d_hidden2, act2, d_b1 = gemm_gelu.matmul_gelu_backward_op(d_out2, w2, hidden2)  # (M, Hid) x2, (Hid,)
                d_hidden = d_hidden2.view(hidden.shape)  # (..., Hid)
                d_w2 = d_out2.t().mm(act2)  # (C, Hid)
            elif ctx.fused_gelu and need_w2 and need_b1 and ctx.has_bias[0] and triton_gelu.supports(hidden):
                # one kernel: GELU's gradient, fc1's bias gradient (its column sums) and, unless the
                # forward kept it, GELU recomputed
                if act is None:
                    act, d_hidden, d_b1 = triton_gelu.gelu_backward_bias_op(d_act, hidden)
                else:
                    d_hidden, d_b1 = triton_gelu.gelu_grad_bias_op(d_act, hidden)
                d_w2 = d_out2.t().mm(act.reshape(-1, act.shape[-1]))  # (C, Hid)
            else:
                if need_w2:
                    act2 = F.gelu(hidden2) if act is None else act.reshape(hidden2.shape)  # (M, Hid)
                    d_w2 = d_out2.t().mm(act2)  # (C, Hid)
                d_hidden = torch.ops.aten.gelu_backward(d_act, hidden)  # (..., Hid)
                if need_b1 and ctx.has_bias[0]:
                    d_b1 = d_hidden.reshape(-1, d_hidden.shape[-1]).sum(0)
            d_hidden2 = d_hidden.reshape(-1, d_hidden.shape[-1])  # (M, Hid)
            if need_w1:
                d_w1 = d_hidden2.t().mm(x.reshape(-1, x.shape[-1]))  # (Hid, C_in)
            if need_x:
                d_x = d_hidden.matmul(w1)  # (..., C_in)
        return d_x, d_w1, d_b1, d_w2, d_b2


def gelu_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)`` through ``GeluMlp``, for an Mlp that ``plain`` accepted."""
    w1, b1, w2, b2 = mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias
    cast_to = autocast_dtype(x.device.type)
    if cast_to is None:
        return GeluMlp.apply(x, w1, b1, w2, b2)
    # autocast runs Linear in cast_to: cast as it would (differentiably), then run without it
    cast = [t if t is None else t.to(cast_to) for t in (x, w1, b1, w2, b2)]
    with torch.autocast(x.device.type, enabled=False):
        return GeluMlp.apply(*cast)
