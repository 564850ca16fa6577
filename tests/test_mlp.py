"""ops/mlp.py: GeluMlp against timm's Mlp (outputs, input grad, every weight grad), what it saves
for backward, and when the block patch must keep timm's module call."""

import pytest
import torch
from timm.layers import Mlp

from hiera_autopatch.ops import mlp as mlp_ops


def run(fn, module, x, upstream):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward(upstream)
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def assert_same(a, b, atol, rtol):
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = a, b
    torch.testing.assert_close(out_b, out_a, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx_b, dx_a, atol=atol, rtol=rtol)
    assert g_a.keys() == g_b.keys() and len(g_a) == 4
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize(
    "dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-12, 1e-12), (torch.bfloat16, 2e-2, 2e-2)]
)
@pytest.mark.parametrize("shape", [(2, 7, 12), (5, 12)])
@pytest.mark.parametrize("keep_act", [False, True], ids=["recompute", "keep-act"])
def test_gelu_mlp_matches_timm_mlp(monkeypatch, dtype, atol, rtol, shape, keep_act):
    """Recomputing GELU in backward, or keeping the forward's (``keep_act_widths``): timm's results."""
    monkeypatch.setattr(mlp_ops, "keep_act_widths", frozenset({48} if keep_act else ()))
    torch.manual_seed(0)
    module = Mlp(12, 48).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    upstream = torch.randn(*shape, dtype=dtype)
    assert mlp_ops.plain(module)
    reference = run(module, module, x, upstream)
    fused = run(lambda t: mlp_ops.gelu_mlp(module, t), module, x, upstream)
    assert_same(reference, fused, atol, rtol)


def test_gelu_mlp_under_autocast_matches_timm_mlp():
    torch.manual_seed(0)
    module = Mlp(16, 64)  # fp32 parameters, bf16 autocast: the AMP recipe
    x, upstream = torch.randn(3, 5, 16), torch.randn(3, 5, 16)

    def under_autocast(fn):
        def call(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(t)

        return call

    reference = run(under_autocast(module), module, x, upstream.bfloat16())
    fused = run(under_autocast(lambda t: mlp_ops.gelu_mlp(module, t)), module, x, upstream.bfloat16())
    assert fused[0].dtype == reference[0].dtype == torch.bfloat16
    assert fused[1].dtype == torch.float32 and all(g.dtype == torch.float32 for g in fused[2].values())
    assert_same(reference, fused, 1e-6, 1e-6)  # same casts, same bf16 products


def test_gelu_mlp_frozen_weights_and_no_bias():
    torch.manual_seed(0)
    module = Mlp(8, 32, bias=False)
    module.fc1.weight.requires_grad_(False)
    x = torch.randn(4, 8, requires_grad=True)
    out = mlp_ops.gelu_mlp(module, x)
    out.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    module.fc2.weight.grad, grad_fc2 = None, module.fc2.weight.grad
    module(ref_x).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(grad_fc2, module.fc2.weight.grad)
    assert module.fc1.weight.grad is None


def saved_bytes(fn, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return total


def test_gelu_mlp_saves_one_hidden_tensor_less():
    module = Mlp(16, 64)
    x = torch.randn(10, 16, requires_grad=True)
    hidden_bytes = 10 * 64 * 4
    weight_bytes = 2 * 16 * 64 * 4  # both Functions save the weights (no copy: same storage)
    activations_timm = saved_bytes(module, x) - weight_bytes
    activations_ours = saved_bytes(lambda t: mlp_ops.gelu_mlp(module, t), x) - weight_bytes
    assert activations_timm - activations_ours == hidden_bytes


def test_gelu_mlp_keeps_act_only_for_listed_widths(monkeypatch):
    """``keep_act_widths``: a listed hidden width saves GELU's output as timm's Mlp does; others not."""
    module = Mlp(16, 64)
    x = torch.randn(10, 16, requires_grad=True)
    activations_timm = saved_bytes(module, x)
    monkeypatch.setattr(mlp_ops, "keep_act_widths", frozenset({64}))
    assert saved_bytes(lambda t: mlp_ops.gelu_mlp(module, t), x) == activations_timm
    monkeypatch.setattr(mlp_ops, "keep_act_widths", frozenset({128}))
    assert activations_timm - saved_bytes(lambda t: mlp_ops.gelu_mlp(module, t), x) == 10 * 64 * 4


def test_recompute_only_under_compile():
    assert not mlp_ops.wanted()
    assert torch.compile(lambda t: t + int(mlp_ops.wanted()), fullgraph=True, backend="eager")(torch.zeros(1)).item() == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.fc1.register_forward_hook(lambda *a: None),
        lambda m: m.register_forward_pre_hook(lambda *a: None),
        lambda m: m.fc2.register_full_backward_hook(lambda *a: None),
        lambda m: setattr(m, "act", torch.nn.GELU(approximate="tanh")),
        lambda m: setattr(m, "act", torch.nn.ReLU()),
        lambda m: setattr(m, "drop1", torch.nn.Dropout(0.1)),
        lambda m: setattr(m, "norm", torch.nn.LayerNorm(32)),
    ],
)
def test_not_plain_when_the_module_computes_something_else(change):
    module = Mlp(8, 32)
    assert mlp_ops.plain(module)
    change(module)
    assert not mlp_ops.plain(module)


def test_dropout_in_eval_is_plain():
    module = Mlp(8, 32, drop=0.1)
    assert not mlp_ops.plain(module.train())
    assert mlp_ops.plain(module.eval())


def test_fair_block_patch_saves_less_and_matches(monkeypatch):
    """fair.block on FAIR's HieraBlock, where it recomputes (under torch.compile; forced here so
    saved tensors can be counted eagerly): one hidden-size tensor less saved, same results."""
    hiera = pytest.importorskip("hiera")
    import hiera_autopatch

    monkeypatch.setattr(mlp_ops, "wanted", lambda: True)
    torch.manual_seed(0)
    block = hiera.hiera.HieraBlock(dim=16, dim_out=16, heads=2)
    x, upstream = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    with hiera_autopatch.disabled():
        fair_bytes = saved_bytes(block, x.requires_grad_(True))
        fair = run(block, block, x, upstream)
    hiera_autopatch.enable(disabled_patches={"fair.attention"})  # only the block differs
    try:
        assert hiera.hiera.HieraBlock.forward.__hiera_autopatch__ == "fair.block"
        ours_bytes = saved_bytes(block, x)
        ours = run(block, block, x, upstream)
    finally:
        hiera_autopatch.disable()
    assert fair_bytes - ours_bytes == 2 * 9 * 64 * 4  # (B, N, 4*dim) fp32
    out_fair, dx_fair, g_fair = fair
    out_ours, dx_ours, g_ours = ours
    torch.testing.assert_close(out_ours, out_fair, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dx_ours, dx_fair, atol=1e-6, rtol=1e-6)
    assert g_fair.keys() == g_ours.keys()
    for name in g_fair:
        torch.testing.assert_close(g_ours[name], g_fair[name], atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("keep_act", [False, True], ids=["recompute", "keep-act"])
def test_compiled_gelu_mlp_saves_act_only_when_kept(monkeypatch, keep_act):
    """Under torch.compile, Inductor's partitioner chooses what the compiled forward saves: the kept
    GELU output must stay saved (not be recomputed from fc1's output), and without it only one
    hidden-size tensor is saved."""
    monkeypatch.setattr(mlp_ops, "keep_act_widths", frozenset({256} if keep_act else ()))
    torch._dynamo.reset()
    fc1, fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    x = torch.randn(512, 64, requires_grad=True)
    compiled = torch.compile(lambda t: mlp_ops.GeluMlp.apply(t, fc1.weight, fc1.bias, fc2.weight, fc2.bias),
                             fullgraph=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (shapes.append(tuple(t.shape)), t)[1], lambda t: t):
        compiled(x)
    torch._dynamo.reset()
    assert shapes.count((512, 256)) == (2 if keep_act else 1)
