"""What a patch is, and how we recognise the code it was written for. No torch here.

A patch replaces one method on one original class. It is applied only when that method's source
is one we know (its fingerprint is in ``Patch.fingerprints``) and every extra check passes, so an
edited fork keeps its edited methods while its unchanged ones are still patched.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import textwrap
import types
from typing import Callable, Dict, Optional, Tuple

MARKER = "__hiera_autopatch__"
"""Attribute set on every replacement function: the patch name. Makes a second patch a no-op."""

ORIGINAL = "__hiera_autopatch_original__"
"""Attribute on a replacement: the function it replaced (for fallbacks and fingerprints)."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One method on one class, replaced by a faster function that gives the same results."""

    name: str
    """What ``status`` lists and ``HIERA_OPTIM_DISABLE`` takes, e.g. ``fair.attention``."""

    class_name: str
    attr: str
    make: Callable[[Callable, type], Callable]
    """``make(original, cls)`` builds the replacement. Most ignore both; some fall back to the
    original, or capture what ``cls`` resolves at patch time to check it again at call time."""

    fingerprints: frozenset
    """Fingerprints of the original methods this replacement was written and tested against."""

    checks: Tuple[Callable[[type, types.ModuleType], Optional[str]], ...] = ()
    """Extra recognition: each returns a reason to skip, or None."""

    summary: str = ""


def fingerprint(func) -> Optional[str]:
    """A short hash of a function's code with comments, formatting and docstring removed.

    ``None`` when the source cannot be read. Our own replacements report the fingerprint of the
    original they replaced, so re-checking an already patched class still recognises it.
    """
    func = getattr(func, ORIGINAL, func)
    func = inspect.unwrap(getattr(func, "__func__", func))
    try:
        return _fingerprint_cache[func]
    except (KeyError, TypeError):
        pass
    try:
        source = textwrap.dedent(inspect.getsource(func))
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    body = getattr(node, "body", None)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:] or [ast.Pass()]
    digest = hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]
    try:
        _fingerprint_cache[func] = digest
    except TypeError:
        pass
    return digest


_fingerprint_cache: Dict[Callable, str] = {}


def is_replacement(func) -> bool:
    """True when ``func`` is one of our replacement functions."""
    return getattr(func, MARKER, None) is not None


def mark(func: Callable, patch_name: str, original: Callable) -> Callable:
    setattr(func, MARKER, patch_name)
    setattr(func, ORIGINAL, original)
    return func


def method_matches(cls: type, attr: str, fingerprints: frozenset) -> Optional[str]:
    """Check the method ``attr`` that ``cls`` resolves (through its MRO). Returns a skip reason or None."""
    func = getattr(cls, attr, None)
    if func is None:
        return f"{cls.__name__}.{attr} is missing"
    fp = fingerprint(func)
    if fp is None:
        return f"source of {cls.__name__}.{attr} is not readable"
    if fp not in fingerprints:
        return f"{cls.__name__}.{attr} differs from the version this patch was written for (fingerprint {fp})"
    return None


def function_matches(module: types.ModuleType, name: str, fingerprints: frozenset) -> Optional[str]:
    """Check a module-level helper (e.g. ``undo_windowing``) that a replacement re-implements."""
    func = getattr(module, name, None)
    if func is None:
        return f"{module.__name__}.{name} is missing"
    fp = fingerprint(func)
    if fp not in fingerprints:
        return f"{module.__name__}.{name} differs from the version this patch was written for (fingerprint {fp})"
    return None
