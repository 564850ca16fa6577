"""Shared helpers: run Python in a fresh interpreter with a chosen environment, several at once.

Tests that patch anything do it in a subprocess, never in the pytest process (which other tests
share), and each order of operations gets its own fresh interpreter.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks its interpreter when a kernel is decorated, i.e. when our kernel module is first
    # imported, by whichever test gets there first: set it for the whole session, before any test.
    os.environ.setdefault("TRITON_INTERPRET", "1")



def triton_marks(kernel_module, kernel) -> tuple:
    """(interpreted, cpu_only, gpu_only) for a Triton kernel's tests: whether ``kernel`` (one
    @triton.jit function of ``kernel_module``) runs in the interpreter (set above, without a GPU),
    and the skip marks of tests that need it interpreted or compiled on CUDA."""
    interpreted = kernel_module.HAS_TRITON and type(kernel).__name__ == "InterpretedFunction"
    cpu_only = pytest.mark.skipif(not interpreted, reason="CPU tests need the Triton interpreter: TRITON_INTERPRET=1 "
                                  "before the kernel module is imported (and triton installed)")
    gpu_only = pytest.mark.skipif(not (torch.cuda.is_available() and kernel_module.HAS_TRITON and not interpreted),
                                  reason="needs CUDA and compiled (not interpreted) Triton")
    return interpreted, cpu_only, gpu_only


REPO = Path(__file__).resolve().parent.parent
PTH_NAME = "hiera_autopatch.pth"
START_NAME = "hiera_autopatch.start"
MARKER = "__hiera_autopatch__"
"""hiera_autopatch.patches._base.MARKER: set on every replacement function."""


def import_script(name: str):
    """scripts/<name>.py as a module, with scripts/ on sys.path while it imports (its ``_timing``)."""
    import importlib

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def clean_env(env: Optional[Mapping[str, Optional[str]]] = None) -> Dict[str, str]:
    """os.environ without any HIERA_OPTIM* or torchrun variable, plus ``env`` (a None value removes).

    timm's FutureWarning about ``timm.models.layers`` (printed when FAIR's hiera imports it) is
    silenced so that tests can count our own stderr lines.
    """
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HIERA_OPTIM")
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONSTARTUP")
    }
    base["PYTHONWARNINGS"] = "ignore::FutureWarning"
    base.setdefault("OMP_NUM_THREADS", "1")  # 2-core CI: parallel subprocesses must not oversubscribe
    for key, value in (env or {}).items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return base


def run_python(
    args: Sequence[str],
    env: Optional[Mapping[str, Optional[str]]] = None,
    cwd: Optional[os.PathLike] = None,
    python: Optional[str] = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``python ARGS...`` in a fresh interpreter (text output captured, never raises on exit code)."""
    return subprocess.run(
        [python or sys.executable, *args],
        env=clean_env(env),
        cwd=str(cwd) if cwd is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_code(code: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -c CODE`` (dedented) in a fresh interpreter."""
    return run_python(["-c", textwrap.dedent(code)], **kwargs)


def in_parallel(jobs: Mapping[object, callable], workers: Optional[int] = None) -> Dict[object, object]:
    """Run independent callables (typically subprocesses) on a thread pool; {key: result}."""
    workers = workers or max(2, os.cpu_count() or 2)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def explain(result: subprocess.CompletedProcess) -> str:
    """A failure message with everything the subprocess said."""
    return f"exit code {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def our_stderr_lines(text: str) -> List[str]:
    return [line for line in text.splitlines() if line.startswith("hiera_autopatch:")]


def site_packages(python: Optional[str] = None) -> List[Path]:
    """The purelib/platlib folders of an interpreter (this one by default)."""
    if python is None or Path(python) == Path(sys.executable):
        paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    else:
        out = subprocess.run(
            [python, "-c", "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])"],
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        ).stdout
        paths = set(out.split())
    return sorted(Path(p) for p in paths)


def pth_installed() -> bool:
    """True when this interpreter's site-packages holds our .pth (``pip install [-e] .`` was run)."""
    return any((p / PTH_NAME).is_file() for p in site_packages())


requires_pth = pytest.mark.skipif(
    not pth_installed(),
    reason=f"{PTH_NAME} is not in this interpreter's site-packages: run `pip install -e .` first",
)


def copy_fair_in_tree(root: Path, package: str = "models") -> Path:
    """An in-tree copy of FAIR's Hiera, as research repos vendor it: ``ROOT/models/hiera.py`` etc.

    Copied from the installed hiera-transformer, with an empty ``__init__.py``. Returns ROOT.
    """
    import importlib.util

    spec = importlib.util.find_spec("hiera")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("hiera-transformer is not installed (pip install -e .[test])")
    source = Path(list(spec.submodule_search_locations)[0])
    target = root.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    parent = root
    for part in package.split("."):
        parent = parent / part
        (parent / "__init__.py").touch()
    for name in ("hiera.py", "hiera_mae.py", "hiera_utils.py", "hfhub.py"):
        shutil.copy(source / name, target / name)
    return root


@pytest.fixture
def fair_in_tree(tmp_path: Path) -> Path:
    """A folder holding ``models/hiera.py`` (+ hiera_mae, hiera_utils, hfhub): run code from there."""
    return copy_fair_in_tree(tmp_path)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def make_venv(path: Path, deps_from: Iterable[Path]) -> Path:
    """A fresh venv at PATH whose own site-packages comes first and which can import this test
    environment's packages (torch, hiera, wrapt...) through plain path lines, so nothing heavy is
    reinstalled. Our .pth files in the test environment are *not* run there (a path line does not
    process the .pth files of the folder it adds). Returns the venv's python.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    if not python.exists():  # Windows layout
        python = path / "Scripts" / "python.exe"
    purelib = site_packages(str(python))[0]
    # "00_" sorts before hiera_autopatch.pth: wrapt must be importable when our line runs.
    (purelib / "00_test_env_packages.pth").write_text("".join(f"{p}\n" for p in deps_from))
    return python
