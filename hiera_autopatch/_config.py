"""Every environment variable hiera_autopatch reads, and the one strict parser for them.

Precedence: built-in defaults < environment < explicit arguments (runner flags, ``enable()``).
No torch here: this module is imported by the ``.pth`` bootstrap at interpreter start.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Tuple

ENV_ENABLE = "HIERA_OPTIM"
"""``1``/``true``/``on``/``yes`` arms the import hooks; unset/``0``/``false``/``off``/``no`` does
nothing. Any other value: one warning naming the variable, patching stays off."""

ENV_MODULES = "HIERA_OPTIM_MODULES"
"""Comma list of extra module names that hold in-tree copies of FAIR's Hiera
(``models.hiera`` and ``models.hiera_mae`` are watched already)."""

ENV_DISABLE = "HIERA_OPTIM_DISABLE"
"""Comma list of patch names (as ``status`` lists them) to leave off."""

ENV_FORCE = "HIERA_OPTIM_FORCE"
"""Comma list of patch names to apply even where the method's source differs from the version
the patch was written for (for forks the user knows to be compatible)."""

ENV_VERBOSE = "HIERA_OPTIM_VERBOSE"
"""``1``: one stderr line per patched module at patch time. Default: silent."""

ENV_GRAPHS = "HIERA_OPTIM_GRAPHS"
"""``1``: capture the MAE forward+backward in CUDA graphs (see README). Default: off."""

ENV_KEPT_EMBED = "HIERA_OPTIM_KEPT_EMBED"
"""MAE patch embedding: on (default) computes it at the tokens the mask keeps only
(``ops/patch_embed.py``); ``0`` runs FAIR's full-image embedding."""

ENV_ATTENTION = "HIERA_OPTIM_ATTENTION"
"""Attention backend for patched mask-unit attention: ``auto`` (default: per-shape choice between
PyTorch SDPA and our Triton kernel), ``sdpa`` or ``triton``."""

ENV_RUNNER = "HIERA_OPTIM_RUNNER"
"""Internal: set to ``1`` by ``python -m hiera_autopatch`` so that ``status`` in the script and in
its children can say the runner turned patching on."""

TRUE_WORDS = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS = frozenset({"", "0", "false", "off", "no"})
ATTENTION_CHOICES = ("auto", "sdpa", "triton")


@dataclasses.dataclass(frozen=True)
class Config:
    """What the user asked for. Built once from the environment, overridden by explicit arguments."""

    enabled: bool = False
    source: str = ""  # "env", "runner" or "api": who turned patching on
    extra_modules: Tuple[str, ...] = ()
    disabled_patches: frozenset = frozenset()
    forced_patches: frozenset = frozenset()
    verbose: bool = False
    graphs: bool = False
    attention: str = "auto"
    kept_embed: bool = True

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def parse_switch(name: str, raw: Optional[str], warnings: list, default: bool = False) -> bool:
    """A boolean env value: True or False; ``default`` when unset, and for anything else too, with
    a warning appended that says so."""
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    warnings.append(
        f"{name}={raw!r} is not understood (use 1/true/on/yes or 0/false/off/no); treating it as {'on' if default else 'off'}"
    )
    return default


def parse_names(raw: Optional[str]) -> Tuple[str, ...]:
    """A comma list: stripped, empty items dropped, order kept, duplicates removed."""
    if not raw:
        return ()
    names = []
    for item in raw.split(","):
        item = item.strip()
        if item and item not in names:
            names.append(item)
    return tuple(names)


def unknown_names(names, known) -> Tuple[str, ...]:
    """The names in ``names`` that are not in ``known``, in order."""
    return tuple(name for name in names if name not in known)


def check_patch_names(config: "Config", known) -> list:
    """One warning line per variable that names a patch not in ``known`` (which lists them all)."""
    warnings = []
    for variable, names in ((ENV_DISABLE, config.disabled_patches), (ENV_FORCE, config.forced_patches)):
        unknown = unknown_names(sorted(names), known)
        if unknown:
            warnings.append(
                f"{variable} names unknown patch{'es' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"known patches: {', '.join(known)}"
            )
    return warnings


def from_env(environ: Optional[Mapping[str, str]] = None) -> Tuple[Config, list]:
    """Read every variable above. Returns the config and a list of warning lines (not printed)."""
    env = os.environ if environ is None else environ
    warnings: list = []
    enabled = parse_switch(ENV_ENABLE, env.get(ENV_ENABLE), warnings)
    source = ""
    if enabled:
        source = "runner" if env.get(ENV_RUNNER) == "1" else "env"
    verbose = parse_switch(ENV_VERBOSE, env.get(ENV_VERBOSE), warnings)
    graphs = parse_switch(ENV_GRAPHS, env.get(ENV_GRAPHS), warnings)
    kept_embed = parse_switch(ENV_KEPT_EMBED, env.get(ENV_KEPT_EMBED), warnings, default=True)
    attention = (env.get(ENV_ATTENTION) or "auto").strip().lower()
    if attention not in ATTENTION_CHOICES:
        warnings.append(
            f"{ENV_ATTENTION}={env.get(ENV_ATTENTION)!r} is not one of {', '.join(ATTENTION_CHOICES)}; "
            "using auto"
        )
        attention = "auto"
    config = Config(
        enabled=enabled,
        source=source,
        extra_modules=parse_names(env.get(ENV_MODULES)),
        disabled_patches=frozenset(parse_names(env.get(ENV_DISABLE))),
        forced_patches=frozenset(parse_names(env.get(ENV_FORCE))),
        verbose=verbose,
        graphs=graphs,
        attention=attention,
        kept_embed=kept_embed,
    )
    return config, warnings
