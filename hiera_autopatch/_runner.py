"""``python -m hiera_autopatch [options] (script.py | -m module | -c code) [args...]``.

The runner exports its decision into the environment (so torchrun ranks, subprocesses, DataLoader
workers and spawn/forkserver children, which start fresh interpreters, see it through the ``.pth``
file), arms the import hooks in this process, then runs the user's code in this same interpreter
the way ``python`` would: as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` set as ``python``
sets them. It never re-executes itself and never touches multiprocessing's start method.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import types
from typing import List, Optional

from . import _bootstrap, _config

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _safe_path() -> bool:
    """``python -P`` / PYTHONSAFEPATH (3.11+): python then puts no script folder on sys.path."""
    return bool(getattr(sys.flags, "safe_path", False))


def export_decision(off: bool = False, disable: Optional[str] = None, verbose: bool = False) -> None:
    """Write the runner's decision into ``os.environ`` (inherited by every child process).

    ``--off`` sets ``HIERA_OPTIM=0``. Otherwise an explicit ``HIERA_OPTIM`` of the user's wins (so
    ``HIERA_OPTIM=0 python -m hiera_autopatch train.py`` is the A/B baseline); unset or empty
    becomes ``1``. ``--disable`` names are added to ``HIERA_OPTIM_DISABLE``.
    """
    env = os.environ
    if off:
        env[_config.ENV_ENABLE] = "0"
    elif not env.get(_config.ENV_ENABLE, "").strip():
        env[_config.ENV_ENABLE] = "1"
    env[_config.ENV_RUNNER] = "1"
    if disable:
        names = _config.parse_names(env.get(_config.ENV_DISABLE)) + _config.parse_names(disable)
        env[_config.ENV_DISABLE] = ",".join(dict.fromkeys(names))
    if verbose:
        env[_config.ENV_VERBOSE] = "1"


def activate() -> None:
    """Arm (or not) this process from the environment ``export_decision`` wrote."""
    _bootstrap._started = True  # a later process_startup() call in this process is a no-op
    config = _bootstrap.configure()
    raw = os.environ.get(_config.ENV_ENABLE, "").strip().lower()
    if not config.enabled and raw not in _config.FALSE_WORDS:
        # A value we could not read was warned about once here; children get the decision, not
        # the same warning again.
        os.environ[_config.ENV_ENABLE] = "0"


def run_script(path: str, args: List[str]) -> int:
    if not os.path.exists(path):
        return _error(f"can't open file {os.path.abspath(path)!r}: [Errno 2] No such file or directory", 2)
    sys.argv = [path, *args]  # as typed, while __file__ and code filenames are absolute (Python 3.9+)
    abspath = os.path.abspath(path)
    if os.path.isdir(path) or _is_zip(path) or not _is_source(abspath):
        # A folder or zip with __main__.py, or a .pyc: runpy does what python does with those.
        if not _safe_path():
            sys.path[0] = abspath if not os.path.isfile(path) or _is_zip(path) else os.path.dirname(abspath)
        return _run(lambda: runpy.run_path(path, run_name="__main__"))
    if not _safe_path():
        sys.path[0] = os.path.dirname(abspath)  # as `python script.py`: the script's folder first

    def execute() -> None:
        import importlib.machinery

        with io.open_code(abspath) as source_file:
            source = source_file.read()
        code = compile(source, abspath, "exec", dont_inherit=True)
        _exec_as_main(
            code,
            __file__=abspath,
            __cached__=None,
            __loader__=importlib.machinery.SourceFileLoader("__main__", abspath),
        )

    return _run(execute)


def run_module(name: str, args: List[str]) -> int:
    # As `python -m module`: sys.path[0] is already the working directory (we were started with -m);
    # runpy sets sys.argv[0] to the module's file while it runs.
    sys.argv = [name, *args]
    return _run(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True))


def run_code(code: str, args: List[str]) -> int:
    # As `python -c code`: argv[0] is '-c', sys.path[0] is '' (the working directory).
    sys.argv = ["-c", *args]
    if not _safe_path():
        sys.path[0] = ""

    def execute() -> None:
        import importlib.machinery

        _exec_as_main(compile(code, "<string>", "exec", dont_inherit=True), __loader__=importlib.machinery.BuiltinImporter)

    return _run(execute)


def _exec_as_main(code, **attrs) -> None:
    """Run ``code`` in a fresh ``__main__`` module (ours is put back afterwards)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __package__=None, __spec__=None, **attrs)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = previous


def _run(execute) -> int:
    """Run the user's code; on an uncaught exception print its traceback without our frames."""
    try:
        execute()
    except SystemExit:
        raise  # the user's exit code is ours
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and _is_ours(tb.tb_frame):
            tb = tb.tb_next
        if tb is None and isinstance(exc, ImportError):
            # runpy could not find the -m module: one line, as `python -m` prints it.
            return _error(str(exc), 1)
        # The default hook prints the exception's own __traceback__, so trim it there.
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        # Python exits with 1 after an uncaught exception; shells report an interrupt as 130.
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _is_ours(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return (
        name == "runpy"
        or name.startswith("hiera_autopatch")
        or os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR
    )


def _is_zip(path: str) -> bool:
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _is_source(path: str) -> bool:
    """False for compiled bytecode (.pyc), which python runs through its own loader."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return True
    import importlib.util

    return head != importlib.util.MAGIC_NUMBER


def _error(message: str, code: int) -> int:
    print(f"hiera_autopatch: {message}", file=sys.stderr)
    return code
