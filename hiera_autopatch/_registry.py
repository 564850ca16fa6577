"""The table {target module -> patch module}, and the one log of what was applied.

``apply_to_module`` is what an import hook calls once a target module has run; ``revert_all``
undoes exactly what the log holds, in reverse order. Patch modules (and so torch) are imported only
when a target is. A failure inside a patch module is recorded once and leaves the class as it was.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import types
from typing import Dict, List, Optional

from . import _config

TARGETS: Dict[str, str] = {
    "hiera": "fair",  # PyPI hiera-transformer: the package re-exports classes of the two below
    "hiera.hiera": "fair",
    "hiera.hiera_mae": "fair",
    "models.hiera": "fair",  # in-tree copies vendored into research repos
    "models.hiera_mae": "fair",
    "timm.models.hiera": "timm",
}
"""Module names watched by default. ``HIERA_OPTIM_MODULES`` adds names that map to ``fair``."""

PATCH_MODULES: Dict[str, str] = {
    "fair": "hiera_autopatch.patches.fair",
    "timm": "hiera_autopatch.patches.timm",
}

PATCH_NAMES = (
    "fair.attention",
    "fair.block",
    "fair.encoder",
    "fair.mae_encoder",
    "fair.mae_decoder",
    "fair.mae_loss",
    "fair.mae_forward",
    "timm.attention",
    "timm.forward_features",
    "timm.forward_intermediates",
)
"""Every patch name, known without importing torch (a test checks it against the patch modules)."""


@dataclasses.dataclass
class Applied:
    """One entry of the log: enough to put the original back exactly."""

    patch_name: str
    module_name: str
    cls: type
    attr: str
    original: object  # the raw value from cls.__dict__


@dataclasses.dataclass
class TargetReport:
    """What ``status`` says about one target module."""

    module: str
    implementation: str  # "fair" or "timm"
    version: str = ""
    applied: List[str] = dataclasses.field(default_factory=list)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)  # patch name -> reason
    error: str = ""


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.config = _config.Config()
        self.log: List[Applied] = []
        self.reports: Dict[str, TargetReport] = {}


STATE = _State()


def targets_for(config: _config.Config) -> Dict[str, str]:
    """The watched module names for this config: the defaults plus ``HIERA_OPTIM_MODULES``."""
    targets = dict(TARGETS)
    for name in config.extra_modules:
        targets.setdefault(name, "fair")
    return targets


def set_config(config: _config.Config) -> None:
    with STATE.lock:
        STATE.config = config


def on_target_import(module: types.ModuleType) -> None:
    """What the import hook (``_bootstrap._on_target_import``) calls for a target. Never raises."""
    try:
        if STATE.config.enabled:
            apply_to_module(module)
    except Exception as exc:  # an import of the user's must never fail because of us
        _warn_once(f"hiera_autopatch: patching {getattr(module, '__name__', module)} failed: {exc!r}; left unpatched")


def apply_to_module(module: types.ModuleType) -> TargetReport:
    """Apply every recognised patch to the classes this module defines. Idempotent."""
    name = module.__name__
    config = STATE.config
    implementation = targets_for(config).get(name, "fair")
    with STATE.lock:
        report = TargetReport(module=name, implementation=implementation, version=_version_of(name))
        STATE.reports[name] = report
        try:
            from .ops import attention, patch_embed, step_graph  # the target imported torch already

            step_graph.enabled = config.graphs
            attention.backend = config.attention
            patch_embed.kept_only = config.kept_embed
            patch_module = importlib.import_module(PATCH_MODULES[implementation])
            for patch in patch_module.PATCHES:
                _apply_one(patch, module, report, config)
        except Exception as exc:
            report.error = repr(exc)
            _warn_once(f"hiera_autopatch: patching {name} failed: {exc!r}; left unpatched")
            _revert_module(name)
            report.applied.clear()
        if config.verbose and (report.applied or report.skipped):
            print(_one_line(report), file=sys.stderr)
        return report


def _apply_one(patch, module: types.ModuleType, report: TargetReport, config: _config.Config) -> None:
    from .patches import _base

    cls = module.__dict__.get(patch.class_name)
    if not isinstance(cls, type) or cls.__module__ != module.__name__:
        return  # not defined here (a re-export is patched where it is defined)
    original = cls.__dict__.get(patch.attr)
    if original is None:
        report.skipped[patch.name] = f"{patch.class_name}.{patch.attr} is not defined on the class"
        return
    if _base.is_replacement(original):
        report.applied.append(patch.name)  # already ours: a second patch is a no-op
        return
    if patch.name in config.disabled_patches:
        report.skipped[patch.name] = f"disabled by {_config.ENV_DISABLE}"
        return
    reason = _base.method_matches(cls, patch.attr, patch.fingerprints)
    if reason is None:
        for check in patch.checks:
            reason = check(cls, module)
            if reason:
                break
    if reason and patch.name not in config.forced_patches:
        report.skipped[patch.name] = reason
        return
    replacement = _base.mark(patch.make(original, cls), patch.name, original)
    setattr(cls, patch.attr, replacement)
    STATE.log.append(Applied(patch.name, module.__name__, cls, patch.attr, original))
    report.applied.append(patch.name + (" (forced)" if reason else ""))


def revert_all() -> int:
    """Put back every original from the log, newest first. Returns how many were reverted."""
    with STATE.lock:
        count = len(STATE.log)
        while STATE.log:
            entry = STATE.log.pop()
            setattr(entry.cls, entry.attr, entry.original)
        for report in STATE.reports.values():
            report.applied.clear()
        if "hiera_autopatch.ops.attention" in sys.modules:  # back to the defaults for a later enable()
            from .ops import attention, patch_embed, step_graph

            step_graph.enabled = False
            attention.backend = "auto"
            patch_embed.kept_only = True
        return count


def _revert_module(module_name: str) -> None:
    keep = []
    for entry in reversed(STATE.log):
        if entry.module_name == module_name:
            setattr(entry.cls, entry.attr, entry.original)
        else:
            keep.append(entry)
    STATE.log[:] = list(reversed(keep))


def applied_patches() -> List[str]:
    with STATE.lock:
        return [f"{e.module_name}.{e.cls.__name__}.{e.attr} [{e.patch_name}]" for e in STATE.log]


def _version_of(module_name: str) -> str:
    """The distribution version behind a target, or 'in-tree copy'."""
    top = module_name.split(".")[0]
    dist = {"hiera": "hiera-transformer", "timm": "timm"}.get(top)
    if dist is None:
        return "in-tree copy"
    try:
        from importlib import metadata

        return f"{dist} {metadata.version(dist)}"
    except Exception:
        return dist


def _one_line(report: TargetReport) -> str:
    parts = [f"hiera_autopatch: {report.module}: patched {', '.join(report.applied) or 'nothing'}"]
    if report.skipped:
        parts.append(f"skipped {', '.join(sorted(report.skipped))}")
    return "; ".join(parts)


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr)


def status() -> dict:
    """A plain dict of the state: config, and per watched module what was applied or skipped."""
    with STATE.lock:
        config = STATE.config
        targets = {}
        for name, implementation in targets_for(config).items():
            report: Optional[TargetReport] = STATE.reports.get(name)
            imported = name in sys.modules
            entry = {"imported": imported, "implementation": implementation}
            if report is not None:
                entry.update(
                    version=report.version,
                    applied=list(report.applied),
                    skipped=dict(report.skipped),
                )
                if report.error:
                    entry["error"] = report.error
            targets[name] = entry
        attention_calls, graph_steps = {}, {}
        if "hiera_autopatch.ops.attention" in sys.modules:
            attention_calls = sys.modules["hiera_autopatch.ops.attention"].describe_choices()
        if "hiera_autopatch.ops.step_graph" in sys.modules:
            graph_steps = sys.modules["hiera_autopatch.ops.step_graph"].status()
        return {
            "enabled": config.enabled,
            "enabled_by": config.source,
            "disabled_patches": sorted(config.disabled_patches),
            "forced_patches": sorted(config.forced_patches),
            "attention": config.attention,
            "graphs": config.graphs,
            "kept_embed": config.kept_embed,
            "attention_calls": attention_calls,
            "graph_steps": graph_steps,
            "targets": targets,
        }
