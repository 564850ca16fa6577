"""Packaging: the wheel carries the .pth and .start files at its root, and a real ``pip install``
(plain and editable) into a fresh venv puts them in site-packages, where they work."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import (
    MARKER,
    PTH_NAME,
    REPO,
    START_NAME,
    explain,
    in_parallel,
    make_venv,
    run_python,
    site_packages,
)


def pip(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *(["--python", python] if python != sys.executable else []), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = pip("wheel", "--no-deps", "-q", "-w", str(out), str(REPO))
    assert result.returncode == 0, result.stdout
    (built,) = out.glob("hiera_autopatch-*.whl")
    return built


def test_wheel_has_pth_and_start_at_its_root(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert PTH_NAME in names and START_NAME in names, sorted(names)
        assert zf.read(PTH_NAME) == (REPO / PTH_NAME).read_bytes()
        assert zf.read(START_NAME) == (REPO / START_NAME).read_bytes()
        for module in ("__init__.py", "__main__.py", "_bootstrap.py", "_config.py", "_registry.py", "_runner.py"):
            assert f"hiera_autopatch/{module}" in names
        assert "hiera_autopatch/patches/fair.py" in names and "hiera_autopatch/patches/timm.py" in names
        assert not any(name.startswith(("tests/", "examples/", "scripts/")) for name in names)
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(metadata_name).decode()
    requires = [
        line.split(":", 1)[1].strip().replace("'", '"')
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    plain = [r for r in requires if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("=")[0].split(";")[0].strip() for r in plain) == ["torch", "wrapt"], requires
    assert any(r.startswith("hiera-transformer") and 'extra == "hiera"' in r for r in requires), requires
    assert any(r.startswith("pytest") and 'extra == "test"' in r for r in requires), requires


CHECK_ON = """
import json, sys
from hiera_autopatch import _bootstrap
started = _bootstrap._started
torch_at_start = "torch" in sys.modules
import hiera, hiera_autopatch
print(json.dumps({
    "package": hiera_autopatch.__file__,
    "started": started,
    "torch_at_start": torch_at_start,
    "patched": bool(getattr(hiera.MaskUnitAttention.forward, MARKER, None)),
}))
""".replace("MARKER", repr(MARKER))

CHECK_OFF = """
import json, sys
print(json.dumps({"ours_imported": any(m.startswith("hiera_autopatch") for m in sys.modules)}))
"""

CHECK_RUNNER = "import hiera_autopatch, json; print(json.dumps(hiera_autopatch.status()['enabled_by']))"


@pytest.mark.parametrize("editable", [False, True], ids=["pip-install", "pip-install-e"])
def test_real_install_into_fresh_venv(tmp_path, editable):
    """``pip install --no-deps [-e] <checkout>`` into a new venv (which reuses this environment's
    torch/hiera/wrapt through plain path lines): the .pth patches hiera under HIERA_OPTIM=1, does
    nothing without it, and the runner works."""
    # Every site-packages this interpreter sees (its own, and any it chains to), not the checkout.
    deps = [p for p in map(Path, sys.path) if p.name in ("site-packages", "dist-packages") and p.is_dir()]
    python = str(make_venv(tmp_path / "venv", deps))
    result = pip("install", "--no-deps", "-q", *(["-e"] if editable else []), str(REPO), python=python)
    assert result.returncode == 0, result.stdout

    (purelib,) = {p for p in site_packages(python) if "venv" in str(p)}
    for name in (PTH_NAME, START_NAME):
        assert (purelib / name).read_bytes() == (REPO / name).read_bytes(), f"{name} missing or different"

    results = in_parallel(
        {
            "on": lambda: run_python(["-c", CHECK_ON], python=python, env={"HIERA_OPTIM": "1"}, cwd=tmp_path),
            "off": lambda: run_python(["-c", CHECK_OFF], python=python, cwd=tmp_path),
            "runner": lambda: run_python(["-m", "hiera_autopatch", "-c", CHECK_RUNNER], python=python, cwd=tmp_path),
        }
    )
    for name, r in results.items():
        assert r.returncode == 0, f"{name}: {explain(r)}"
    on = json.loads(results["on"].stdout)
    assert on["started"] and on["patched"] and not on["torch_at_start"], on
    package = Path(on["package"]).resolve()
    if editable:
        assert package == (REPO / "hiera_autopatch" / "__init__.py").resolve(), package
    else:
        assert package.is_relative_to(purelib.resolve()), package  # the installed copy, not the checkout
    assert json.loads(results["off"].stdout) == {"ours_imported": False}  # so nothing can be patched
    assert json.loads(results["runner"].stdout) == "runner"
