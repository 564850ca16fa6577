"""One benchmark cell, measured: build the model, warm it up, check numerics, time each side.

A *side* is one way of running the same model: ``unpatched`` (FAIR/timm as they ship),
``patched`` (``hiera_autopatch.enable()``) and, when it is installed, ``hiera_optim`` (the public
hiera-optim 0.2.1, for comparison). Eager cells run unpatched and patched in this process on one
model instance, interleaved step by step; compiled cells (and any cell with a third side) run each
side in a fresh interpreter (``bench.py --_child``), because torch.compile does not guard the code
object of a method it inlined, so a class patched after compiling would go unseen.

Everything that is not the training step itself (seeding, toggling patches, zeroing gradients,
numerics, profiling) happens outside the timed region.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch

import hiera_autopatch

SIDES = ("unpatched", "patched")
THIRD_SIDE = "hiera_optim"
MODES = ("eager", "compile", "reduce-overhead")

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "amp": torch.float32}

NUMERICS_LIMITS: Dict[str, Tuple[float, float]] = {
    # dtype: (loss relative difference, largest per-parameter relative gradient-norm difference),
    # patched against unpatched directly. A patch reorders reductions and swaps the math SDPA path
    # for fused kernels, so bit equality is not expected; a wrong patch (lost term, wrong mask,
    # wrong scale) lands far above these. In bf16/fp16/amp the fp32-reference check (``compare``)
    # is used instead; these looser limits apply only when it is switched off.
    "fp32": (1e-4, 1e-3),
    "amp": (2e-2, 2.5e-1),
    "fp16": (1e-2, 1e-1),
    "bf16": (2e-2, 2.5e-1),
}

DEFAULT_MASK_RATIO = 0.6  # FAIR's MaskedAutoencoderHiera.forward default

TINY_MAE_KWARGS = {
    # A Hiera-T-shaped MAE shrunk to run in seconds on a CPU (the no-argument CPU default).
    "embed_dim": 32,
    "num_heads": 1,
    "stages": [1, 1, 2, 1],
    "decoder_embed_dim": 64,
    "decoder_depth": 1,
    "decoder_num_heads": 2,
}


class BenchError(Exception):
    """A problem with what the user asked for (unknown model, bad geometry): one line, exit 2."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclasses.dataclass
class Spec:
    """Everything that defines one cell. JSON-serialisable (it is handed to child processes)."""

    model: str = "mae_hiera_base_224"
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    batch: int = 128
    input_size: Optional[List[int]] = None  # (H, W) or (T, H, W); None: the model's own
    res: Optional[int] = None  # spatial size: replaces the last two entries of the model's input size
    in_chans: Optional[int] = None
    dtype: str = "bf16"
    mode: str = "eager"
    steps: int = 20
    warmup: int = 3
    mask_ratio: float = DEFAULT_MASK_RATIO
    task: str = "auto"
    seed: int = 0
    device: str = "cuda"
    numerics: bool = True
    profile: bool = True
    fp32_reference: bool = True  # bf16/fp16/amp numerics: judge both sides against an fp32 step
    patch_options: dict = dataclasses.field(default_factory=dict)  # enable() overrides: graphs, attention
    hiera_optim: bool = False  # add the third side when hiera_optim is importable
    isolate: bool = False  # run eager sides in child processes too
    side_timeout_s: Optional[float] = None
    label: str = ""  # a matrix cell's name

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Spec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# --------------------------------------------------------------------------------------------
# Building the model


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    source: str  # "fair", "timm" or "factory"
    task: str  # "mae" or "cls"
    input_size: Tuple[int, ...]
    in_chans: int
    kwargs: dict  # what the constructor or factory was finally called with
    extra_modules: Tuple[str, ...]  # module names of in-tree classes to watch for patching


def parse_model_name(name: str) -> Tuple[str, str, str]:
    """``NAME`` (FAIR), ``timm:NAME`` or ``module:factory`` -> (source, module, attribute)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise BenchError("--model", f"{name!r} is not NAME, timm:NAME or module:factory")
        if module == "timm":
            return "timm", "timm", attr
        if module in ("hiera", "fair"):
            return "fair", "hiera", attr
        return "factory", module, attr
    return "fair", "hiera", name


class _Captured(Exception):
    def __init__(self, cls, args, kwargs):
        super().__init__(cls.__name__)
        self.cls, self.args, self.kwargs = cls, args, kwargs


def capture_constructor(factory: Callable) -> Optional[Tuple[type, tuple, dict]]:
    """The class and arguments a factory like ``hiera.mae_hiera_base_224`` would construct.

    FAIR's factories hard-code ``embed_dim``, ``stages``, ``q_pool`` ... and forward ``**kwargs``,
    so ``mae_hiera_base_224(q_pool=3)`` raises "multiple values". We call the factory with every
    ``nn.Module`` subclass its code can name replaced by a recorder that stops at the first
    construction, then build the real class with the factory's arguments updated by the user's.
    Nothing is built and nothing stays replaced.
    """
    namespaces = []
    seen = set()
    stack = [factory]
    while stack:
        func = stack.pop()
        func = getattr(func, "__func__", func)
        if not inspect.isfunction(func) or id(func) in seen:
            continue
        seen.add(id(func))
        if all(ns is not func.__globals__ for ns in namespaces):
            namespaces.append(func.__globals__)
        for cell in func.__closure__ or ():
            try:
                stack.append(cell.cell_contents)
            except ValueError:
                pass
        wrapped = getattr(func, "__wrapped__", None)
        if wrapped is not None:
            stack.append(wrapped)

    def recorder(cls):
        def record(*args, **kwargs):
            raise _Captured(cls, args, kwargs)

        return record

    saved = []
    try:
        for ns in namespaces:
            for key, value in list(ns.items()):
                if isinstance(value, type) and issubclass(value, torch.nn.Module) and not value.__module__.startswith("torch"):
                    saved.append((ns, key, value))
                    ns[key] = recorder(value)
        try:
            factory()
        except _Captured as captured:
            return captured.cls, captured.args, captured.kwargs
        except Exception:
            return None
        return None
    finally:
        for ns, key, value in reversed(saved):
            ns[key] = value


def _tuples(kwargs: dict) -> dict:
    """JSON gives lists; Hiera's constructors expect tuples for shapes."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def _with_res(size, res: Optional[int]) -> Optional[Tuple[int, ...]]:
    if res is None:
        return tuple(size) if size is not None else None
    size = tuple(size) if size is not None else (224, 224)
    return tuple(size[:-2]) + (res, res)


def build_model(spec: Spec, device: torch.device) -> Built:
    """Build ``spec.model`` on ``device`` with a seeded init (identical in every process)."""
    source, module_name, attr = parse_model_name(spec.model)
    user = _tuples(dict(spec.model_kwargs))
    if spec.input_size is not None:
        user["input_size" if source != "timm" else "img_size"] = tuple(spec.input_size)
    if spec.in_chans is not None:
        user["in_chans"] = spec.in_chans
    try:
        model, kwargs = _construct(spec, source, module_name, attr, user, device)
    except BenchError:
        raise
    except Exception as exc:  # the model refused the geometry or the arguments: say which flags
        flags = [flag for flag, given in (("--model-kwargs", spec.model_kwargs), ("--res", spec.res),
                                          ("--input-size", spec.input_size), ("--in-chans", spec.in_chans)) if given]
        message = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise BenchError("/".join(flags) or "--model", f"{spec.model} could not be built: {message}") from None
    if not isinstance(model, torch.nn.Module):
        raise BenchError("--model", f"{spec.model} returned {type(model).__name__}, not an nn.Module")
    model = model.to(device=device, dtype=TORCH_DTYPE[spec.dtype]).train()
    task = spec.task
    if task == "auto":
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        task = "mae" if "mask_ratio" in params else "cls"
    return Built(
        model=model,
        source=source,
        task=task,
        input_size=_model_input_size(model, spec, kwargs),
        in_chans=_model_in_chans(model, spec),
        kwargs={k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        extra_modules=_in_tree_modules(model),
    )


def _construct(spec: Spec, source: str, module_name: str, attr: str, user: dict, device: torch.device):
    """The model and the keyword arguments it was finally built with."""
    torch.manual_seed(spec.seed)
    if source == "timm":
        try:
            import timm
        except ImportError as exc:
            raise BenchError("--model", f"timm is not installed ({exc})") from None
        if not timm.models.is_model(attr):
            raise BenchError("--model", f"timm has no model {attr!r}")
        if spec.res is not None and "img_size" not in user:
            default = timm.models.get_pretrained_cfg(attr)
            size = tuple(default.input_size[1:]) if default is not None else (224, 224)
            user["img_size"] = _with_res(size, spec.res)
        with torch.device(device):
            model = timm.create_model(attr, pretrained=False, **user)
        kwargs = user
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = " (pip install hiera-transformer)" if module_name == "hiera" else ""
            raise BenchError("--model", f"cannot import {module_name}: {exc}{hint}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            where = "FAIR's hiera package" if source == "fair" else module_name
            raise BenchError("--model", f"{where} has no model factory {attr!r}")
        model, kwargs = None, user
        captured = capture_constructor(factory) if source == "fair" else None
        if source == "factory" and spec.res is not None and "input_size" not in user:
            user["input_size"] = _with_res(None, spec.res)
        if captured is not None:
            cls, args, base = captured
            kwargs = dict(base)
            if spec.res is not None and "input_size" not in user:
                user["input_size"] = _with_res(base.get("input_size"), spec.res)
            kwargs.update(user)
            with torch.device(device):
                model = cls(*args, **kwargs)
        else:
            with torch.device(device):
                try:
                    model = factory(**user)
                except TypeError as exc:
                    if "multiple values for keyword argument" not in str(exc):
                        raise
                    captured = capture_constructor(factory)
                    if captured is None:
                        raise
                    cls, args, base = captured
                    kwargs = {**base, **user}
                    model = cls(*args, **kwargs)
    return model, kwargs


def _model_input_size(model, spec: Spec, kwargs: dict) -> Tuple[int, ...]:
    tokens = getattr(model, "tokens_spatial_shape", None)
    stride = getattr(model, "patch_stride", None)
    if tokens is not None and stride is not None and len(tokens) == len(stride):
        return tuple(int(t) * int(s) for t, s in zip(tokens, stride))
    for key in ("input_size", "img_size"):
        if kwargs.get(key) is not None:
            size = kwargs[key]
            return tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    return _with_res((224, 224), spec.res)


def _model_in_chans(model, spec: Spec) -> int:
    proj = getattr(getattr(model, "patch_embed", None), "proj", None)
    if proj is not None and hasattr(proj, "in_channels"):
        return int(proj.in_channels)
    return spec.in_chans or 3


def _in_tree_modules(model) -> Tuple[str, ...]:
    """Modules of the model's own classes that the registry does not watch by name (in-tree copies)."""
    from . import _registry

    watched = set(_registry.TARGETS)
    names = []
    for sub in model.modules():
        name = type(sub).__module__
        if name.split(".")[0] in ("torch", "timm", "hiera") or name in watched or name == "__main__":
            continue
        if name not in names:
            names.append(name)
    return tuple(names)


# --------------------------------------------------------------------------------------------
# Sides


def apply_side(side: str, extra_modules: Tuple[str, ...] = (), options: Optional[dict] = None) -> None:
    """Make the classes match ``side``. Tests replace this to feed a deliberately wrong patch.

    ``options`` are ``hiera_autopatch.enable()`` overrides for the patched side (``graphs``,
    ``attention``); the environment (``HIERA_OPTIM_*``) fills in the rest, as it would for a user.
    """
    if side == "patched":
        from . import _config

        config, _ = _config.from_env()
        modules = tuple(dict.fromkeys(config.extra_modules + tuple(extra_modules)))
        hiera_autopatch.enable(source="bench", extra_modules=modules, **(options or {}))
    else:
        hiera_autopatch.disable()


def model_modules(model) -> List[str]:
    """The modules that define the classes a model is made of (what patches can reach)."""
    return sorted({type(sub).__module__ for sub in model.modules()})


def patch_summary(modules: Optional[List[str]] = None) -> dict:
    """What ``hiera_autopatch.status()`` says is applied now, condensed for the record.

    ``active`` lists every applied patch; ``for_model`` only those in ``modules`` (the model's own
    classes: timm's patches do nothing for a FAIR model even when timm is imported).
    """
    status = hiera_autopatch.status()
    active, for_model, skipped, errors = [], [], {}, {}
    for module, entry in status.get("targets", {}).items():
        for name in entry.get("applied", []):
            active.append(f"{module}: {name}")
            if modules is None or module in modules:
                for_model.append(name)
        if entry.get("skipped"):
            skipped[module] = dict(entry["skipped"])
        if entry.get("error"):
            errors[module] = entry["error"]
    return {
        "enabled": status.get("enabled"),
        "graphs": status.get("graphs"),
        "attention": status.get("attention"),
        "active": active,
        "for_model": sorted(set(for_model)),
        "skipped": skipped,
        "errors": errors,
    }


def apply_hiera_optim_side(model: torch.nn.Module) -> torch.nn.Module:
    """hiera-optim 0.2.1 as FACTS.md describes it, with the two shims it needs for PyPI hiera."""
    # hiera_optim resolves FAIR's symbols when it is imported: the shim must come first
    hiera_mod = sys.modules.get("hiera")
    if hiera_mod is not None and not hasattr(hiera_mod, "apply_fusion_head"):
        from hiera import hiera_mae

        hiera_mod.apply_fusion_head = hiera_mae.apply_fusion_head
    import hiera_optim  # noqa: F401  (ImportError is the caller's "skip")

    if not hasattr(model, "_grad_checkpointing"):
        model._grad_checkpointing = False
    optimized = hiera_optim.optimize(model)
    return optimized if isinstance(optimized, torch.nn.Module) else model


def hiera_optim_available() -> bool:
    return importlib.util.find_spec("hiera_optim") is not None


# --------------------------------------------------------------------------------------------
# The training step


class Step:
    """One forward+backward of ``fn`` (the model, or its compiled wrapper) on fixed inputs."""

    def __init__(self, fn, built: Built, spec: Spec, device: torch.device, x: Optional[torch.Tensor] = None):
        self.fn = fn
        self.model = built.model
        self.task = built.task
        self.device = device
        self.mask_ratio = spec.mask_ratio
        self.amp = spec.dtype == "amp"
        self.mark_step = spec.mode == "reduce-overhead"
        if x is None:
            gen = torch.Generator(device=device).manual_seed(spec.seed + 12345)
            shape = (spec.batch, built.in_chans) + tuple(built.input_size)
            x = torch.randn(shape, generator=gen, device=device).to(TORCH_DTYPE[spec.dtype])
        self.x = x
        self.y: Optional[torch.Tensor] = None
        self.y_seed = spec.seed + 54321  # the same labels in every Step and process

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def __call__(self) -> torch.Tensor:
        if self.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            if self.task == "mae":
                loss = self.fn(self.x, mask_ratio=self.mask_ratio)[0]
            else:
                out = self.fn(self.x)
                logits = out[0] if isinstance(out, (tuple, list)) else out
                if logits.dim() == 2:
                    if self.y is None:
                        gen = torch.Generator(device=self.device).manual_seed(self.y_seed)
                        self.y = torch.randint(logits.shape[1], (logits.shape[0],), generator=gen, device=self.device)
                    loss = torch.nn.functional.cross_entropy(logits.float(), self.y)
                else:
                    loss = logits.float().pow(2).mean()
        loss.backward()
        return loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: Step, device: torch.device) -> Tuple[float, float, torch.Tensor]:
    """(device ms, wall ms, loss) for one step, synchronised before and after."""
    sync(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        return start.elapsed_time(end), wall, loss
    t0 = time.perf_counter()
    loss = step()
    wall = (time.perf_counter() - t0) * 1e3
    return wall, wall, loss


def pipelined_ms(step: Step, device: torch.device, seed: int, steps: int) -> float:
    """ms per step over ``steps`` steps run back to back, synchronised once at the end.

    What a training loop that does not read the loss every step sees: the host prepares the next
    step while the GPU still runs this one, so per-step host work (launches, graph bookkeeping) is
    hidden where the GPU is the slower of the two. ``timed_step`` exposes it instead.
    """
    sync(device)
    t0 = time.perf_counter()
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    for i in range(steps):
        step.zero_grad()
        torch.manual_seed(seed + 1 + i)
        loss = step()
        del loss
    if device.type == "cuda":
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    return (time.perf_counter() - t0) * 1e3 / steps


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def reference(step: Step, seed: int) -> Tuple[torch.Tensor, Dict[str, Optional[torch.Tensor]]]:
    """Loss and every parameter gradient of one seeded step (cloned: a cudagraph replay reuses them)."""
    step.zero_grad()
    torch.manual_seed(seed)
    loss = step().detach().clone()
    grads = {
        name: (p.grad.detach().clone() if p.grad is not None else None)
        for name, p in step.model.named_parameters()
        if p.requires_grad
    }
    step.zero_grad()
    return loss, grads


def fp32_reference(step: Step, built: Built, spec: Spec, device: torch.device, seed: int):
    """The same step in fp32 (no autocast, eager, unpatched) on a copy of the same weights and inputs.

    Low-precision gradients of two correct implementations can differ by tens of percent on some
    parameters (pos_embed in bf16: ~50% against fp32 on a tiny Hiera), so in bf16/fp16/amp the
    check asks whether the patched side is as close to this reference as the unpatched side is.
    """
    import copy

    model32 = copy.deepcopy(step.model).float()
    built32 = dataclasses.replace(built, model=model32)
    step32 = Step(model32, built32, dataclasses.replace(spec, dtype="fp32", mode="eager"), device, x=step.x.float())
    result = reference(step32, seed)
    del model32, built32, step32
    gc.collect()
    return result


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _try_fp32_reference(step: Step, built: Built, spec: Spec, device: torch.device):
    """(golden, None), or (None, why) when an fp32 copy does not fit: the check falls back to direct limits."""
    try:
        return fp32_reference(step, built, spec, device, spec.seed), None
    except Exception as exc:  # typically out of memory for the largest models at full batch
        step.zero_grad()
        _free(device)
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


GOLDEN_SLACK = 2.0
"""Patched error against fp32 may be at most this many times the unpatched error, plus the floor."""

GOLDEN_FLOOR: Dict[str, Tuple[float, float]] = {
    # dtype: (loss, gradient) relative error allowed on top of GOLDEN_SLACK x the unpatched error.
    "bf16": (1e-2, 2e-2),
    "amp": (1e-2, 2e-2),
    "fp16": (2e-3, 5e-3),
}


def _rel(d: torch.Tensor, ref: torch.Tensor) -> float:
    dn = float(d.norm())
    return dn / max(float(ref.norm()), 1e-30) if dn > 0 else 0.0


def compare(ref, got, dtype: str, golden=None) -> dict:
    """Loss and gradient differences of ``got`` (a side) against ``ref`` (unpatched), each (loss, grads).

    fp32: direct limits (``NUMERICS_LIMITS``). bf16/fp16/amp with ``golden`` (the fp32 reference):
    per parameter, the side's error against fp32 must stay within GOLDEN_SLACK x the unpatched
    error + GOLDEN_FLOOR; without a golden, the looser direct limits apply.
    """
    ref_loss, ref_grads = ref
    loss, grads = got
    loss_limit, grad_limit = NUMERICS_LIMITS[dtype]
    a, b = float(ref_loss.float()), float(loss.float())
    loss_abs = abs(a - b)
    loss_rel = loss_abs / max(abs(a), 1e-12)
    nonfinite = [] if math.isfinite(b) else ["loss"]
    missing, unmatched = [], []
    max_abs, max_abs_name, max_rel, max_rel_name = 0.0, "", 0.0, ""
    diff_sq, ref_sq, compared = 0.0, 0.0, 0
    use_golden = golden is not None and dtype in GOLDEN_FLOOR
    golden_grads = golden[1] if use_golden else {}
    worst_excess, worst_name, worst_pair = -math.inf, "", (0.0, 0.0)
    err_ref_max, err_got_max = 0.0, 0.0
    _, grad_floor = GOLDEN_FLOOR.get(dtype, (0.0, 0.0))
    for name in sorted(ref_grads.keys() | grads.keys()):
        if name not in ref_grads or name not in grads:
            unmatched.append(name)
            continue
        ga, gb = ref_grads[name], grads[name]
        if ga is None or gb is None:
            if (ga is None) != (gb is None):
                missing.append(name)
            continue
        ga, gb = ga.float(), gb.float().to(ga.device)
        if ga.shape != gb.shape:
            missing.append(name)
            continue
        if not bool(torch.isfinite(gb).all()):
            nonfinite.append(name)
            continue
        d = ga - gb
        dmax = float(d.abs().max()) if d.numel() else 0.0
        dn, na, nb = float(d.norm()), float(ga.norm()), float(gb.norm())
        rel = dn / max(na, nb, 1e-30) if dn > 0 else 0.0
        compared += 1
        diff_sq += dn * dn
        ref_sq += na * na
        if dmax > max_abs:
            max_abs, max_abs_name = dmax, name
        if rel > max_rel:
            max_rel, max_rel_name = rel, name
        g32 = golden_grads.get(name)
        if use_golden and g32 is not None and g32.shape == ga.shape:
            g32 = g32.float().to(ga.device)
            err_ref, err_got = _rel(ga - g32, g32), _rel(gb - g32, g32)
            err_ref_max, err_got_max = max(err_ref_max, err_ref), max(err_got_max, err_got)
            excess = err_got - (GOLDEN_SLACK * err_ref + grad_floor)
            if excess > worst_excess:
                worst_excess, worst_name, worst_pair = excess, name, (err_ref, err_got)
    global_rel = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30) if diff_sq > 0 else 0.0
    problems = []
    if nonfinite:
        problems.append(f"non-finite: {', '.join(sorted(nonfinite)[:3])}")
    if missing:
        problems.append(f"gradient present on one side only: {', '.join(sorted(missing)[:3])}")
    result = {
        "loss_ref": a,
        "loss": b,
        "loss_abs_diff": loss_abs,
        "loss_rel_diff": loss_rel,
        "grad_max_abs_diff": max_abs,
        "grad_max_abs_param": max_abs_name,
        "grad_max_rel_norm_diff": max_rel,
        "grad_max_rel_norm_param": max_rel_name,
        "grad_global_rel_norm_diff": global_rel,
        "params_compared": compared,
        "params_unmatched": len(unmatched),
    }
    if use_golden:
        loss_floor, _ = GOLDEN_FLOOR[dtype]
        l32 = float(golden[0].float())
        loss_err_ref = abs(a - l32) / max(abs(l32), 1e-12)
        loss_err_got = abs(b - l32) / max(abs(l32), 1e-12)
        if loss_err_got > GOLDEN_SLACK * loss_err_ref + loss_floor:
            problems.append(
                f"loss is {loss_err_got:.2e} from fp32 (unpatched: {loss_err_ref:.2e}; allowed "
                f"{GOLDEN_SLACK:g}x + {loss_floor:.0e})"
            )
        if worst_excess > 0:
            problems.append(
                f"gradient of {worst_name} is {worst_pair[1]:.2e} from fp32 (unpatched: {worst_pair[0]:.2e}; "
                f"allowed {GOLDEN_SLACK:g}x + {grad_floor:.0e})"
            )
        result.update(
            method="against an fp32 reference",
            loss_fp32=l32,
            loss_err_vs_fp32={"unpatched": loss_err_ref, "side": loss_err_got},
            grad_max_err_vs_fp32={"unpatched": err_ref_max, "side": err_got_max},
            grad_worst_param=worst_name,
            grad_worst_err_vs_fp32={"unpatched": worst_pair[0], "side": worst_pair[1]},
            limits={"slack": GOLDEN_SLACK, "loss_floor": loss_floor, "grad_floor": grad_floor},
        )
    else:
        if loss_rel > loss_limit:
            problems.append(f"loss differs by {loss_rel:.2e} (relative) > {loss_limit:.0e}")
        if max_rel > grad_limit:
            problems.append(f"gradient of {max_rel_name} differs by {max_rel:.2e} (relative norm) > {grad_limit:.0e}")
        result.update(method="direct", limits={"loss_rel": loss_limit, "grad_rel_norm": grad_limit})
    result["ok"] = not problems
    result["problems"] = problems
    return result


# --------------------------------------------------------------------------------------------
# Which attention kernels ran

_ATTENTION_WORDS = ("scaled_dot_product", "flash", "fmha", "attention", "attn", "sdpa", "cudnn_mha")


def attention_backends(names: Dict[str, int]) -> List[str]:
    """Map op/kernel names seen by the profiler to SDPA backends (and our own Triton kernels)."""
    found = []

    def add(backend):
        if backend not in found:
            found.append(backend)

    for name in names:
        low = name.lower()
        if "cudnn" in low and ("attention" in low or "mha" in low or "sdpa" in low or "fprop" in low):
            add("cudnn")
        elif "flash" in low:
            add("flash")
        elif "efficient_attention" in low or "mem_eff" in low or "fmha_cutlass" in low or "fmha" in low:
            add("efficient")
        elif "_scaled_dot_product_attention_math" in low:
            add("math")
        elif "window_attention" in low or ("triton" in low and ("att" in low or "sdpa" in low)):
            add("triton")  # ours: hiera_autopatch::window_attention and its _window_attention_*_kernel
    return found


def profile_attention(step: Step, device: torch.device, seed: int) -> dict:
    """Run one step under torch.profiler and keep the names of attention ops and kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    step.zero_grad()
    torch.manual_seed(seed)
    sync(device)
    with profile(activities=activities) as prof:
        step()
        sync(device)
    step.zero_grad()
    names: Dict[str, int] = {}
    for avg in prof.key_averages():
        low = avg.key.lower()
        if any(word in low for word in _ATTENTION_WORDS):
            names[avg.key[:160]] = names.get(avg.key[:160], 0) + int(avg.count)
    return {"backends": attention_backends(names), "names": dict(sorted(names.items(), key=lambda kv: -kv[1])[:24])}


# --------------------------------------------------------------------------------------------
# Timing


def summarize(ms: List[float], wall: List[float], batch: int) -> dict:
    median = statistics.median(ms)
    return {
        "ms_median": median,
        "ms_min": min(ms),
        "ms_max": max(ms),
        "ms_all": [round(v, 4) for v in ms],
        "wall_ms_median": statistics.median(wall),
        "samples_per_s": batch / (median / 1e3) if median > 0 else None,
    }


class _NullProgress:
    def update(self, n: int = 1, note: str = "") -> None:
        pass


def _compiled(model, mode: str):
    if mode == "eager":
        return model
    import torch._inductor.config as inductor_config

    # Inductor's own RNG would draw different MAE masks than eager; keep eager's, so the two sides
    # (and any eager reference) see the same masks under the same seed.
    inductor_config.fallback_random = True
    return torch.compile(model, mode=None if mode == "compile" else mode)


def _step_graph_status() -> Optional[dict]:
    """Whether the patched MAE step ran under our CUDA graphs (and why not, if it fell back)."""
    try:
        from .ops import step_graph

        return step_graph.status()
    except Exception:
        return None


def _attention_calls() -> Optional[dict]:
    """Which attention kernel (our Triton one or SDPA) each call shape of the patched side ran."""
    try:
        from .ops import attention

        return attention.describe_choices()
    except Exception:
        return None


def _dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        }
    except Exception:
        return {}


WARMUP_MIN_S = 2.0
"""On a GPU, warm-up goes on until this long has passed since its first step ended (that step
compiles, where anything does): a side that starts on an idle GPU ramped up over its first timed
steps in session 10's graphs bench (benchmarks/results/h200_bench_graphs.json: FAIR eager's first
synchronised steps 160 and 142 ms, its median 118.5)."""


def warm_up(step: "Step", spec: Spec, device: torch.device, progress, note: str) -> Tuple[Optional[float], float, int]:
    """``spec.warmup`` untimed steps; on a GPU, more (up to 10x as many) until ``WARMUP_MIN_S`` have
    passed after the first. None at all with ``warmup=0``. -> (first step s, total s, steps run)."""
    t0 = time.perf_counter()
    first: Optional[float] = None
    most = spec.warmup * 10 if device.type == "cuda" else spec.warmup
    n = 0
    while n < spec.warmup or (n < most and time.perf_counter() - t0 - first < WARMUP_MIN_S):
        step.zero_grad()
        torch.manual_seed(spec.seed + 1000 + n)
        step()
        sync(device)
        if first is None:
            first = time.perf_counter() - t0
        if n < spec.warmup:  # the progress bar counts spec.warmup steps per side
            progress.update(1, note)
        n += 1
    return first, time.perf_counter() - t0, n


def run_in_process(spec: Spec, device: torch.device, progress=None) -> dict:
    """Eager A/B on one model instance: warm-up, numerics, then interleaved timed steps (AB BA AB ...)."""
    progress = progress or _NullProgress()
    built = build_model(spec, device)
    step = Step(built.model, built, spec, device)
    sides: Dict[str, dict] = {s: {} for s in SIDES}
    cell = _cell_header(spec, built)
    try:
        for side in SIDES:
            apply_side(side, built.extra_modules, spec.patch_options)
            sides[side]["patches"] = patch_summary(model_modules(built.model))
            _, sides[side]["warmup_s"], sides[side]["warmup_steps"] = warm_up(
                step, spec, device, progress, f"{spec.mode} warm-up {side}")
            sides[side]["compile_s"] = None
        step.zero_grad()
        if spec.numerics:
            try:
                apply_side("unpatched")
                ref = reference(step, spec.seed)
                golden, golden_error = None, None
                if spec.fp32_reference and spec.dtype in GOLDEN_FLOOR:
                    golden, golden_error = _try_fp32_reference(step, built, spec, device)
                apply_side("patched", built.extra_modules, spec.patch_options)
                got = reference(step, spec.seed)
                cell["numerics"] = compare(ref, got, spec.dtype, golden)
                if golden_error:
                    cell["numerics"]["fp32_reference_error"] = golden_error
                del ref, got, golden
            except Exception as exc:  # keep the timings even when the check itself breaks
                cell["numerics"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "problems": ["numerics check failed to run"]}
                step.zero_grad()
                _free(device)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        times = {s: ([], [], []) for s in SIDES}  # device ms, wall ms, peak bytes
        for i in range(spec.steps):
            # Alternate the order (AB BA AB ...) so neither side always runs right after the other.
            for side in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
                apply_side(side, built.extra_modules, spec.patch_options)
                step.zero_grad()
                torch.manual_seed(spec.seed + 1 + i)  # both sides draw the same masks at step i
                reset_peak(device)
                ms, wall, loss = timed_step(step, device)
                del loss
                times[side][0].append(ms)
                times[side][1].append(wall)
                times[side][2].append(peak_bytes(device))
                progress.update(1, f"{spec.mode} {side}")
        pipelined = {s: [] for s in SIDES}
        for side in (*SIDES, *reversed(SIDES)):  # AB BA: neither side always runs first
            apply_side(side, built.extra_modules, spec.patch_options)
            pipelined[side].append(pipelined_ms(step, device, spec.seed, spec.steps))
        step.zero_grad()
        for side in SIDES:
            ms, wall, peaks = times[side]
            sides[side].update(summarize(ms, wall, spec.batch))
            sides[side]["pipelined_ms"] = statistics.mean(pipelined[side])
            sides[side]["peak_mem_bytes"] = max(peaks) if peaks[0] is not None else None
            if spec.profile:
                apply_side(side, built.extra_modules, spec.patch_options)
                try:
                    sides[side]["attention"] = profile_attention(step, device, spec.seed)
                except Exception as exc:  # the profiler is a nicety; never lose the timings to it
                    sides[side]["attention"] = {"error": repr(exc)}
    finally:
        apply_side("unpatched")
        del step
        built.model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cell["sides"] = sides
    finish_cell(cell)
    return cell


def run_isolated_side(
    spec: Spec, side: str, device: torch.device, grads_path: Optional[str], progress=None, golden_path: Optional[str] = None
) -> dict:
    """One side in this (fresh) process: patch state first, then build, compile, time."""
    progress = progress or _NullProgress()
    result: dict = {"side": side}
    if side == THIRD_SIDE:
        apply_side("unpatched")
    if side == "patched":
        # Patch before building and compiling: compile keeps whatever code it inlined first.
        source, module_name, _ = parse_model_name(spec.model)
        extra = (module_name,) if source == "factory" else ()
        apply_side("patched", extra, spec.patch_options)
        built = build_model(spec, device)
        if set(built.extra_modules) - set(extra):
            # The model's classes live in modules we had not watched (an in-tree copy imported by
            # the factory): patch those now; nothing has been compiled yet.
            apply_side("patched", extra + built.extra_modules, spec.patch_options)
    else:
        built = build_model(spec, device)
    result["patches"] = patch_summary(model_modules(built.model))
    model = built.model
    if side == THIRD_SIDE:
        model = apply_hiera_optim_side(model)
        built.model = model
    result["param_checksum"] = param_checksum(model)
    if golden_path and spec.numerics:
        eager = Step(model, built, dataclasses.replace(spec, mode="eager"), device)
        golden, result["fp32_reference_error"] = _try_fp32_reference(eager, built, spec, device)
        if golden is not None:
            _save_grads(golden_path, *golden)
        del eager, golden
    fn = _compiled(model, spec.mode)
    step = Step(fn, built, spec, device)
    # Peak memory over warm-up and timed steps alike: a CUDA graph takes its memory at capture (in
    # warm-up) and a replay allocates nothing, so a peak counted from the timed steps alone misses it.
    reset_peak(device)
    first, total, result["warmup_steps"] = warm_up(step, spec, device, progress, f"{spec.mode} warm-up {side}")
    compiles = spec.mode != "eager" or (side == "patched" and spec.patch_options.get("graphs"))
    if not compiles:
        result["compile_s"], result["warmup_s"] = None, total
    else:
        result["compile_s"] = first  # the first call traces and compiles forward and backward
        result["warmup_s"] = total - (first or 0.0)
    if spec.numerics and grads_path:
        try:
            loss, grads = reference(step, spec.seed)
            _save_grads(grads_path, loss, grads)
            del loss, grads
        except Exception as exc:  # keep the timings; the parent reports the missing check
            result["numerics_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            step.zero_grad()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ms_all, wall_all = [], []
    for i in range(spec.steps):
        step.zero_grad()
        torch.manual_seed(spec.seed + 1 + i)
        ms, wall, loss = timed_step(step, device)
        del loss
        ms_all.append(ms)
        wall_all.append(wall)
        progress.update(1, f"{spec.mode} {side}")
    result["peak_mem_bytes"] = peak_bytes(device)
    result["pipelined_ms"] = pipelined_ms(step, device, spec.seed, spec.steps)
    step.zero_grad()
    result.update(summarize(ms_all, wall_all, spec.batch))
    if compiles:
        result["dynamo"] = _dynamo_counts()
    if side == "patched":
        result["step_graph"] = _step_graph_status()
        result["attention_calls"] = _attention_calls()
    if spec.profile:
        try:
            result["attention"] = profile_attention(step, device, spec.seed)
        except Exception as exc:
            result["attention"] = {"error": repr(exc)}
    result["built"] = {
        "task": built.task,
        "source": built.source,
        "input_size": list(built.input_size),
        "in_chans": built.in_chans,
        "kwargs": built.kwargs,
        "params": sum(p.numel() for p in built.model.parameters()),
    }
    return result


def _save_grads(path: str, loss, grads: dict) -> None:
    torch.save({"loss": loss.cpu(), "grads": {k: (v.cpu() if v is not None else None) for k, v in grads.items()}}, path)


def _load_grads(path: str):
    data = torch.load(path)
    return data["loss"], data["grads"]


def param_checksum(model) -> float:
    """A cheap fingerprint of the initial weights: both processes must start from the same model."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters()))


def _cell_header(spec: Spec, built: Optional[Built]) -> dict:
    config = {
        "label": spec.label,
        "model": spec.model,
        "model_kwargs": spec.model_kwargs,
        "batch": spec.batch,
        "dtype": spec.dtype,
        "mode": spec.mode,
        "steps": spec.steps,
        "warmup": spec.warmup,
        "seed": spec.seed,
        "device": spec.device,
        "step": "forward+backward (no optimizer step)",
        "patch_options": spec.patch_options,
    }
    if built is not None:
        config.update(
            source=built.source,
            task=built.task,
            input_size=list(built.input_size),
            in_chans=built.in_chans,
            constructor_kwargs=built.kwargs,
            params=sum(p.numel() for p in built.model.parameters()),
        )
        config["mask_ratio"] = spec.mask_ratio if built.task == "mae" else None
    else:
        config.update(input_size=spec.input_size, res=spec.res, in_chans=spec.in_chans, mask_ratio=spec.mask_ratio)
    if spec.mode != "eager":
        config["inductor_fallback_random"] = True
    return {"config": config, "sides": {}, "numerics": None, "error": None}


def finish_cell(cell: dict) -> None:
    """Speed-ups of every side against the unpatched one: baseline ms / side ms."""
    base = cell["sides"].get("unpatched", {}).get("ms_median")
    speedups = {}
    for side, data in cell["sides"].items():
        if side == "unpatched" or not data.get("ms_median") or not base:
            continue
        speedups[side] = base / data["ms_median"]
    cell["speedups"] = speedups
    cell["speedup"] = speedups.get("patched")
    base = cell["sides"].get("unpatched", {}).get("pipelined_ms")
    cell["pipelined_speedups"] = {
        side: base / data["pipelined_ms"]
        for side, data in cell["sides"].items()
        if side != "unpatched" and base and data.get("pipelined_ms")
    }


def child_command(spec_path: str) -> List[str]:
    return [sys.executable, "-m", "hiera_autopatch.bench", "--_child", spec_path]


def child_env(side: str) -> dict:
    env = dict(os.environ)
    env["HIERA_OPTIM"] = "1" if side == "patched" else "0"
    root = os.path.dirname(os.path.dirname(os.path.abspath(hiera_autopatch.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


PROGRESS_PREFIX = "hiera_autopatch"
"""Lines a child writes to stderr that start with this are relayed live; the rest go to its log."""


def _run_child(spec_path: str, side: str, timeout: Optional[float], log_path: str, log) -> Tuple[str, List[str]]:
    """Run one side; relay its progress lines, keep its full stderr in a log, return the tail."""
    import collections
    import subprocess
    import threading

    tail: collections.deque = collections.deque(maxlen=60)
    proc = subprocess.Popen(
        child_command(spec_path),
        env=child_env(side),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )

    def pump():
        with open(log_path, "w") as f:
            for line in proc.stdout:
                f.write(line)
                tail.append(line.rstrip("\n"))
                if line.startswith(PROGRESS_PREFIX):
                    log(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
        status = f"exited with status {code}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = f"was stopped after the {timeout:.0f} s side timeout"
    reader.join(timeout=10)
    return status, list(tail)


def run_isolated(spec: Spec, sides: Tuple[str, ...], workdir: str, log=print) -> dict:
    """Each side in its own interpreter; numerics from the gradient files they leave."""
    cell = _cell_header(spec, None)
    dumps = {}
    for side in sides:
        spec_path = os.path.join(workdir, f"spec-{side}.json")
        out_path = os.path.join(workdir, f"result-{side}.json")
        grads_path = os.path.join(workdir, f"grads-{side}.pt") if spec.numerics else None
        golden_path = None
        if side == "unpatched" and spec.numerics and spec.fp32_reference and spec.dtype in GOLDEN_FLOOR:
            golden_path = os.path.join(workdir, "grads-fp32.pt")
        with open(spec_path, "w") as f:
            job = {"spec": spec.to_json(), "side": side, "out": out_path, "grads": grads_path, "golden": golden_path}
            json.dump(job, f)
        log(f"hiera_autopatch bench: {spec.mode}: {side} side in a fresh process ...")
        t0 = time.perf_counter()
        code, tail = _run_child(spec_path, side, spec.side_timeout_s, os.path.join(workdir, f"{side}.log"), log)
        data = None
        if os.path.exists(out_path):
            with open(out_path) as f:
                data = json.load(f)
        if data is None:
            data = {"error": f"child process {code} and wrote no result"}
        if data.get("error"):
            data["log_tail"] = tail
            log("\n".join(f"  | {line}" for line in tail[-15:]))
        data["process_s"] = time.perf_counter() - t0
        built = data.pop("built", None)
        if built and "task" not in cell["config"]:
            cell["config"].update(
                source=built["source"],
                task=built["task"],
                input_size=built["input_size"],
                in_chans=built["in_chans"],
                constructor_kwargs=built["kwargs"],
                params=built["params"],
            )
            if built["task"] != "mae":
                cell["config"]["mask_ratio"] = None
        cell["sides"][side] = data
        if grads_path and os.path.exists(grads_path):
            dumps[side] = grads_path
    if spec.numerics and "unpatched" in dumps:
        ref = _load_grads(dumps["unpatched"])
        golden_path = os.path.join(workdir, "grads-fp32.pt")
        golden = _load_grads(golden_path) if os.path.exists(golden_path) else None
        checks = {}
        for side in sides:
            if side == "unpatched" or side not in dumps:
                continue
            result = compare(ref, _load_grads(dumps[side]), spec.dtype, golden)
            a = cell["sides"]["unpatched"].get("param_checksum")
            b = cell["sides"][side].get("param_checksum")
            if a is not None and b is not None and abs(a - b) > 1e-6 * max(1.0, abs(a)):
                result["ok"] = False
                result["problems"].append("the two processes built different initial weights")
            checks[side] = result
        del ref, golden
        cell["numerics"] = checks.get("patched")
        if THIRD_SIDE in checks:
            cell["numerics_" + THIRD_SIDE] = checks[THIRD_SIDE]
    for side, data in cell["sides"].items():
        if data.get("numerics_error"):  # the unpatched side's missing check voids every comparison
            key = "numerics_" + THIRD_SIDE if side == THIRD_SIDE else "numerics"
            cell[key] = {"ok": False, "error": f"{side}: {data['numerics_error']}", "problems": ["numerics check failed to run"]}
    errors = [f"{s}: {d['error']}" for s, d in cell["sides"].items() if d.get("error")]
    cell["error"] = "; ".join(errors) or None
    finish_cell(cell)
    return cell


def child_main(spec_path: str) -> int:
    """Entry point of ``bench.py --_child``: run one side, write its JSON, never raise."""
    with open(spec_path) as f:
        job = json.load(f)
    spec = Spec.from_json(job["spec"])
    side = job["side"]
    from . import _bench_report

    result: dict
    try:
        device = torch.device(spec.device)
        total = spec.warmup + spec.steps
        progress = _bench_report.Progress(total, f"{PROGRESS_PREFIX} {spec.label or 'bench'} {spec.mode} {side}")
        result = run_isolated_side(spec, side, device, job.get("grads"), progress, job.get("golden"))
        progress.close()
    except BaseException as exc:  # report, do not crash without a word
        result = {"side": side, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print(f"{PROGRESS_PREFIX} bench: {side} side failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    tmp = job["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, job["out"])
    return 0 if not result.get("error") else 1
