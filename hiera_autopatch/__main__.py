"""The command line: the runner, ``status`` and ``bench``.

    python -m hiera_autopatch [--off] [--disable NAMES] [--verbose] (script.py | -m module | -c code) [args...]
    python -m hiera_autopatch status [--json] [--import MODULES | --no-import]
    python -m hiera_autopatch bench [...]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from typing import List, Optional

USAGE = """\
usage: python -m hiera_autopatch [--off] [--disable NAMES] [--verbose] (script.py | -m module | -c code) [args...]
       python -m hiera_autopatch status [--json] [--import MODULES | --no-import]
       python -m hiera_autopatch bench [--help]
       python -m hiera_autopatch --version

Runs a Python program with every Hiera it imports patched (FAIR hiera-transformer, in-tree copies
of it, timm). The decision is exported as HIERA_OPTIM so that child processes (torchrun ranks,
DataLoader workers, multiprocessing children) get the same state.

runner options (before the program; everything after it is the program's):
  --off            run unpatched: exports HIERA_OPTIM=0 (the baseline of an A/B pair)
  --disable NAMES  comma list of patches to leave off (added to HIERA_OPTIM_DISABLE);
                   `python -m hiera_autopatch status` lists the names
  --verbose        one stderr line per patched module (HIERA_OPTIM_VERBOSE=1)
  -m module        run a library module as a script, as `python -m module`
  -c code          run a string of code, as `python -c code`

An explicit HIERA_OPTIM=0 in the environment wins over the runner:
  HIERA_OPTIM=0 python -m hiera_autopatch train.py   # same as --off
"""

STATUS_USAGE = """\
usage: python -m hiera_autopatch status [--json] [--import MODULES | --no-import]

Says what this environment gets: the version, whether patching is on and by what, and per target
module whether it is imported, which implementation and version it is, which patches apply and
which are skipped and why. To show that, it imports the installed targets (hiera, timm.models.hiera,
and the names in HIERA_OPTIM_MODULES) with patching on, in this process only.

  --json            one JSON object instead of text
  --import MODULES  also import these modules (comma list), e.g. models.hiera for an in-tree copy
                    (run it from the folder your training script runs from)
  --no-import       import nothing: report only the settings
"""

DEFAULT_STATUS_IMPORTS = ("hiera", "timm.models.hiera")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "status":
        return status_command(argv[1:])
    if argv and argv[0] == "bench":
        from . import bench  # lazily: it imports torch

        return bench.main(argv[1:])
    return runner_command(argv)


def runner_command(argv: List[str]) -> int:
    off = verbose = False
    disable: Optional[str] = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(USAGE, end="")
            return 0
        if arg == "--version":
            from . import __version__

            print(f"hiera_autopatch {__version__}")
            return 0
        if arg == "--off":
            off = True
        elif arg == "--verbose":
            verbose = True
        elif arg == "--disable" or arg.startswith("--disable="):
            disable, i = _option_value(argv, i)
            if disable is None:
                return _usage_error("--disable needs a comma list of patch names")
        elif arg in ("-m", "-c") or (arg[:2] in ("-m", "-c") and len(arg) > 2):
            kind, value = arg[:2], arg[2:]
            if not value:
                if i + 1 >= len(argv):
                    return _usage_error(f"{kind} needs an argument")
                i += 1
                value = argv[i]
            return _run(kind, value, argv[i + 1 :], off, disable, verbose)
        elif arg == "--":
            if i + 1 >= len(argv):
                return _usage_error("no program to run")
            return _run("script", argv[i + 1], argv[i + 2 :], off, disable, verbose)
        elif arg.startswith("-"):
            return _usage_error(f"unknown option {arg!r}")
        else:
            return _run("script", arg, argv[i + 1 :], off, disable, verbose)
        i += 1
    return _usage_error("no program to run")


def _run(kind: str, target: str, args: List[str], off: bool, disable: Optional[str], verbose: bool) -> int:
    from . import _runner

    _runner.export_decision(off=off, disable=disable, verbose=verbose)
    _runner.activate()
    if kind == "-m":
        return _runner.run_module(target, args)
    if kind == "-c":
        return _runner.run_code(target, args)
    return _runner.run_script(target, args)


def _option_value(argv: List[str], i: int):
    """The value of the option at ``argv[i]`` (``--opt=value`` or ``--opt value``) and the index of
    its last word; ``(None, i)`` when the value is missing."""
    if "=" in argv[i]:
        return argv[i].split("=", 1)[1], i
    if i + 1 < len(argv):
        return argv[i + 1], i + 1
    return None, i


def _usage_error(message: str) -> int:
    print(USAGE.split("\n\n")[0], file=sys.stderr)
    print(f"hiera_autopatch: error: {message}", file=sys.stderr)
    return 2


# --- status ----------------------------------------------------------------------------------


def status_command(argv: List[str]) -> int:
    as_json = False
    do_import = True
    extra: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(STATUS_USAGE, end="")
            return 0
        if arg == "--json":
            as_json = True
        elif arg == "--no-import":
            do_import = False
        elif arg == "--import" or arg.startswith("--import="):
            value, i = _option_value(argv, i)
            if value is None:
                return _usage_error("--import needs a comma list of module names")
            from . import _config

            extra.extend(_config.parse_names(value))
        else:
            print(STATUS_USAGE.split("\n\n")[0], file=sys.stderr)
            print(f"hiera_autopatch: error: unknown status option {arg!r}", file=sys.stderr)
            return 2
        i += 1
    report = collect_status(do_import, extra)
    text = json.dumps(report, indent=2, sort_keys=True) if as_json else format_status(report)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `... status | head`
        sys.stdout = None
    return 0


def collect_status(do_import: bool, extra_imports: List[str]) -> dict:
    """The settings this environment gives a program, and what patching does to each target here."""
    from . import __version__, _bootstrap, _registry

    env_config = _bootstrap.configure()
    imports: List[str] = []
    import_errors = {}
    if do_import:
        extra_modules = tuple(dict.fromkeys(env_config.extra_modules + tuple(extra_imports)))
        _bootstrap.arm(
            env_config.replace(enabled=True, source=env_config.source or "status", extra_modules=extra_modules)
        )
        for name in dict.fromkeys(DEFAULT_STATUS_IMPORTS + extra_modules):
            if not _installed(name):
                continue
            try:
                importlib.import_module(name)
                imports.append(name)
            except Exception as exc:  # a broken install is reported, not raised
                import_errors[name] = f"{type(exc).__name__}: {exc}"
    state = _registry.status()
    report = {
        "version": __version__,
        "package": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.executable,
        "enabled": env_config.enabled,
        "enabled_by": env_config.source,
        "env": {name: os.environ[name] for name in _env_names() if name in os.environ},
        "known_patches": list(_registry.PATCH_NAMES),
        "disabled_patches": sorted(env_config.disabled_patches),
        "forced_patches": sorted(env_config.forced_patches),
        "attention": env_config.attention,
        "graphs": env_config.graphs,
        "kept_embed": env_config.kept_embed,
        "imported_by_status": imports,
        "import_errors": import_errors,
        "targets": state["targets"],
    }
    return report


def _env_names() -> List[str]:
    from . import _config

    return [value for key, value in vars(_config).items() if key.startswith("ENV_")]


def _installed(name: str) -> bool:
    """True when the module can be found, without running any of it but its parent packages."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


ATTENTION_RULES = {
    "auto": "our Triton kernel under torch.compile and CUDA graphs for windows of <= 128 keys "
    "(<= 256 with head_dim <= 64), PyTorch SDPA otherwise and in eager",
    "sdpa": "PyTorch SDPA everywhere (4-D, fused kernels)",
    "triton": "our Triton kernel wherever it supports the shape, eager included",
}
"""What each HIERA_OPTIM_ATTENTION value runs (ops/attention.use_triton); ``status`` prints it, and
``hiera_autopatch.status()["attention_calls"]`` lists what a running process actually ran."""


def format_status(report: dict) -> str:
    lines = [f"hiera_autopatch {report['version']}  ({report['package']})"]
    if report["enabled"]:
        by = {"runner": "the runner (python -m hiera_autopatch)", "env": "HIERA_OPTIM in the environment"}
        lines.append(f"patching: on, by {by.get(report['enabled_by'], report['enabled_by'])}")
    else:
        raw = report["env"].get("HIERA_OPTIM")
        lines.append(
            "patching: off (HIERA_OPTIM is unset; set HIERA_OPTIM=1 or use the runner)"
            if raw is None
            else f"patching: off (HIERA_OPTIM={raw!r})"
        )
    lines.append(
        f"settings: disabled={','.join(report['disabled_patches']) or '-'}"
        f"  forced={','.join(report['forced_patches']) or '-'}"
        f"  attention={report['attention']}  graphs={'on' if report['graphs'] else 'off'}"
        f"  kept_embed={'on' if report['kept_embed'] else 'off'}"
    )
    lines.append(f"attention kernels: {ATTENTION_RULES.get(report['attention'], '?')}")
    lines.append(f"patch names: {', '.join(report['known_patches'])}")
    if report["imported_by_status"]:
        lines.append(
            "targets (imported by this command with patching on, to show what a patched run gets):"
        )
    else:
        lines.append("targets:")
    width = max(len(name) for name in report["targets"]) if report["targets"] else 0
    for name, entry in report["targets"].items():
        if name in report["import_errors"]:
            lines.append(f"  {name:<{width}}  import failed: {report['import_errors'][name]}")
            continue
        if not entry["imported"]:
            lines.append(f"  {name:<{width}}  not imported")
            continue
        head = f"  {name:<{width}}  {entry['implementation']}, {entry.get('version') or 'version unknown'}"
        applied = entry.get("applied") or []
        skipped = entry.get("skipped") or {}
        if "error" in entry:
            lines.append(f"{head}: patching failed: {entry['error']}")
            continue
        if not applied and not skipped:
            lines.append(f"{head}: defines no class we patch (re-exports are patched where defined)")
            continue
        lines.append(f"{head}: applied {', '.join(applied) or 'nothing'}")
        for patch_name, reason in sorted(skipped.items()):
            lines.append(f"  {'':<{width}}    skipped {patch_name}: {reason}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
