"""HIERA_OPTIM_GRAPHS's whole-step path (ops/step_graph.py) on the CPU.

On the CPU there is no CUDA graph: ``StepGraph`` runs its would-be captured bodies (the compiled
forward, and ``autograd.grad`` of the loss) where the graphs would be replayed, and aot_eager stands
in for Inductor. That exercises everything around the capture: the autograd Function that hands out
the captured gradients, the loss scale, accumulation into ``.grad``, the input gradient, and every
case that must recompute instead, with the backward as its own graph (the default) and inside the
forward's (``backward_graph = False``). Each test compares against unpatched FAIR on the same
inputs and RNG state.
"""

import copy

import pytest
import torch

import hiera_autopatch
from equivalence import assert_equivalent, fair_model, input_for, low_precision_check, run_step

hiera = pytest.importorskip("hiera")

FP32_OUT, FP32_GRAD = 1e-5, 1e-4
USER_COMPILE = torch.compile  # the real one: the fixture puts an aot_eager stand-in for Inductor in its place
FP16_EPS = 0.01  # as tests/test_equivalence_fair.py's LOW_EPS (see equivalence.assert_bounded)


@pytest.fixture(params=[True, False], ids=["backward_graph", "one_graph"])
def graphs(monkeypatch, request):
    """Patching on, the graphed step taken on the CPU, with empty caches; yields step_graph."""
    from hiera_autopatch.ops import step_graph

    monkeypatch.setattr(step_graph, "_graph_device", lambda x: True)
    monkeypatch.setattr(step_graph, "backward_graph", request.param)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: USER_COMPILE(fn, fullgraph=True, backend="aot_eager"))
    step_graph.reset()
    torch._dynamo.reset()
    hiera_autopatch.enable(graphs=True)  # as HIERA_OPTIM_GRAPHS=1
    yield step_graph
    hiera_autopatch.disable()
    torch._dynamo.reset()


def model_and_input(batch=2):
    torch.manual_seed(0)
    model = fair_model("mae", "tiny", stages=(1, 1, 1, 1))
    return model, input_for(model, batch=batch)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match_fair(training_step, tol=FP32_GRAD):
    """``training_step()`` (returns the weight grads) graphed, then unpatched: same grads."""
    result = training_step()
    with hiera_autopatch.disabled():
        reference = training_step()
    assert reference.keys() == result.keys() and reference
    for name, ref in reference.items():
        err = ((result[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("mask_in_graph", [True, False], ids=["mask_in_graph", "eager_mask"])
def test_whole_step_matches_fair_and_uses_the_captured_grads(graphs, monkeypatch, mask_in_graph):
    monkeypatch.setattr(graphs, "mask_in_graph", mask_in_graph)
    model, x = model_and_input()
    graphed = [run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=s) for s in (1, 2)]
    with hiera_autopatch.disabled():
        fair = [run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=s) for s in (1, 2)]
    for reference, result in zip(fair, graphed):
        assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)  # outputs, input grad, every weight grad
    status = graphs.status()
    assert hiera_autopatch.status()["graph_steps"] == status
    assert status["captured_graphs"] == 1 and status["replays"] == (4 if graphs.backward_graph else 2)
    assert status["recomputed_backwards"] == 0 and status["failed"] == []
    (graph,) = graphs._graphs[model].values()
    assert (graph.draw is not None) == mask_in_graph


def test_scaled_loss_and_accumulation_over_micro_batches(graphs):
    """(loss * s).backward() twice without zero_grad: what gradient accumulation with a scaler does."""
    model, x = model_and_input()

    def two_micro_batches():
        model.zero_grad(set_to_none=True)
        for seed, scale in ((1, 4.0), (2, 0.3)):
            torch.manual_seed(seed)
            (model(x, mask_ratio=0.6)[0] * scale).backward()
        return grads_of(model)

    assert_grads_match_fair(two_micro_batches)
    assert graphs.status()["recomputed_backwards"] == 0


def test_backward_hands_out_the_replays_gradients_exactly(graphs):
    """Backward gives each weight the replay's gradient, added to what .grad held: exactly, against
    the same replay's buffers. A backward graph computed it from the incoming gradient; one graph
    computed it from 1.0, and backward scales it by the incoming gradient."""
    model, x = model_and_input()
    params = list(model.parameters())
    scale = 1.0 if graphs.backward_graph else 0.75

    def captured():
        (graph,) = graphs._graphs[model].values()
        return graph.grads

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    (model(x, mask_ratio=0.6)[0] * 0.75).backward()
    first = captured()
    scaled = [None if p.grad is None else p.grad.clone() for p in params]
    torch.manual_seed(2)
    model(x, mask_ratio=0.6)[0].backward()
    second = captured()
    assert sum(g is not None for g in first) == len(grads_of(model)) > 10
    for p, g, c1, c2 in zip(params, scaled, first, second):
        assert (g is None) == (c1 is None) == (c2 is None) == (p.grad is None)
        if g is not None:
            assert torch.equal(g, c1 * scale) and torch.equal(p.grad, g + c2)


def test_gradient_through_pred_is_recomputed(graphs):
    """A loss on the returned pred: the captured gradients are the loss's only, so backward recomputes."""
    model, x = model_and_input()

    def loss_on_pred():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss, pred, label, mask = model(x, mask_ratio=0.6)
        (loss + pred.float().square().mean()).backward()
        return grads_of(model)

    assert_grads_match_fair(loss_on_pred)
    assert graphs.status()["recomputed_backwards"] == 1


def test_recomputed_backward_runs_under_the_forwards_autocast(graphs):
    """The forward ran under bf16 autocast, the backward (as usual) outside it: the recompute must
    run the step under the forward's autocast, so its gradients are those of the same step run
    eagerly (patched, no graphs), not of an fp32 one (off by ~14% on this model's bf16 step)."""
    model, x = model_and_input()

    def loss_on_pred():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, pred, label, mask = model(x, mask_ratio=0.6)
        (loss + pred.float().square().mean()).backward()
        return grads_of(model)

    recomputed = loss_on_pred()
    assert graphs.status()["recomputed_backwards"] == 1
    graphs.enabled = False
    try:
        eager = loss_on_pred()
    finally:
        graphs.enabled = True
    assert eager.keys() == recomputed.keys() and eager
    for name, ref in eager.items():
        err = ((recomputed[name].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
        assert err <= FP32_GRAD, f"{name}: relative error {err:.3g}"


def test_backward_after_another_replay_is_recomputed(graphs):
    """Two forwards, then one backward of both: the first step's captured buffers are overwritten."""
    model, x = model_and_input()
    x2 = input_for(model, seed=5)

    def two_forwards_one_backward():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        first = model(x, mask_ratio=0.6)[0]
        second = model(x2, mask_ratio=0.6)[0]
        (first + 2 * second).backward()
        return grads_of(model)

    assert_grads_match_fair(two_forwards_one_backward)
    assert graphs.status()["recomputed_backwards"] == 1  # the first; the second's buffers are current


def test_no_grad_and_frozen_weights_capture_their_own_graphs(graphs):
    model, x = model_and_input()
    torch.manual_seed(5)
    with torch.no_grad():
        graphed = model(x, mask_ratio=0.6)
    assert not graphed[0].requires_grad
    torch.manual_seed(5)
    with torch.no_grad(), hiera_autopatch.disabled():
        fair = model(x, mask_ratio=0.6)
    for a, b in zip(fair, graphed):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)

    frozen = [p for name, p in model.named_parameters() if name.startswith("blocks.0.")]
    for p in frozen:
        p.requires_grad_(False)
    result = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=6)
    with hiera_autopatch.disabled():
        reference = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=6)
    assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    assert not any(name.startswith("blocks.0.") for name in result.param_grads)
    assert graphs.status()["captured_graphs"] == 2  # no-grad, frozen


def test_moved_weights_capture_again(graphs):
    """A graph reads weights at fixed addresses: new weight tensors (.to(), a new Parameter set as an
    attribute or put straight into ``_parameters``) mean a new capture."""
    model, x = model_and_input()
    run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    twin = copy.deepcopy(model)
    model.load_state_dict(twin.state_dict())  # in place: same addresses, no new capture
    run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    assert graphs.status()["captured_graphs"] == 1
    model.double().float()  # new tensors
    result = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    with hiera_autopatch.disabled():
        reference = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    assert graphs.status()["captured_graphs"] == 2
    fc1 = model.blocks[0].mlp.fc1
    fc1.weight = torch.nn.Parameter(fc1.weight.detach() * 1.5)  # a new Parameter object, registered
    result = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    with hiera_autopatch.disabled():
        reference = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    assert graphs.status()["captured_graphs"] == 3
    fc1._parameters["bias"] = torch.nn.Parameter(fc1.bias.detach() + 0.5)  # no registration hook runs
    result = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    with hiera_autopatch.disabled():
        reference = run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    assert graphs.status()["captured_graphs"] == 4


def test_fp16_steps_keep_a_backward_graph_of_their_own(graphs):
    """fp16 gradients need the loss scale from the start of backward: even with
    ``backward_graph = False`` their backward is a graph of its own, replayed from the incoming
    gradient. Bounded against fp32 as tightly as unpatched fp16 autocast."""
    model, x = model_and_input()
    low_precision_check(model, x, lambda m, x: m(x, mask_ratio=0.6), autocast_dtype=torch.float16,
                        eps=FP16_EPS, model_bound=False)
    status = graphs.status()  # (the graphed copy is gone by now, its graphs with it)
    assert status["replays"] == 2 and status["recomputed_backwards"] == 0  # a forward and a backward graph

    params = list(model.parameters())
    assert not graphs._needs_loss_scale(x, params)
    assert graphs._needs_loss_scale(x.half(), params)
    assert graphs._needs_loss_scale(x, list(copy.deepcopy(model).half().parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not graphs._needs_loss_scale(x, params)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_break", "fullgraph"])
def test_the_users_torch_compile_keeps_the_graphed_step(graphs, fullgraph):
    """Under the user's torch.compile the graphed step is a graph break, replayed when their
    compiled code runs; with fullgraph=True (where a break is an error) it is traced into their
    graph instead. Either way: FAIR's outputs and gradients."""
    model, x = model_and_input()
    users = USER_COMPILE(model, backend="aot_eager", fullgraph=fullgraph)
    results = [run_step(users, x, lambda m, x: m(x, mask_ratio=0.6), seed=s) for s in (1, 2)]
    for result in results:  # the compiled wrapper names the weights "_orig_mod.<name>"
        names = list(result.param_grads)
        result.param_grads.update({name.removeprefix("_orig_mod."): result.param_grads.pop(name) for name in names})
    with hiera_autopatch.disabled():
        fair = [run_step(model, x, lambda m, x: m(x, mask_ratio=0.6), seed=s) for s in (1, 2)]
    for reference, result in zip(fair, results):
        assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    status = graphs.status()
    assert status["failed"] == [] and status["recomputed_backwards"] == 0
    replays = 4 if graphs.backward_graph else 2  # forward and backward per step, or one graph
    assert status["replays"] == (0 if fullgraph else replays) and status["captured_graphs"] == (0 if fullgraph else 1)


def test_a_dropped_model_is_freed_with_its_graphs(graphs):
    """Graphs are kept per model, weakly: dropping the model frees it and its graphs (and their
    memory pool). A backward still pending when the model is dropped completes, recompute included."""
    import gc
    import weakref

    model, x = model_and_input()
    loss, pred, label, mask = model(x, mask_ratio=0.6)
    alive = weakref.ref(model)
    weights = [p for p in model.parameters()]
    del model
    gc.collect()
    assert alive() is not None  # the pending step holds it
    (loss + pred.float().square().mean()).backward()  # a loss on pred: recomputed
    assert graphs.status()["recomputed_backwards"] == 1 and all(p.grad is not None for p in weights)
    del loss, pred, label, mask
    gc.collect()
    assert alive() is None
    assert graphs.status()["captured_graphs"] == 0 and len(graphs._pools) == 0


def test_the_forward_graph_draws_fairs_mask_itself(graphs, monkeypatch):
    """``mask_in_graph`` (the default): the forward graph draws FAIR's mask with FAIR's own code. Seeded steps see
    FAIR's masks, outputs, input grad and every weight grad, and leave the RNG where FAIR's leave it;
    a mask ratio is part of the graph's signature. A mask the caller passes, or a subclass's own
    ``get_random_mask``, is not drawn by the graph."""
    monkeypatch.setattr(graphs, "mask_in_graph", True)
    model, x = model_and_input()

    def steps(net, ratio):
        results, next_draws = [], []
        for seed in (1, 2):
            results.append(run_step(net, x, lambda m, x: m(x, mask_ratio=ratio), seed=seed))
            next_draws.append(torch.rand(4))  # what the RNG hands out after the step
        return results, next_draws

    for captures, ratio in ((1, 0.6), (2, 0.75)):
        graphed, graphed_draws = steps(model, ratio)
        with hiera_autopatch.disabled():
            fair, fair_draws = steps(model, ratio)
        for reference, result in zip(fair, graphed):
            assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)  # the masks: exactly equal
        assert all(torch.equal(a, b) for a, b in zip(fair_draws, graphed_draws))
        graphs_of_model = list(graphs._graphs[model].values())
        assert len(graphs_of_model) == captures and all(g.draw is not None for g in graphs_of_model)
    assert graphs.status()["recomputed_backwards"] == 0 and graphs.status()["failed"] == []

    given = input_for(model, seed=3)
    torch.manual_seed(8)
    mask = model.get_random_mask(given, 0.6)
    result = run_step(model, given, lambda m, x: m(x, mask_ratio=0.6, mask=mask))
    with hiera_autopatch.disabled():
        reference = run_step(model, given, lambda m, x: m(x, mask_ratio=0.6, mask=mask))
    assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    assert [g.draw is None for g in graphs._graphs[model].values()] == [False, False, True]

    class OwnMask(type(model)):
        def get_random_mask(self, x, mask_ratio):
            return super().get_random_mask(x, mask_ratio).flip(1)

    own = copy.deepcopy(model)
    own.__class__ = OwnMask
    result = run_step(own, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    with hiera_autopatch.disabled():
        reference = run_step(own, x, lambda m, x: m(x, mask_ratio=0.6), seed=1)
    assert_equivalent(reference, result, FP32_OUT, FP32_GRAD)
    (graph,) = graphs._graphs[own].values()
    assert graph.draw is None
