"""On the GPU: bf16 equivalence at real Hiera-B shapes, fused SDPA backends only, graphs mode.

Skipped without CUDA. Run on the H200 with ``python -m pytest -q tests/test_gpu.py``.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import hiera_autopatch
from hiera_autopatch.ops import attention, step_graph
from equivalence import assert_equivalent, low_precision_check, run_pair, run_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
hiera = pytest.importorskip("hiera")

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
except ImportError:  # torch < 2.3
    sdpa_kernel = None


@pytest.fixture(autouse=True)
def patched():
    hiera_autopatch.enable()
    yield
    hiera_autopatch.disable()
    step_graph.enabled = False


def images(batch, res=224, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, 3, res, res, device="cuda", generator=generator)


def mae_call(model, x):
    return model(x, mask_ratio=0.6)


@pytest.mark.parametrize("factory", ["mae_hiera_base_224", "mae_hiera_large_224"])
def test_mae_bf16_bounded_against_fp32(factory):
    torch.manual_seed(0)
    model = getattr(hiera, factory)().cuda()
    low_precision_check(model, images(16), mae_call, dtype=torch.bfloat16, eps=0.05)


def test_mae_autocast_bounded_against_fp32():
    torch.manual_seed(0)
    model = hiera.mae_hiera_base_224().cuda()
    low_precision_check(model, images(16), mae_call, autocast_dtype=torch.bfloat16, eps=0.05)


@pytest.mark.parametrize("factory", ["hiera_base_224", "hiera_base_plus_224"])
def test_classification_bf16_bounded_against_fp32(factory):
    torch.manual_seed(0)
    model = getattr(hiera, factory)().cuda()
    low_precision_check(model, images(16), lambda m, x: m(x), dtype=torch.bfloat16, eps=0.05)


def test_video_mae_bf16_bounded_against_fp32():
    torch.manual_seed(0)
    model = hiera.mae_hiera_base_16x224().cuda()
    generator = torch.Generator(device="cuda").manual_seed(0)
    clips = torch.randn(2, 3, 16, 224, 224, device="cuda", generator=generator)
    low_precision_check(model, clips, mae_call, dtype=torch.bfloat16, eps=0.05)


def test_fp32_matches_on_gpu():
    torch.manual_seed(0)
    model = hiera.mae_hiera_base_224().cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    unpatched, patched = run_pair(model, images(8), mae_call)
    assert_equivalent(unpatched, patched, 1e-5, 1e-4)


@pytest.mark.skipif(sdpa_kernel is None, reason="torch.nn.attention.sdpa_kernel missing")
@pytest.mark.parametrize("factory", ["mae_hiera_base_224", "hiera_base_224"])
def test_every_patched_attention_runs_a_fused_backend(factory):
    """With the math backend forbidden, the patched model runs; FAIR's 5-D calls cannot."""
    model = getattr(hiera, factory)().cuda().to(torch.bfloat16)
    x = images(32).to(torch.bfloat16)
    with sdpa_kernel(FUSED):
        out = model(x)
        (out[0] if isinstance(out, tuple) else out.float().sum()).backward()
        with hiera_autopatch.disabled(), pytest.raises(RuntimeError):
            model(x)


@pytest.mark.skipif(sdpa_kernel is None, reason="torch.nn.attention.sdpa_kernel missing")
def test_timm_windowed_attention_runs_a_fused_backend():
    timm = pytest.importorskip("timm")
    model = timm.create_model("hiera_base_224", pretrained=False).cuda().to(torch.bfloat16)
    x = images(16).to(torch.bfloat16)
    with sdpa_kernel(FUSED):
        model(x).float().sum().backward()
        with hiera_autopatch.disabled(), pytest.raises(RuntimeError):
            model(x)


@pytest.mark.skipif(sdpa_kernel is None, reason="torch.nn.attention.sdpa_kernel missing")
def test_batch_past_fused_limit_is_split_and_stays_fused():
    """70,000 windows in one call: past the 65,535 batch limit of flash / mem-efficient."""
    torch.manual_seed(0)
    batch, windows, tokens, heads, head_dim = 1000, 70, 16, 1, 32
    qkv = torch.randn(batch, tokens * windows, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = attention.mask_unit_attention(qkv, windows, heads, 4, pool="max")
    q, k, v = qkv.float().view(batch, tokens, windows, 3, heads, head_dim).permute(3, 0, 4, 2, 1, 5)
    q = q.reshape(batch, heads, windows, 4, tokens // 4, head_dim).max(dim=3).values
    ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 3).reshape(batch, -1, heads * head_dim)
    assert (out.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("mask_in_graph", [False, True], ids=["mask_drawn_eagerly", "mask_in_graph"])
def test_graphs_mode_matches_eager_patched(monkeypatch, mask_in_graph):
    """HIERA_OPTIM_GRAPHS: same masks, losses and grads as eager within bf16 noise, over steps, and
    the RNG left where eager steps leave it; with the mask drawn eagerly or by the forward graph
    (its capture's warm-ups draw masks too, and must not shift the first step's)."""
    monkeypatch.setattr(step_graph, "mask_in_graph", mask_in_graph)
    torch.manual_seed(0)
    model = hiera.mae_hiera_base_224().cuda().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    x = images(32).to(torch.bfloat16)

    def steps(net):
        results, next_draws = [], []
        for seed in range(3):
            results.append(run_step(net, x, mae_call, seed=seed))
            next_draws.append(torch.rand(4, device="cuda"))
        return results, next_draws

    eager, eager_draws = steps(model)
    step_graph.reset()
    step_graph.enabled = True
    graphed, graphed_draws = steps(twin)
    assert step_graph.status()["compiled_steps"] == 1 and not step_graph.status()["failed"]
    (graph,) = step_graph._graphs[twin].values()
    assert (graph.draw is not None) == mask_in_graph and graph.forward_graph is not None
    assert all(torch.equal(a, b) for a, b in zip(eager_draws, graphed_draws))
    for e, g in zip(eager, graphed):
        assert torch.equal(e.outputs[-1], g.outputs[-1])  # the mask
        assert abs(e.outputs[0].item() - g.outputs[0].item()) <= 2e-2 * abs(e.outputs[0].item())
        grads = [(e.param_grads[n].float(), g.param_grads[n].float()) for n in e.param_grads]
        errors = [((a - b).norm() / a.norm().clamp_min(1e-12)).item() for a, b in grads]
        assert sorted(errors)[len(errors) // 2] < 2e-2, max(errors)



@pytest.mark.parametrize("backward_graph", [True, False], ids=["backward_graph", "one_graph"])
def test_graphed_step_hands_out_its_gradients_exactly_and_recomputes(monkeypatch, backward_graph):
    """HIERA_OPTIM_GRAPHS replays the step as CUDA graphs. Backward gives each weight the replay's
    gradient, added to what ``.grad`` held (a second micro-batch: exactly). With a backward graph
    (the default) that gradient is computed from the incoming one (4); with one graph it was
    computed from 1 and backward scales it (exactly: 4 is a power of two). A loss on the returned
    pred is not in the captured backward, so it is recomputed, bf16-close to eager. Exactness is
    checked against the same replay's buffers: the position-embedding gradient is summed with
    atomics, so two replays of one input may differ in a last bit."""
    monkeypatch.setattr(step_graph, "backward_graph", backward_graph)
    step_graph.reset()
    torch.manual_seed(0)
    model = hiera.mae_hiera_base_224().cuda().to(torch.bfloat16)
    x, x2 = images(8).to(torch.bfloat16), images(8, seed=1).to(torch.bfloat16)
    params = list(model.parameters())
    on_pred = lambda out: out[0] + out[1].float().square().mean()
    scale = 1 if backward_graph else 4

    def backward(seed, inputs, make_loss):
        torch.manual_seed(seed)
        make_loss(model(inputs, mask_ratio=0.6)).backward()
        return [None if p.grad is None else p.grad.clone() for p in params]

    model.zero_grad(set_to_none=True)
    eager_pred = backward(3, x, on_pred)
    step_graph.enabled = True

    def captured():  # the latest replay's gradients, one per weight (all require grad here)
        (graph,) = step_graph._graphs[model].values()
        assert graph.split == backward_graph
        return [None if g is None else g.clone() for g in graph.grads]  # the next replay overwrites them

    model.zero_grad(set_to_none=True)
    scaled = backward(1, x, lambda out: out[0] * 4)
    first = captured()
    summed = backward(2, x2, lambda out: out[0])
    second = captured()
    assert step_graph.status()["captured_graphs"] == 1 and step_graph.status()["recomputed_backwards"] == 0
    assert sum(g is not None for g in first) > 100
    for g4, c1, g12, c2 in zip(scaled, first, summed, second):
        assert (g4 is None) == (c1 is None) == (g12 is None) == (c2 is None)
        if c1 is not None:
            assert torch.equal(g4, c1 * scale) and torch.equal(g12, g4 + c2)
    model.zero_grad(set_to_none=True)
    graphed_pred = backward(3, x, on_pred)
    assert step_graph.status()["recomputed_backwards"] == 1
    errors = [((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-12)).item()
              for a, b in zip(eager_pred, graphed_pred) if a is not None]
    assert len(errors) == sum(g is not None for g in graphed_pred) and sorted(errors)[len(errors) // 2] < 2e-2


def test_graphed_fp16_autocast_step_with_a_loss_scale_matches_eager():
    """fp16 autocast, loss times 1024 (a GradScaler's scale): the backward graph starts from it, as
    eager's backward does; same masks, loss and gradients within fp16 noise over steps."""
    step_graph.reset()
    torch.manual_seed(0)
    model = hiera.mae_hiera_tiny_224().cuda()
    twin = copy.deepcopy(model)
    x = images(32)

    def scaled_step(m, seed):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=torch.float16):
            loss, pred, label, mask = m(x, mask_ratio=0.6)
        (loss * 1024).backward()
        return loss.item(), mask, {n: p.grad / 1024 for n, p in m.named_parameters() if p.grad is not None}

    eager = [scaled_step(model, s) for s in range(2)]
    step_graph.enabled = True
    graphed = [scaled_step(twin, s) for s in range(2)]
    (graph,) = step_graph._graphs[twin].values()
    assert graph.split and graph.backward_graph is not None and step_graph.status()["recomputed_backwards"] == 0
    for (e_loss, e_mask, e_grads), (g_loss, g_mask, g_grads) in zip(eager, graphed):
        assert torch.equal(e_mask, g_mask)
        assert abs(e_loss - g_loss) <= 1e-2 * abs(e_loss)
        assert e_grads.keys() == g_grads.keys()
        errors = [((e_grads[n] - g_grads[n]).norm() / e_grads[n].norm().clamp_min(1e-12)).item() for n in e_grads]
        assert sorted(errors)[len(errors) // 2] < 1e-2, max(errors)


def test_failed_capture_runs_eagerly_and_leaves_the_rng_usable():
    """A capture that fails inside ``capture_begin`` (here the way a reused pool handle failed:
    its graphs gone, the allocator asserts) leaves CUDA's generator marked as capturing, so the next
    eager ``torch.rand`` would raise, and the capture's side stream current. We clear the mark,
    restore the stream, warn, and run the step eagerly: same loss and gradients as eager, and the
    next mask draws."""
    step_graph.reset()
    torch.manual_seed(0)
    model = hiera.mae_hiera_tiny_224().cuda()
    x = images(4)
    eager = run_step(model, x, mae_call, seed=1)
    retired = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=retired):
        kept = torch.ones(4, device="cuda") * 2  # outlives the graph, as a graph's buffers can
    del graph  # the pool's last graph: its handle is dead, its memory not yet free
    step_graph.enabled = True
    step_graph._pools[model] = retired
    fallback = run_step(model, x, mae_call, seed=1)
    assert step_graph.status()["failed"] and step_graph.status()["captured_graphs"] == 0
    torch.rand(8, device="cuda")  # raised "Offset increment outside graph capture" before the fix
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # not the capture's side stream
    assert_equivalent(eager, fallback, 1e-5, 1e-4)
    del kept


def test_graphed_step_with_pdl_kernels_keeps_the_numbers(monkeypatch):
    """``triton._runtime.PDL``: our kernels with programmatic dependent launch, which changes only
    when they start, not what they compute. Same input and masks over three replays: the loss
    within 1e-3, every gradient within bf16 noise of the graph without PDL and most of them
    bit-equal (gradients summed with atomics may differ in a last bit between any two replays). A
    kernel that read before its wait would hand out data the kernel before it had not written."""
    from hiera_autopatch.ops.triton import _runtime

    torch.manual_seed(0)
    model = hiera.mae_hiera_base_224().cuda().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    x = images(32).to(torch.bfloat16)
    step_graph.enabled = True
    results = {}
    for on, m in ((False, model), (True, twin)):
        monkeypatch.setattr(_runtime, "PDL", on)
        torch._dynamo.reset()
        step_graph.reset()
        results[on] = [run_step(m, x, mae_call, seed=s) for s in range(3)]
        assert step_graph.status()["compiled_steps"] == 1 and not step_graph.status()["failed"]
    for one, two in zip(results[False], results[True]):
        assert torch.equal(one.outputs[-1], two.outputs[-1])  # the mask
        assert abs(one.outputs[0].item() - two.outputs[0].item()) <= 1e-3 * abs(one.outputs[0].item())
        errors = {n: ((one.param_grads[n].float() - two.param_grads[n].float()).norm()
                      / one.param_grads[n].float().norm().clamp_min(1e-12)).item() for n in one.param_grads}
        assert max(errors.values()) < 1e-2, max(errors.items(), key=lambda kv: kv[1])
        assert sum(e == 0 for e in errors.values()) >= 0.9 * len(errors), sorted(errors.items(), key=lambda kv: -kv[1])[:5]
