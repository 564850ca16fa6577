"""ops/weight_grads.py: the post-grad pass that moves weight-gradient GEMMs to a side stream.

On the CPU the ops are a plain ``mm`` and a no-op, so these check the graph surgery and that the
compiled step still gives FAIR's numbers; the stream overlap itself is timed on the GPU
(scripts/bench_dw_overlap.py, scripts/profile_step.py's +side_dw) and checked there by
tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hiera_autopatch.ops import graph_passes, weight_grads


def _backward_graphs(fn, x, passes):
    """Compile ``fn`` with ``passes`` as the post-grad pass; run forward and backward; return the
    post-grad graphs the passes saw (after them) and x's gradient."""
    seen = []

    def keep(graph):
        seen.append(graph)

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True,
                             options={"post_grad_custom_post_pass": graph_passes.custom_pass([*passes, keep], [])})
    x = x.clone().requires_grad_()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        compiled(x).sum().backward()  # compiled afresh: a cached graph would skip the passes
    return seen, x.grad


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Linear(8, 8), nn.Linear(8, 24))


def test_pass_moves_every_weight_grad_and_joins_each_after_a_later_ones_input():
    model = _mlp()
    x = torch.randn(4, 5, 8)
    graphs, _ = _backward_graphs(model, x, [weight_grads.split_weight_grads])
    backward = graphs[-1]
    ops = torch.ops.hiera_autopatch
    forks = [n for n in backward.nodes if n.target is ops.side_mm.default]
    joins = [n for n in backward.nodes if n.target is ops.side_join.default]
    assert len(forks) == len(joins) == 4  # the four Linears' weight gradients
    assert not [n for n in backward.nodes if n.target is torch.ops.aten.mm.default
                and weight_grads._is_weight_grad(n, backward.output_node() if hasattr(backward, "output_node")
                                                 else next(m for m in backward.nodes if m.op == "output"))]
    order = {node: i for i, node in enumerate(backward.nodes)}
    for join in joins:
        fork, a, b, after, slot = join.args
        assert fork is forks[slot] and (a, b) == tuple(fork.args[:2])
        assert order[join] > order[fork] and order[join] > order[after]
        if slot + weight_grads.LAG < len(forks):
            assert after is forks[slot + weight_grads.LAG].args[0]
    forward = graphs[0]
    assert not [n for n in forward.nodes if n.target is ops.side_mm.default]


def test_lag_places_joins_later(monkeypatch):
    monkeypatch.setattr(weight_grads, "LAG", 1)
    graphs, _ = _backward_graphs(_mlp(), torch.randn(4, 5, 8), [weight_grads.split_weight_grads])
    joins = [n for n in graphs[-1].nodes if n.target is torch.ops.hiera_autopatch.side_join.default]
    forks = [n for n in graphs[-1].nodes if n.target is torch.ops.hiera_autopatch.side_mm.default]
    for join in joins[:-1]:
        assert join.args[3] is forks[join.args[4] + 1].args[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_gradients_equal_without_the_pass(dtype):
    """The same mm on the same operands: every weight gradient and the input gradient are equal
    bit for bit to the compiled step without the pass."""
    model = _mlp().to(dtype)
    x = torch.randn(4, 5, 8, dtype=dtype)
    results = []
    for passes in ([], [weight_grads.split_weight_grads]):
        for p in model.parameters():
            p.grad = None
        _, x_grad = _backward_graphs(model, x, passes)
        results.append([x_grad] + [p.grad.clone() for p in model.parameters()])
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cpu_mae_with_side_stream_weight_grads_matches_fair(monkeypatch):
    """The graphed step's passes with the side stream on, FAIR's tiny MAE under Inductor: the pass
    moves every block Linear's weight gradient, and outputs and every gradient match FAIR's eager
    run."""
    pytest.importorskip("hiera")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from equivalence import assert_equivalent, fair_vs_compiled_tiny_mae
    from hiera_autopatch.ops import step_graph

    moved = []
    split = weight_grads.split_weight_grads
    monkeypatch.setattr(weight_grads, "split_weight_grads", lambda graph: moved.append(split(graph)))
    monkeypatch.setattr(weight_grads, "side_stream", True)
    options = step_graph.default_options()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        model, fair, compiled = fair_vs_compiled_tiny_mae(options)
    assert_equivalent(fair, compiled, 1e-5, 1e-4)
    blocks = sum(1 for m in model.modules() if type(m).__name__ == "HieraBlock")
    assert moved[0] == 0 and moved[-1] >= 4 * blocks  # forward: none; backward: qkv, proj, fc1, fc2 of each block


def test_custom_ops_on_cpu_are_mm_and_a_no_op():
    a, b = torch.randn(6, 4), torch.randn(4, 3)
    out = torch.ops.hiera_autopatch.side_mm(a, b, 0)
    torch.testing.assert_close(out, a @ b, rtol=0, atol=0)
    kept = out.clone()
    torch.ops.hiera_autopatch.side_join(out, a, b, a, 0)
    assert torch.equal(out, kept)
