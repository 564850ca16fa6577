"""What the ``.pth``/``.start`` file and the runner call: read the env, arm import hooks.

No torch here. When ``HIERA_OPTIM`` is unset or off, ``process_startup`` returns after one
environment lookup, without importing anything of ours beyond this module.
"""

from __future__ import annotations

import os
import sys

_OFF_WORDS = ("", "0", "false", "off", "no")
"""Same as ``_config.FALSE_WORDS`` (a test checks it). Spelled out here so that the off path does
not import ``_config`` (which imports dataclasses, ~20 ms on a cold interpreter)."""

_started = False
_armed: set = set()
_warned: set = set()


def process_startup() -> None:
    """Entry point of ``hiera_autopatch.pth`` and ``hiera_autopatch.start``. Runs once per interpreter.

    On Python versions that run both files, the second call is a no-op.
    """
    global _started
    if _started:
        return
    _started = True
    raw = os.environ.get("HIERA_OPTIM")
    if raw is None or raw.strip().lower() in _OFF_WORDS:
        return
    configure()


def configure():
    """Read the environment (``_config.from_env``), print its warnings once each, arm or disarm.

    Called by ``process_startup`` and again by the runner after it has exported its decision.
    Returns the ``Config`` in force.
    """
    from . import _config

    config, warnings = _config.from_env()
    if config.disabled_patches or config.forced_patches:
        from . import _registry

        warnings += _config.check_patch_names(config, _registry.PATCH_NAMES)
    for line in warnings:
        warn(line)
    if config.enabled:
        arm(config)
    elif _armed:
        # Armed earlier in this process (the .pth saw HIERA_OPTIM=1, the runner says --off):
        # the hooks stay registered but do nothing while the config says off.
        from . import _registry

        _registry.set_config(config)
        _registry.revert_all()
    return config


def arm(config) -> None:
    """Register a post-import hook per target; a target already imported is patched at once."""
    import wrapt  # first: if it cannot be imported, nothing claims to be armed

    from . import _registry

    _registry.set_config(config)
    for name in _registry.targets_for(config):
        if name not in _armed:
            _armed.add(name)
            # wrapt calls the hook at once when the module is imported already, else right after
            # the module's code has run. The patch code (and torch) is imported only then.
            wrapt.register_post_import_hook(_on_target_import, name)


def _on_target_import(module) -> None:
    """The hook. wrapt runs a hook once and forgets it, so the name is re-armed by the next
    ``arm()``: a module deleted from sys.modules and imported again is patched again."""
    try:
        _armed.discard(module.__name__)
        from . import _registry

        _registry.on_target_import(module)  # never raises
    except Exception:  # the user's import must not fail because of us
        pass


def warn(line: str) -> None:
    """One stderr line per distinct message per process."""
    if line not in _warned:
        _warned.add(line)
        print(f"hiera_autopatch: {line}", file=sys.stderr)
