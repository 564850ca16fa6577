"""hiera_autopatch: FAIR's Hiera, fast, with zero code edits.

Public API: ``enable()``, ``disable()``, ``disabled()``, ``status()``, ``__version__``.
Most users need none of it: ``HIERA_OPTIM=1`` or ``python -m hiera_autopatch train.py`` does the same
without touching their code. Importing this package is cheap (no torch, no dataclasses): the
``.start`` file imports it at every interpreter start on Python 3.15+.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["enable", "disable", "disabled", "status", "__version__"]


def enable(**overrides) -> None:
    """Patch every Hiera imported now or later. Safe to call twice.

    Settings come from the environment (``HIERA_OPTIM_DISABLE`` etc.); keyword arguments override
    them and are ``Config`` field names, e.g. ``enable(disabled_patches={"fair.mae_loss"})``.
    """
    from . import _bootstrap, _config, _registry

    config, warnings = _config.from_env()
    for name in ("extra_modules",):
        if name in overrides:
            overrides[name] = tuple(overrides[name])
    for name in ("disabled_patches", "forced_patches"):
        if name in overrides:
            overrides[name] = frozenset(overrides[name])
    source = overrides.pop("source", "api")
    config = config.replace(enabled=True, source=source, **overrides)
    warnings += _config.check_patch_names(config, _registry.PATCH_NAMES)
    for line in warnings:
        _bootstrap.warn(line)
    _bootstrap.arm(config)


def disable() -> None:
    """Revert exactly what was applied, newest first, and patch nothing more. Safe to call twice."""
    from . import _registry

    _registry.set_config(_registry.STATE.config.replace(enabled=False))
    _registry.revert_all()


class disabled:
    """``with hiera_autopatch.disabled(): ...`` runs a block with the original FAIR/timm methods,
    then restores the state it found (patched again only if it was on)."""

    def __enter__(self) -> "disabled":
        from . import _registry

        self._previous = _registry.STATE.config
        disable()
        return self

    def __exit__(self, *exc_info) -> None:
        from . import _bootstrap

        if self._previous.enabled:
            _bootstrap.arm(self._previous)


def status() -> dict:
    """What is enabled, by what, and per target module what was patched or skipped and why."""
    from . import _registry

    return dict(version=__version__, **_registry.status())
