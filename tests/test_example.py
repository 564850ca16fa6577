"""The shipped example: unchanged code, patched by the runner, alone and under a 2-rank torchrun."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, explain, in_parallel, run_python

EXAMPLE = REPO / "examples" / "train_mae.py"
SMALL = ["--steps", "2", "--warmup", "1", "--batch-size", "4", "--log-every", "1"]

pytest.importorskip("hiera")


def last_json(result):
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, explain(result)
    return json.loads(lines[-1])


def test_example_does_not_know_about_us():
    text = EXAMPLE.read_text().lower()
    assert "autopatch" not in text and "hiera_optim" not in text


def test_example_ab_pair_same_masks_one_patched():
    """Runner and --off with the same seed: same data and masks (so the same losses up to float
    rounding); the runner's attention forward is ours, --off's is FAIR's."""
    r = in_parallel(
        {
            "on": lambda: run_python(["-m", "hiera_autopatch", str(EXAMPLE), *SMALL], cwd=REPO),
            "off": lambda: run_python(["-m", "hiera_autopatch", "--off", str(EXAMPLE), *SMALL], cwd=REPO),
        }
    )
    for name in ("on", "off"):
        assert r[name].returncode == 0, f"{name}: {explain(r[name])}"
        assert re.search(r"[\d,.]+ samples/s", r[name].stdout), explain(r[name])
    on, off = last_json(r["on"]), last_json(r["off"])
    assert on["ranks"][0]["attention_forward_module"].startswith("hiera_autopatch.")
    assert off["ranks"][0]["attention_forward_module"] == "hiera.hiera"
    assert on["ranks"][0]["attention_class_is_hiera_class"] and off["ranks"][0]["attention_class_is_hiera_class"]
    assert len(on["losses"]) == len(off["losses"]) == 3
    for a, b in zip(on["losses"], off["losses"]):
        assert math.isfinite(a) and math.isclose(a, b, rel_tol=1e-3), (on["losses"], off["losses"])
    assert on["samples_per_s"] > 0


def test_torchrun_two_ranks_both_patched():
    """`torchrun --nproc-per-node 2 -m hiera_autopatch examples/train_mae.py`, gloo on CPU."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2", "-m", "hiera_autopatch", str(EXAMPLE), *SMALL]
    result = subprocess.run(
        cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600
    )
    assert result.returncode == 0, explain(result)
    report = last_json(result)
    assert report["world_size"] == 2
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert rank["attention_forward_module"].startswith("hiera_autopatch."), report["ranks"]
    assert all(math.isfinite(x) for x in report["losses"])
