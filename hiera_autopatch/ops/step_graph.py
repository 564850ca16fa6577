"""Zero-edit CUDA graphs: the static MAE step, forward and backward, replayed as CUDA graphs.

Off unless ``HIERA_OPTIM_GRAPHS=1``. FAIR's random mask is drawn inside the forward graph, by
FAIR's own code, with the same RNG use as FAIR's (``mask_in_graph``), so seeded runs see the same
masks with and without graphs; a mask the caller passes is copied in.

How a training step runs:

1. The step after the mask (encoder, decoder, loss) is compiled by Inductor, without CUDA graphs of
   its own. For each model and input signature, its forward is captured in one
   ``torch.cuda.CUDAGraph`` and ``torch.autograd.grad`` of the loss (with respect to every
   parameter that requires grad, and the input if it does) in a second one, after two warm-up runs
   on a side stream.
2. A call copies the input (and a mask the caller passed) into the forward graph's static buffers
   and replays it: the forward is one launch. Returned tensors are cloned out of the graph's
   memory, so keeping them is safe.
3. The user's ``loss.backward()`` reaches ``WholeStep.backward``, which copies the loss's incoming
   gradient into the backward graph's static buffer and replays it: the gradients are the bits a
   backward of the compiled step would give, for any loss scale (``loss / n``, a GradScaler's).
   They reach ``.grad`` through autograd's own accumulation, so hooks (DDP's too) still fire. Only
   the forward graph's launch is exposed to a step that syncs: the backward graph is launched while
   the GPU still runs the forward.

Where the captured backward cannot stand in, backward recomputes the step eagerly and runs autograd
on it (correct, slower; ``status()["recomputed_backwards"]`` counts it): a gradient arriving
through a returned tensor other than the loss (e.g. a loss on ``pred``), a double backward, or a
backward after another graphed step was replayed (its buffers are overwritten).

``backward_graph = False`` captures the backward into the forward's graph instead (one launch per
step; backward then scales the captured gradients by the incoming one), for A/Bs; fp16 steps never
take it, since their gradients depend on the loss scale from the first op of backward. Without grad
(``torch.no_grad``, eval), only the forward is captured. If compiling or capturing fails, we warn
once and run eagerly from then on.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .mlp import autocast_dtype

enabled = False
"""Set by the registry from ``HIERA_OPTIM_GRAPHS``."""

backward_graph = True
"""True: the loss's backward is a graph of its own, replayed from inside ``loss.backward()``
(above). False: it is captured into the forward's graph, and backward scales its gradients by the
incoming one (``scripts/profile_step.py``'s ``+one_graph`` switch, for A/Bs; fp16 steps keep a
graph of their own)."""

capture = True
"""False: run the compiled step (its forward at the call, autograd.grad at backward) without
capturing it, as on the CPU: its kernels then show which host op launched them
(``scripts/profile_step.py``'s ``+no_capture`` switch)."""

mask_in_graph = True
"""True: where the caller lets us (``MaskDraw``: FAIR's own ``get_random_mask``, no mask given), the
mask is drawn inside the forward graph, by FAIR's code run eagerly (not compiled) during the capture,
so the host launches one graph instead of the mask's ~7 kernels, a copy and the graph. A replay
draws what the eager call would: CUDA's generator hands a graph its current seed and offset at each
replay and advances the offset by what the capture used, as eager calls advance it; the warm-up
runs' draws are undone (the generator's state is restored after the capture). On since session 32:
in the graphed step timed in interleaved rounds on an H100 it was faster in both pairs, by a round
median of 0.48 and 0.46 ms (30 and 36 of 40 rounds; h100_profile_ln_pdl_mask_interleaved_session32.json,
``scripts/profile_step.py``'s ``+mask_in_graph``, which now names the default), and the GPU test of
FAIR's masks and RNG use passed there. False: the mask drawn eagerly before the graph, as before."""

compile_options: Dict[str, object] = {}
"""Inductor options of the compiled step, over ``default_options()``. Experiments
(``scripts/profile_step.py`` mode suffixes) add tuning to them, e.g. ``coordinate_descent_tuning``
or ``max_autotune_gemm``; the compile then takes minutes longer."""


def default_options() -> Dict[str, object]:
    """Inductor options of the graphed step, where this torch has them (H200, Hiera-B MAE):

    - programmatic dependent launch (each kernel starts while the one before it finishes; emitted
      only on GPUs that support it): graphed step 34.7 -> 33.2 ms, GPU span 31.1 -> 29.9 ms in one
      run (benchmarks/results/h200_profile_pdl.json);
    - no mix-order reductions: LayerNorm's input and weight gradients in separate kernels rather
      than one kernel whose per-block partial sums 68 ATen sums then finish (9.6 us each). Step
      32.7 / 32.7 ms with them, 31.5 / 32.5 without, A/B/A/B in one run
      (benchmarks/results/h200_profile_mix_split.json);
    - a post-grad pass (``layer_norm.fold_dx_sums``) that takes the bias gradients summing a block
      LayerNorm's input gradient from our LayerNorm backward kernel, where the user set none.
    """
    import torch._inductor.config as inductor_config

    from . import layer_norm

    options: Dict[str, object] = {}
    if hasattr(inductor_config.triton, "enable_pdl"):
        options["triton.enable_pdl"] = True
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        options["triton.mix_order_reduction"] = False
    if layer_norm.dx_sums and getattr(inductor_config, "post_grad_custom_post_pass", True) is None:
        folding = layer_norm.dx_sums_pass()
        if folding is not None:
            options["post_grad_custom_post_pass"] = folding
    return options

WARMUP_RUNS = 2
"""Runs before capture, on a side stream: compile, Triton JIT, cuBLAS handles, Inductor's own tuning."""

MAX_GRAPHS_PER_MODEL = 8
"""Captured signatures (batch sizes, grad modes...) per model; past it, further signatures run
eagerly (one warning), so a shape that changes every step cannot keep capturing."""

_compiled: Dict[Callable, Callable] = {}  # step -> compiled step
_broken: Dict[Callable, str] = {}
_graphs: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[tuple, StepGraph]]" = weakref.WeakKeyDictionary()
# One memory pool per model, for all its captured steps (their replays never overlap: see
# _generation). A pool handle is never reused once the graphs that held it are gone: capturing into
# it then fails inside torch (an allocator assert), after the CUDA generator was marked as capturing.
_pools: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_generation = 0  # bumped by every replay: a graph's buffers are valid until the next replay
_counts = {"replays": 0, "recomputed_backwards": 0}
_warned: set = set()


class MaskDraw(NamedTuple):
    """A mask the forward graph draws itself: ``draw(module, x)`` -> (B, L) bool, FAIR's
    ``get_random_mask``; ``key``: what else its values depend on (the mask ratio), for the graph's
    signature."""

    draw: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    key: tuple


def wanted(x: torch.Tensor) -> bool:
    """Graphs for this call: enabled and on CUDA. Inside the user's torch.compile too, since ``run``
    is opaque to dynamo (a graph break; the step is replayed when the compiled code runs), unless
    their compile must not break (``fullgraph=True``): then the step is traced into their graph."""
    if not (enabled and _graph_device(x)):
        return False
    return not (torch.compiler.is_compiling() and _compiling_without_breaks())


def _graph_device(x: torch.Tensor) -> bool:
    return x.is_cuda


@torch.compiler.assume_constant_result  # dynamo calls it while tracing and keeps the answer
def _compiling_without_breaks() -> bool:
    """While dynamo traces the user's code: whether a graph break would be an error for them
    (``fullgraph=True``, or ``error_on_graph_break``). Unknown (another torch): assume it would."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(tx.one_graph or getattr(tx, "error_on_graph_break", False))
    except Exception:
        return True


def _compile(step: Callable) -> Callable:
    compiled = _compiled.get(step)
    if compiled is None:
        options = {**default_options(), **compile_options}
        compiled = _compiled[step] = torch.compile(step, options=options, fullgraph=True, dynamic=False)
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


Mask = Union[torch.Tensor, MaskDraw]  # given, or drawn by the forward graph


def _signature(module: torch.nn.Module, x: torch.Tensor, mask: Mask, n_keep: int, params, buffers) -> tuple:
    """Everything a captured graph depends on: shapes, modes, and where every weight lives."""
    weights = tuple((id(p), p.data_ptr(), p.requires_grad) for p in params)  # backward hands grads to these
    buffers = tuple(b.data_ptr() for b in buffers)
    masking = ("drawn", *mask.key) if isinstance(mask, MaskDraw) else (tuple(mask.shape), mask.dtype)
    return (tuple(x.shape), x.dtype, x.device, x.requires_grad, masking, n_keep,
            module.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            autocast_dtype(x.device.type), weights, buffers)


@torch.compiler.disable  # under the user's torch.compile: a graph break, this runs as it would eagerly
def run(step: Callable, module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, n_keep: int) -> tuple:
    """``step(module, x, mask, n_keep)`` (a tuple of tensors, the loss first) through CUDA graphs;
    eager if they cannot be built."""
    return _run(step, module, x, mask, n_keep)[0]


@torch.compiler.disable
def run_drawing(step: Callable, module: torch.nn.Module, x: torch.Tensor, draw: MaskDraw, n_keep: int) -> tuple:
    """``run`` with the mask drawn by the forward graph (``mask_in_graph``): ``(*outputs, mask)``."""
    outputs, mask = _run(step, module, x, draw, n_keep)
    return (*outputs, mask)


def _run(step: Callable, module: torch.nn.Module, x: torch.Tensor, mask: Mask, n_keep: int
         ) -> Tuple[tuple, torch.Tensor]:
    """(the step's outputs, the mask it used)."""
    graph = None
    if step not in _broken:
        try:
            params, buffers = _tensors_of(module)
            graph = _graph_for(step, module, x, mask, n_keep, params, buffers)
        except Exception as exc:  # keep the user's run going: eager is slower, never wrong
            _pools.pop(module, None)
            _broken[step] = repr(exc)
            _warn_once(f"broken {id(step)}", f"CUDA graphs off for this model ({exc!r}); running eagerly")
    if graph is None:
        if isinstance(mask, MaskDraw):
            mask = mask.draw(module, x)
        return step(module, x, mask, n_keep), mask
    # replayed before the autograd Function is entered: its bookkeeping of ~400 inputs then runs
    # while the GPU already works, not in front of it
    mask = graph.replay(x, mask)
    if not graph.with_grad:
        return tuple(out.clone() for out in graph.outputs), mask
    return WholeStep.apply(graph, x, mask, *graph.weights), mask


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
    """One captured ``step`` for one signature: a forward graph, and the loss's backward as a second
    graph (``split``) or inside the forward's (see ``backward_graph``)."""

    def __init__(self, step: Callable, module: torch.nn.Module, x: torch.Tensor, mask: Mask,
                 n_keep: int, params: Sequence[torch.Tensor]):
        self.step, self.n_keep = step, n_keep
        # weakly: _graphs and _pools are keyed by the model, so a strong reference here would keep
        # every graphed model (and its graphs' memory) alive for the life of the process
        self._module = weakref.ref(module)
        self.weights: List[torch.Tensor] = [p for p in params if p.requires_grad]
        self.input_grad = x.requires_grad and torch.is_grad_enabled()
        self.with_grad = torch.is_grad_enabled() and bool(self.weights or self.input_grad)
        self.split = self.with_grad and (backward_graph or _needs_loss_scale(x, params))
        self.static_x = x.detach().clone().requires_grad_(self.input_grad)
        self.draw = mask if isinstance(mask, MaskDraw) else None  # drawn by the forward graph
        self.static_mask = None if self.draw else mask.detach().clone()
        self.static_d_loss: Optional[torch.Tensor] = None  # the loss's incoming gradient
        self.autocast = autocast_dtype(x.device.type)  # part of the signature: fixed per graph
        self.compiled = _compile(step)
        self.forward_graph: Optional[torch.cuda.CUDAGraph] = None  # None: the bodies run per call
        self.backward_graph: Optional[torch.cuda.CUDAGraph] = None
        if x.is_cuda and capture:
            self._capture()

    @property
    def module(self) -> Optional[torch.nn.Module]:
        return self._module()

    def _forward_body(self):
        """The compiled forward; the loss keeps its autograd graph for ``_backward_body``."""
        if self.draw is not None:  # eager ops, captured: each replay draws as FAIR's call would
            self.static_mask = self.draw.draw(self.module, self.static_x)  # (B, L) bool
        outputs = self.compiled(self.module, self.static_x, self.static_mask, self.n_keep)
        self.loss = outputs[0]
        self.outputs = [out.detach() for out in outputs]
        self.differentiable = [out.requires_grad for out in outputs]
        if self.with_grad and self.static_d_loss is None:  # first warm-up: outside any capture
            self.static_d_loss = torch.ones_like(self.loss)

    def _backward_body(self):
        """autograd.grad of the loss from ``static_d_loss``; backward copies the gradients out."""
        targets = self.weights + ([self.static_x] if self.input_grad else [])
        with torch.autocast(self.static_x.device.type, enabled=False):  # backward keeps forward's dtypes
            grads = torch.autograd.grad(self.loss, targets, self.static_d_loss, allow_unused=True)
        self.loss = None  # its graph is spent
        # in the graph's memory until the next replay; contiguous, so one foreach copy takes them out
        self.grads = [None if grad is None else grad.contiguous() for grad in grads]

    def _run_forward(self):
        self._forward_body()
        if self.with_grad and not self.split:
            self._backward_body()

    def _capture(self) -> None:
        device = self.static_x.device
        rng = torch.cuda.get_rng_state(device) if self.draw else None  # the warm-ups draw masks too
        try:
            self._warm_up_and_capture()
        finally:
            if rng is not None:
                torch.cuda.set_rng_state(rng, device)  # the first replay draws this call's mask

    def _warm_up_and_capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward_body()
                if self.with_grad:
                    self._backward_body()
        torch.cuda.current_stream().wait_stream(side)
        pool = _pools.get(self.module)
        if pool is None:
            pool = _pools[self.module] = torch.cuda.graph_pool_handle()
        # both graphs share the pool: what the forward saves for backward stays allocated between them
        stream = torch.cuda.current_stream()
        try:
            self.forward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.forward_graph, pool=pool):
                self._run_forward()
            if self.split:
                self.backward_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.backward_graph, pool=pool):
                    self._backward_body()
        except Exception:
            torch.cuda.set_stream(stream)  # a capture that fails half-way leaves its side stream current
            _end_generator_capture()
            raise

    def replay(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        """The forward (and, unless split, the backward) for this x and mask; returns the mask, given
        or (a copy of) the one the graph drew."""
        with torch.no_grad():
            self.static_x.copy_(x)
            if self.draw is None:
                self.static_mask.copy_(mask)
        if self.forward_graph is None:
            with torch.set_grad_enabled(self.with_grad):  # not captured: the body, run now
                self._run_forward()
        else:
            self.forward_graph.replay()
        _replayed()
        return mask if self.draw is None else self.static_mask.clone()

    def replay_backward(self, d_loss: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """Split graphs: the backward from ``d_loss``; its gradients, copied out of the graph's memory."""
        with torch.no_grad():
            self.static_d_loss.copy_(d_loss)
        if self.backward_graph is None:
            with torch.enable_grad():
                self._backward_body()
        else:
            self.backward_graph.replay()
        _replayed()
        return _copy_out(self.grads)

    def scaled_grads(self, d_loss: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """One graph: the captured gradients times ``d_loss`` (the next replay overwrites ours)."""
        return _copy_out(self.grads, d_loss)

    def recompute_grads(self, module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor,
                        grad_outputs) -> List[Optional[torch.Tensor]]:
        """Gradients of the step by eager autograd, for what the captured ones cannot answer."""
        _counts["recomputed_backwards"] += 1
        device = x.device.type
        with torch.enable_grad():
            with torch.autocast(device, dtype=self.autocast, enabled=self.autocast is not None):
                outputs = self.step(module, x, mask, self.n_keep)  # as the forward ran
            pairs = [(out, g) for out, g in zip(outputs, grad_outputs) if g is not None]
            targets = self.weights + ([x] if self.input_grad else [])
            return list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                            allow_unused=True, create_graph=torch.is_grad_enabled()))


def _end_generator_capture() -> None:
    """A capture that fails inside ``capture_begin`` leaves the CUDA generators marked as capturing:
    their next eager use (FAIR's ``torch.rand`` of the next mask) would raise "Offset increment
    outside graph capture encountered unexpectedly". The end of an empty capture clears the mark."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty"
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
    except Exception:  # nothing more we can do; the original error is what gets reported
        pass


def _replayed() -> None:
    global _generation
    _generation += 1
    _counts["replays"] += 1


def _copy_out(grads: Sequence[Optional[torch.Tensor]], scale: Optional[torch.Tensor] = None
              ) -> List[Optional[torch.Tensor]]:
    """Gradients in the graph's memory -> new tensors, views of one flat buffer per dtype, times
    ``scale`` if given (None stays None).

    One foreach copy (a few multi-tensor launches) and, with a scale, one multiply per dtype: not a
    copy per weight (~400 launches for Hiera-B MAE), and no concatenation inside the graph (H200:
    a 157 MB ``cat`` of Hiera-B MAE's gradients took 0.3 ms of every step)."""
    out: List[Optional[torch.Tensor]] = [None] * len(grads)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, grad in enumerate(grads):
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        sources = [grads[i] for i in indices]
        flat = torch.empty(sum(g.numel() for g in sources), dtype=dtype, device=sources[0].device)
        offset = 0
        for i, grad in zip(indices, sources):
            out[i] = flat[offset:offset + grad.numel()].view(grad.shape)
            offset += grad.numel()
        torch._foreach_copy_([out[i] for i in indices], sources)
        if scale is not None:
            flat.mul_(scale.to(dtype))
    return out


class WholeStep(torch.autograd.Function):
    """Hands out a just-replayed ``StepGraph``'s outputs; backward replays its backward (or scales
    its captured gradients), see the module docstring.

    Inputs: the graph, x, the mask, then the weights that get gradients (``graph.weights``)."""

    @staticmethod
    def forward(ctx, graph: StepGraph, x, mask, *weights):
        # ``run`` has just replayed the graph for x and mask
        ctx.set_materialize_grads(False)
        ctx.graph, ctx.generation, ctx.x, ctx.mask = graph, _generation, x, mask
        ctx.module = graph.module  # alive until this step's backward, even if the user drops the model
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
            grads = graph.replay_backward(d_loss) if graph.split else graph.scaled_grads(d_loss)
        else:
            grads = graph.recompute_grads(ctx.module, ctx.x, ctx.mask, (d_loss, *d_others))
        weight_grads = grads[: len(graph.weights)]
        input_grad = grads[len(graph.weights)] if graph.input_grad else None
        return (None, input_grad, None, *weight_grads)


def reset() -> None:
    """Forget every compiled step and captured graph (their memory is freed once nothing holds them)."""
    _compiled.clear()
    _broken.clear()
    _graphs.clear()
    _pools.clear()
    _counts.update(replays=0, recomputed_backwards=0)


def status() -> dict:
    captured = sum(len(graphs) for graphs in _graphs.values())
    return {"enabled": enabled, "backward_graph": backward_graph, "compiled_steps": len(_compiled),
            "captured_graphs": captured, **_counts, "failed": list(_broken.values())}
