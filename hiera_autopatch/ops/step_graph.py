"""Zero-edit CUDA graphs: the static MAE step, forward and backward, replayed as one CUDA graph.

Off unless ``HIERA_OPTIM_GRAPHS=1``. The random mask is drawn eagerly before the graph (the same RNG
use as FAIR's), so seeded runs see the same masks with and without graphs.

How a training step runs (``whole_step``, the default):

1. The step after the mask (encoder, decoder, loss) is compiled by Inductor, without CUDA graphs of
   its own. For each model and input signature, its forward *and* ``torch.autograd.grad`` of the
   loss with respect to every parameter that requires grad (and the input, if it does) are captured
   together in one ``torch.cuda.CUDAGraph``, after two warm-up runs on a side stream.
2. A call copies the input and mask into the graph's static buffers and replays it: the whole step
   is one launch. Returned tensors are cloned out of the graph's memory, so keeping them is safe.
3. The user's ``loss.backward()`` reaches ``WholeStep.backward``, which hands every parameter its
   captured gradient times the loss's incoming gradient. Backward is linear in that gradient: a
   plain ``loss.backward()`` (1.0) or a GradScaler's power-of-two scale gives the same bits as a
   backward run then would; a ``loss / n`` of gradient accumulation, the same to rounding. The
   gradients reach ``.grad`` through autograd's own accumulation, so hooks (DDP's too) still fire.

Where the captured gradients cannot stand in, backward recomputes the step eagerly and runs autograd
on it (correct, slower; ``status()["recomputed_backwards"]`` counts it): a gradient arriving
through a returned tensor other than the loss (e.g. a loss on ``pred``), a double backward, or a
backward after another graphed step was replayed (its buffers are overwritten).

fp16 steps (fp16 parameters, inputs or autocast) run the forward and backward as two graphs through
``torch.compile(mode="reduce-overhead")`` instead: their gradients depend on the loss scale, which
is only known in backward. Without grad (``torch.no_grad``, eval), only the forward is captured.
If compiling or capturing fails, we warn once and run eagerly from then on.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .mlp import autocast_dtype

enabled = False
"""Set by the registry from ``HIERA_OPTIM_GRAPHS``."""

whole_step = True
"""True: forward and backward in one CUDA graph (above). False: two graphs per step through
``torch.compile(mode="reduce-overhead")``, as fp16 steps always run (``scripts/profile_step.py``'s
``+two_graphs`` switch, for A/Bs)."""

capture = True
"""False: run the compiled whole step (forward + autograd.grad) at every call without capturing it,
as on the CPU: its kernels then show which host op launched them (``scripts/profile_step.py``'s
``+no_capture`` switch)."""

compile_options: Dict[str, object] = {}
"""Inductor options of the compiled step, over ``default_options()``. Experiments
(``scripts/profile_step.py`` mode suffixes) add tuning to them, e.g. ``coordinate_descent_tuning``
or ``max_autotune_gemm``; the compile then takes minutes longer."""


def default_options() -> Dict[str, object]:
    """Programmatic dependent launch for Inductor's kernels (each starts while the one before it
    finishes), where this torch has it: H200, Hiera-B MAE, graphed step 34.7 -> 33.2 ms, GPU span
    31.1 -> 29.9 ms in one run (benchmarks/results/h200_profile_pdl.json). Inductor emits it only on
    GPUs that support it."""
    import torch._inductor.config as inductor_config

    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}

WARMUP_RUNS = 2
"""Runs before capture, on a side stream: compile, Triton JIT, cuBLAS handles, Inductor's own tuning."""

MAX_GRAPHS_PER_MODEL = 8
"""Captured signatures (batch sizes, grad modes...) per model; past it, further signatures run
eagerly (one warning), so a shape that changes every step cannot keep capturing."""

_compiled: Dict[Tuple[Callable, bool], Callable] = {}  # (step, reduce-overhead?) -> compiled step
_broken: Dict[Callable, str] = {}
_graphs: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[tuple, StepGraph]]" = weakref.WeakKeyDictionary()
_pool = None  # one memory pool for every captured step (replays never overlap: see _generation)
_generation = 0  # bumped by every replay: a graph's buffers are valid until the next replay
_counts = {"replays": 0, "recomputed_backwards": 0}
_warned: set = set()


def wanted(x: torch.Tensor) -> bool:
    """Graphs for this call: enabled, on CUDA, and not already inside the user's torch.compile."""
    return enabled and x.is_cuda and not torch.compiler.is_compiling()


def _compile(step: Callable, reduce_overhead: bool) -> Callable:
    compiled = _compiled.get((step, reduce_overhead))
    if compiled is None:
        options = {**default_options(), **compile_options, **({"triton.cudagraphs": True} if reduce_overhead else {})}
        compiled = torch.compile(step, options=options, fullgraph=True, dynamic=False)
        _compiled[(step, reduce_overhead)] = compiled
    return compiled


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"hiera_autopatch: {message}", file=sys.stderr)


def _needs_loss_scale(x: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
    """fp16 anywhere in the step: its gradients underflow unless backward starts from the loss scale."""
    half = torch.float16
    return x.dtype == half or autocast_dtype(x.device.type) == half or any(p.dtype == half for p in params[:1])


_registrations = 0  # parameters, buffers and submodules registered on any module, once watched
_watching: Optional[bool] = None
_module_tensors: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _count_registration(*args) -> None:
    global _registrations
    _registrations += 1


def _watch_registrations() -> bool:
    """Count every parameter/buffer/submodule registration (torch's global hooks), so that a
    model's tensor lists can be cached until one happens. False where torch lacks the hooks."""
    global _watching
    if _watching is None:
        nn_module = torch.nn.modules.module
        try:
            for register in (nn_module.register_module_parameter_registration_hook,
                             nn_module.register_module_buffer_registration_hook,
                             nn_module.register_module_module_registration_hook):
                register(_count_registration)
            _watching = True
        except AttributeError:  # torch < 2.1
            _watching = False
    return _watching


def _slots(module: torch.nn.Module, kind: str) -> List[tuple]:
    """(owner's _parameters or _buffers dict, name, tensor) for every parameter or buffer."""
    return [(getattr(owner, kind), name, tensor)
            for owner in module.modules() for name, tensor in getattr(owner, kind).items() if tensor is not None]


def _tensors_of(module: torch.nn.Module) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(parameters, buffers) of the model. Walking Hiera-B's modules takes ~0.7 ms of host time, so
    the lists are kept until a registration happens anywhere (torch's hooks), and checked per call
    against the owners' dicts (~0.05 ms): a tensor put straight into ``_parameters`` counts too."""
    cached = _module_tensors.get(module)
    fresh = (cached is not None and cached[0] == _registrations and _watch_registrations()
             and all(slots.get(name) is tensor for slots, name, tensor in cached[1] + cached[2]))
    if not fresh:
        params, buffers = _slots(module, "_parameters"), _slots(module, "_buffers")
        unique = lambda slots: list({id(slot[2]): slot[2] for slot in slots}.values())  # tied weights once
        cached = (_registrations, params, buffers, unique(params), unique(buffers))
        _module_tensors[module] = cached
    return cached[3], cached[4]


def _signature(module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, n_keep: int, params, buffers) -> tuple:
    """Everything a captured graph depends on: shapes, modes, and where every weight lives."""
    weights = tuple((id(p), p.data_ptr(), p.requires_grad) for p in params)  # backward hands grads to these
    buffers = tuple(b.data_ptr() for b in buffers)
    return (tuple(x.shape), x.dtype, x.device, x.requires_grad, tuple(mask.shape), mask.dtype, n_keep,
            module.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            autocast_dtype(x.device.type), weights, buffers)


def run(step: Callable, module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, n_keep: int):
    """``step(module, x, mask, n_keep)`` (a tuple of tensors, the loss first) through CUDA graphs;
    eager if they cannot be built."""
    if step in _broken:
        return step(module, x, mask, n_keep)
    try:
        params, buffers = _tensors_of(module)
        if not whole_step or _needs_loss_scale(x, params):
            outputs = _compile(step, reduce_overhead=True)(module, x, mask, n_keep)
            return tuple(out.clone() if isinstance(out, torch.Tensor) else out for out in outputs)
        graph = _graph_for(step, module, x, mask, n_keep, params, buffers)
        if graph is None:
            return step(module, x, mask, n_keep)
    except Exception as exc:  # keep the user's run going: eager is slower, never wrong
        _broken[step] = repr(exc)
        _warn_once(f"broken {id(step)}", f"CUDA graphs off for this model ({exc!r}); running eagerly")
        return step(module, x, mask, n_keep)
    if not graph.with_grad:
        graph.replay(x, mask)
        return tuple(out.clone() for out in graph.outputs)
    return WholeStep.apply(graph, x, mask, *graph.weights)


def _graph_for(step, module, x, mask, n_keep, params, buffers) -> Optional["StepGraph"]:
    graphs = _graphs.setdefault(module, {})
    key = _signature(module, x, mask, n_keep, params, buffers)
    graph = graphs.get(key)
    if graph is None:
        if len(graphs) >= MAX_GRAPHS_PER_MODEL:
            _warn_once(f"full {id(module)}", f"{len(graphs)} CUDA graphs captured for this model already "
                       f"(batch size or mode keeps changing); running new signatures eagerly")
            return None
        graph = graphs[key] = StepGraph(step, module, x, mask, n_keep, params)
    return graph


class StepGraph:
    """One captured ``step`` (forward, plus the loss's backward when grad is on) for one signature."""

    def __init__(self, step: Callable, module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor,
                 n_keep: int, params: Sequence[torch.Tensor]):
        self.step, self.module, self.n_keep = step, module, n_keep
        self.weights: List[torch.Tensor] = [p for p in params if p.requires_grad]
        self.input_grad = x.requires_grad and torch.is_grad_enabled()
        self.with_grad = torch.is_grad_enabled() and bool(self.weights or self.input_grad)
        self.static_x = x.detach().clone().requires_grad_(self.input_grad)
        self.static_mask = mask.detach().clone()
        self.compiled = _compile(step, reduce_overhead=False)
        self.graph = self._capture() if x.is_cuda and capture else None  # else: the body runs per call

    def _run_body(self):
        """The captured work: the compiled forward, then autograd.grad of the loss."""
        outputs = self.compiled(self.module, self.static_x, self.static_mask, self.n_keep)
        grads: Sequence[Optional[torch.Tensor]] = ()
        if self.with_grad:
            targets = self.weights + ([self.static_x] if self.input_grad else [])
            grads = torch.autograd.grad(outputs[0], targets, allow_unused=True)
        self.outputs = [out.detach() for out in outputs]
        self.differentiable = [out.requires_grad for out in outputs]
        self.flat_grads, self.grad_slots = _flatten(grads)

    def _capture(self) -> "torch.cuda.CUDAGraph":
        global _pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run_body()
        torch.cuda.current_stream().wait_stream(side)
        if _pool is None:
            _pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_pool):
            self._run_body()
        return graph

    def replay(self, x: torch.Tensor, mask: torch.Tensor) -> None:
        global _generation
        with torch.no_grad():
            self.static_x.copy_(x)
            self.static_mask.copy_(mask)
        if self.graph is None:
            with torch.set_grad_enabled(self.with_grad):  # not captured: the body, run now
                self._run_body()
        else:
            self.graph.replay()
        _generation += 1
        _counts["replays"] += 1

    def scaled_grads(self, d_loss: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """The captured gradients times ``d_loss``: one multiply per dtype into a new flat buffer
        (the next replay overwrites ours), handed out as views of it."""
        scaled = {dtype: flat * d_loss.to(dtype) for dtype, flat in self.flat_grads.items()}
        return [None if slot is None else scaled[slot[0]][slot[1]:slot[1] + slot[2].numel()].view(slot[2])
                for slot in self.grad_slots]

    def recompute_grads(self, x: torch.Tensor, mask: torch.Tensor, grad_outputs) -> List[Optional[torch.Tensor]]:
        """Gradients of the step by eager autograd, for what the captured ones cannot answer."""
        _counts["recomputed_backwards"] += 1
        with torch.enable_grad():
            outputs = self.step(self.module, x, mask, self.n_keep)
            pairs = [(out, g) for out, g in zip(outputs, grad_outputs) if g is not None]
            targets = self.weights + ([x] if self.input_grad else [])
            return list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                            allow_unused=True, create_graph=torch.is_grad_enabled()))


def _flatten(grads: Sequence[Optional[torch.Tensor]]):
    """Gradients -> ({dtype: one flat buffer}, per gradient (dtype, offset, shape) or None).

    Inside the graph this is one copy; it lets backward scale every gradient with one kernel per
    dtype instead of one per weight (~400 launches for Hiera-B MAE)."""
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    slots: List[Optional[tuple]] = []
    offsets: Dict[torch.dtype, int] = {}
    for grad in grads:
        if grad is None:
            slots.append(None)
            continue
        offset = offsets.get(grad.dtype, 0)
        slots.append((grad.dtype, offset, grad.shape))
        offsets[grad.dtype] = offset + grad.numel()
        groups.setdefault(grad.dtype, []).append(grad.reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}, slots


class WholeStep(torch.autograd.Function):
    """Replays a ``StepGraph``; backward hands out its captured gradients (see the module docstring).

    Inputs: the graph, x, the mask, then the weights that get gradients (``graph.weights``)."""

    @staticmethod
    def forward(ctx, graph: StepGraph, x, mask, *weights):
        ctx.set_materialize_grads(False)
        graph.replay(x, mask)
        ctx.graph, ctx.generation, ctx.x, ctx.mask = graph, _generation, x, mask
        outputs = tuple(out.clone() for out in graph.outputs)
        constants = [out for out, differentiable in zip(outputs, graph.differentiable) if not differentiable]
        if constants:
            ctx.mark_non_differentiable(*constants)
        return outputs

    @staticmethod
    def backward(ctx, d_loss, *d_others):
        graph: StepGraph = ctx.graph
        captured_answers = (
            d_loss is not None
            and all(d is None for d in d_others)
            and ctx.generation == _generation
            and not torch.is_grad_enabled()  # create_graph=True needs a differentiable backward
        )
        if captured_answers:
            grads = graph.scaled_grads(d_loss)
        else:
            grads = graph.recompute_grads(ctx.x, ctx.mask, (d_loss, *d_others))
        weight_grads = grads[: len(graph.weights)]
        input_grad = grads[len(graph.weights)] if graph.input_grad else None
        return (None, input_grad, None, *weight_grads)


def reset() -> None:
    """Forget every compiled step and captured graph (their memory is freed once nothing holds them)."""
    _compiled.clear()
    _broken.clear()
    _graphs.clear()
    _counts.update(replays=0, recomputed_backwards=0)


def status() -> dict:
    captured = sum(len(graphs) for graphs in _graphs.values())
    return {"enabled": enabled, "whole_step": whole_step, "compiled_steps": len(_compiled),
            "captured_graphs": captured, **_counts, "failed": list(_broken.values())}
