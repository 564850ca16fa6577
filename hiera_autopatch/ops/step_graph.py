"""Zero-edit CUDA graphs: the static MAE step runs through ``torch.compile(mode="reduce-overhead")``.

Off unless ``HIERA_OPTIM_GRAPHS=1``. The random mask is drawn eagerly before the graph (the same RNG
use as FAIR's), so seeded runs see the same masks with and without graphs. Tensors returned from a
graph replay live in its memory pool and are overwritten by the next replay, so they are cloned
before the user sees them. If compiling fails, we warn once and run eagerly from then on.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict

import torch

enabled = False
"""Set by the registry from ``HIERA_OPTIM_GRAPHS``."""

GRAPHED = {"triton.cudagraphs": True}
"""Inductor options of ``mode="reduce-overhead"``: CUDA graphs, nothing else."""

compile_options: Dict[str, object] = dict(GRAPHED)
"""Inductor options of the graphed step. Experiments (``scripts/profile_step.py`` mode suffixes)
add tuning to them, e.g. ``coordinate_descent_tuning`` or ``max_autotune_gemm`` (Triton GEMMs that
can take GELU into their epilogue); the compile then takes minutes longer."""

_compiled: Dict[Callable, Callable] = {}
_broken: Dict[Callable, str] = {}


def wanted(x: torch.Tensor) -> bool:
    """Graphs for this call: enabled, on CUDA, and not already inside the user's torch.compile."""
    return enabled and x.is_cuda and not torch.compiler.is_compiling()


def run(step: Callable, *args):
    """``step(*args)`` as a CUDA-graphed compiled function; eager if that cannot be built."""
    if step in _broken:
        return step(*args)
    compiled = _compiled.get(step)
    if compiled is None:
        compiled = torch.compile(step, options=dict(compile_options), fullgraph=True, dynamic=False)
        _compiled[step] = compiled
    try:
        outputs = compiled(*args)
    except Exception as exc:  # keep the user's run going: eager is slower, never wrong
        _broken[step] = repr(exc)
        print(f"hiera_autopatch: CUDA graphs off for this model ({exc!r}); running eagerly", file=sys.stderr)
        return step(*args)
    return tuple(out.clone() if isinstance(out, torch.Tensor) else out for out in outputs)


def status() -> dict:
    return {"enabled": enabled, "compiled_steps": len(_compiled), "failed": list(_broken.values())}
