"""Weight gradients on a second CUDA stream in the graphed step's backward.

A Linear's backward is two GEMMs: the input gradient ``dX = dY @ W``, which the layer before waits
for, and the weight gradient ``dW = dY^T @ X``, which nothing in the backward reads. Inductor
launches both on one stream, so every weight gradient sits on the backward's critical path.
``split_weight_grads`` (a post-grad pass of the graphed step) moves each weight-gradient ``mm`` to
a side stream:

- ``side_mm(a, b, slot)``: the product ``a @ b``, allocated on the main stream, computed on the side
  stream once everything queued on the main one so far (its inputs) is done; an event marks its end.
- ``side_join(out, a, b, after, slot)``: the main stream waits for that event. It is placed
  ``LAG`` weight gradients later (its ``after`` argument is a later weight gradient's input, so
  Inductor cannot schedule it earlier), and it takes ``a`` and ``b`` so that Inductor keeps their
  memory until the side stream has read them. It declares ``out`` mutated, so nothing reads the
  gradient before the join.

The numbers are the same ``mm`` on the same operands: only the stream differs. On the CPU both ops
are a plain ``mm`` and a no-op. A CUDA graph captures the fork and join as graph edges.

Off by default until timed on the step (``scripts/profile_step.py``'s ``+side_dw``);
``scripts/bench_dw_overlap.py`` bounds what it can gain on a chain of block backwards.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

side_stream = False
"""The graphed step's post-grad pass moves weight gradients to a side stream (``split_weight_grads``)."""

LAG = 4
"""A weight gradient's join waits this many weight gradients later (a Hiera block has four Linears)."""

_streams: Dict[int, "torch.cuda.Stream"] = {}  # device index -> side stream
_events: Dict[int, "torch.cuda.Event"] = {}  # slot -> the end of that slot's last side_mm


def _side(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


@torch.library.custom_op("hiera_autopatch::side_mm", mutates_args=())
def side_mm(a: torch.Tensor, b: torch.Tensor, slot: int) -> torch.Tensor:
    """``a @ b`` ((M, K) @ (K, N) -> (M, N)); on CUDA computed on the side stream (see the module)."""
    if not a.is_cuda:
        return torch.mm(a, b)
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)  # main stream's memory
    main, side = torch.cuda.current_stream(a.device), _side(a.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.mm(a, b, out=out)
    done = torch.cuda.Event()
    done.record(side)
    _events[slot] = done
    return out


@side_mm.register_fake
def _side_mm_shape(a, b, slot):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("hiera_autopatch::side_join", mutates_args=("out",))
def side_join(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, after: torch.Tensor, slot: int) -> None:
    """The main stream waits for ``side_mm``'s ``slot`` (all of the side stream if it has no event)."""
    if not out.is_cuda:
        return
    main = torch.cuda.current_stream(out.device)
    done = _events.pop(slot, None)
    if done is None:
        main.wait_stream(_side(out.device))
    else:
        main.wait_event(done)


def _is_weight_grad(node: torch.fx.Node, output: torch.fx.Node) -> bool:
    """``mm(permute(dY, [1, 0]), X)`` whose only reader is the graph's output: a Linear's dW."""
    aten = torch.ops.aten
    if node.target is not aten.mm.default or not all(user is output for user in node.users):
        return False
    first = node.args[0]
    return (isinstance(first, torch.fx.Node) and first.target is aten.permute.default
            and list(first.args[1]) == [1, 0])


def _last_computation(output: torch.fx.Node, skip) -> Optional[torch.fx.Node]:
    """The graph's last op before ``output`` that computes a tensor, other than ``skip``; None if none."""
    node = output.prev
    while node.op != "root":
        if node.op == "call_function" and node not in skip and isinstance(node.meta.get("val"), torch.Tensor):
            return node
        node = node.prev
    return None


def split_weight_grads(graph: torch.fx.Graph) -> int:
    """Post-grad pass: each weight-gradient ``mm`` becomes ``side_mm`` plus a ``side_join`` after the
    ``LAG``-th next one's inputs (the last ones: after the last node before the output). Returns how
    many. Slots number the weight gradients of this graph."""
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    grads = [node for node in graph.nodes if _is_weight_grad(node, output)]
    if not grads:
        return 0
    forks: List[torch.fx.Node] = []
    for slot, node in enumerate(grads):
        with graph.inserting_before(node):
            fork = graph.call_function(torch.ops.hiera_autopatch.side_mm.default, (*node.args, slot))
        fork.meta = dict(node.meta)
        node.replace_all_uses_with(fork)
        graph.erase_node(node)
        forks.append(fork)
    last = _last_computation(output, set(forks))  # what the final joins come after
    for slot, fork in enumerate(forks):
        later: Optional[torch.fx.Node] = forks[slot + LAG] if slot + LAG < len(forks) else None
        after = later.args[0] if later is not None else (last or fork.args[0])
        anchor = later if later is not None else output
        with graph.inserting_before(anchor):
            join = graph.call_function(torch.ops.hiera_autopatch.side_join.default,
                                       (fork, fork.args[0], fork.args[1], after, slot))
        join.meta = {"val": None}
    graph.lint()
    return len(forks)

