"""Programmatic dependent launch for our Triton kernels (ops/triton/_runtime.PDL, on by default since session 32).

Timing is the GPU's business (scripts/profile_step.py's +pdl_ours) and so is the graphed step's
equivalence with it (tests/test_gpu.py). Here, without a GPU: every kernel compiled for sm_90 with
PDL waits for the kernel before it before touching global memory, and none is ever launched with
PDL off the GPU.
"""

import json

import pytest
import torch

from conftest import REPO, run_python
from hiera_autopatch.ops.triton import _runtime


def test_every_kernel_waits_before_its_first_memory_access(tmp_path):
    """scripts/check_pdl.py compiles each kernel of ops/triton for sm_90 (Triton's compiler, no GPU)
    with PDL on and off: with it, ``griddepcontrol.wait`` precedes the first global load/store in
    the PTX; without it there is no grid-dependency instruction at all."""
    pytest.importorskip("triton")
    out = tmp_path / "pdl.json"
    run = run_python([str(REPO / "scripts" / "check_pdl.py"), "--json", str(out)],
                     env={"TRITON_INTERPRET": None, "PYTHONPATH": str(REPO)}, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert not report["failed"] and len(report["kernels"]) == 8
    for name, entry in report["kernels"].items():
        assert entry["ok"] and entry["pdl"]["wait"] < entry["pdl"]["memory"], (name, entry)
        assert entry["plain"]["wait"] is None, name


def test_pdl_is_never_used_off_the_gpu(monkeypatch):
    monkeypatch.setattr(_runtime, "PDL", True)
    assert not _runtime.pdl(torch.zeros(2))  # a CPU tensor (the interpreter's too)
    monkeypatch.setattr(_runtime, "PDL", False)
    assert not _runtime.pdl(torch.zeros(2))


def test_kernels_run_in_the_interpreter_with_pdl_requested(monkeypatch):
    """With ``PDL`` on, the launchers still run in Triton's interpreter (PDL off there): GELU's
    backward gives what it gives without."""
    from hiera_autopatch.ops.triton import gelu as tgelu

    if not _runtime.interpreting() or not tgelu.HAS_TRITON:
        pytest.skip("needs the Triton interpreter")
    torch.manual_seed(0)
    h, d_act = torch.randn(20, 48), torch.randn(20, 48)
    want = tgelu.gelu_backward_bias(d_act, h)
    monkeypatch.setattr(_runtime, "PDL", True)
    got = tgelu.gelu_backward_bias(d_act, h)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
