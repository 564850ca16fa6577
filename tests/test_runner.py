"""``python -m hiera_autopatch`` run for real: the user's program must not see the difference
from ``python`` (argv, sys.path[0], __main__, exit code, traceback), only that Hiera is patched."""

from __future__ import annotations

import json

import pytest

from conftest import explain, in_parallel, our_stderr_lines, requires_pth, run_python, write

RUNNER = ["-m", "hiera_autopatch"]

FACTS = """
import json, os, sys
import hiera_autopatch
status = hiera_autopatch.status() if "hiera_autopatch._registry" in sys.modules else {"enabled": False, "enabled_by": ""}
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "file": globals().get("__file__"),
    "main_is_this": sys.modules["__main__"].__dict__ is globals(),
    "env": {k: v for k, v in os.environ.items() if k.startswith("HIERA_OPTIM")},
    "enabled": status["enabled"],
    "enabled_by": status["enabled_by"],
    "disabled": status.get("disabled_patches", []),
    "start_method": __import__("multiprocessing").get_start_method(allow_none=True),
}))
code = int(os.environ.get("EXIT_WITH", "0"))
if code:
    sys.exit(code)
"""


def facts(result):
    assert result.stdout.strip(), explain(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def project(tmp_path):
    """A user's project: a script in a subfolder, a package with a module, run from the root."""
    write(tmp_path / "sub" / "train.py", FACTS)
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "train.py", FACTS)
    write(
        tmp_path / "sub" / "crash.py",
        """
        def inner():
            raise ValueError("boom from user code")

        def outer():
            inner()

        outer()
        """,
    )
    return tmp_path


def test_script_module_and_code_see_what_python_gives_them(project):
    jobs = {
        "script": lambda: run_python([*RUNNER, "sub/train.py", "--lr", "3", "--off"], cwd=project),
        "script_plain": lambda: run_python(["sub/train.py", "--lr", "3", "--off"], cwd=project),
        "module": lambda: run_python([*RUNNER, "-m", "pkg.train", "a", "-c", "b"], cwd=project),
        "module_plain": lambda: run_python(["-m", "pkg.train", "a", "-c", "b"], cwd=project),
        "code": lambda: run_python([*RUNNER, "-c", FACTS, "x", "--y"], cwd=project),
        "code_plain": lambda: run_python(["-c", FACTS, "x", "--y"], cwd=project),
        "exit": lambda: run_python([*RUNNER, "sub/train.py"], cwd=project, env={"EXIT_WITH": "7"}),
    }
    r = in_parallel(jobs)
    for kind in ("script", "module", "code"):
        ours, plain = facts(r[kind]), facts(r[f"{kind}_plain"])
        assert r[kind].returncode == 0, explain(r[kind])
        for key in ("argv", "path0", "name", "file", "main_is_this", "start_method"):
            assert ours[key] == plain[key], f"{kind} {key}: runner {ours[key]!r} vs python {plain[key]!r}"
        # The runner turned patching on and exported it, so children inherit it.
        assert ours["enabled"] is True and ours["enabled_by"] == "runner", ours
        assert ours["env"]["HIERA_OPTIM"] == "1" and ours["env"]["HIERA_OPTIM_RUNNER"] == "1"
        assert ours["start_method"] is None  # multiprocessing left alone
    assert facts(r["script"])["argv"] == ["sub/train.py", "--lr", "3", "--off"]  # options after the script are its own
    assert facts(r["script"])["path0"] == str(project / "sub")
    assert facts(r["code"])["argv"] == ["-c", "x", "--y"]
    assert r["exit"].returncode == 7, explain(r["exit"])


def test_off_disable_verbose_and_explicit_env(project):
    jobs = {
        "off": lambda: run_python([*RUNNER, "--off", "sub/train.py"], cwd=project),
        "user_zero": lambda: run_python([*RUNNER, "sub/train.py"], cwd=project, env={"HIERA_OPTIM": "0"}),
        "flags": lambda: run_python(
            [*RUNNER, "--verbose", "--disable", "fair.mae_loss", "sub/train.py"],
            cwd=project,
            env={"HIERA_OPTIM_DISABLE": "timm.attention"},
        ),
        "bad_value": lambda: run_python([*RUNNER, "sub/train.py"], cwd=project, env={"HIERA_OPTIM": "sometimes"}),
        "nested": lambda: run_python([*RUNNER, "--disable=fair.encoder", *RUNNER, "sub/train.py", "z"], cwd=project),
    }
    r = in_parallel(jobs)
    for name, result in r.items():
        assert result.returncode == 0, f"{name}: {explain(result)}"

    off = facts(r["off"])
    assert off["enabled"] is False and off["env"]["HIERA_OPTIM"] == "0"
    user_zero = facts(r["user_zero"])
    assert user_zero["enabled"] is False and user_zero["env"]["HIERA_OPTIM"] == "0"

    flags = facts(r["flags"])
    assert flags["enabled"] is True
    assert flags["env"]["HIERA_OPTIM_DISABLE"] == "timm.attention,fair.mae_loss"
    assert flags["env"]["HIERA_OPTIM_VERBOSE"] == "1"
    assert sorted(flags["disabled"]) == ["fair.mae_loss", "timm.attention"]

    bad = r["bad_value"]
    lines = our_stderr_lines(bad.stderr)
    assert len(lines) == 1 and "HIERA_OPTIM='sometimes'" in lines[0], explain(bad)
    assert facts(bad)["enabled"] is False
    assert facts(bad)["env"]["HIERA_OPTIM"] == "0"  # children get the decision, not the warning

    # The runner run through the runner runs the program once, no loop.
    nested = r["nested"]
    assert nested.stdout.count('"argv"') == 1, explain(nested)
    assert facts(nested)["argv"] == ["sub/train.py", "z"] and facts(nested)["enabled"] is True
    assert facts(nested)["disabled"] == ["fair.encoder"]


def test_errors_look_like_pythons(project):
    jobs = {
        "crash": lambda: run_python([*RUNNER, "sub/crash.py"], cwd=project),
        "crash_plain": lambda: run_python(["sub/crash.py"], cwd=project),
        "code_crash": lambda: run_python([*RUNNER, "-c", "import sys\n1/0"], cwd=project),
        "missing": lambda: run_python([*RUNNER, "sub/nope.py", "--x"], cwd=project),
        "missing_module": lambda: run_python([*RUNNER, "-m", "no_such_module_xyz"], cwd=project),
        "syntax": lambda: run_python([*RUNNER, "-c", "x = ("], cwd=project),
        "usage": lambda: run_python([*RUNNER], cwd=project),
        "unknown_option": lambda: run_python([*RUNNER, "--fast", "sub/train.py"], cwd=project),
        "system_exit_msg": lambda: run_python([*RUNNER, "-c", "raise SystemExit('bye')"], cwd=project),
    }
    r = in_parallel(jobs)

    crash, plain = r["crash"], r["crash_plain"]
    assert crash.returncode == plain.returncode == 1
    assert crash.stderr == plain.stderr, f"runner:\n{crash.stderr}\npython:\n{plain.stderr}"
    assert "hiera_autopatch" not in crash.stderr and "runpy" not in crash.stderr

    code_crash = r["code_crash"].stderr
    assert r["code_crash"].returncode == 1
    assert code_crash.splitlines()[1].strip() == 'File "<string>", line 2, in <module>', code_crash
    assert "hiera_autopatch" not in code_crash and "ZeroDivisionError" in code_crash

    missing = r["missing"]
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr, explain(missing)
    assert "can't open file" in missing.stderr and "nope.py" in missing.stderr

    missing_module = r["missing_module"]
    assert missing_module.returncode == 1 and "Traceback" not in missing_module.stderr, explain(missing_module)
    assert missing_module.stderr.count("\n") == 1 and "no_such_module_xyz" in missing_module.stderr

    syntax = r["syntax"]
    assert syntax.returncode == 1 and "SyntaxError" in syntax.stderr and "hiera_autopatch" not in syntax.stderr

    for name in ("usage", "unknown_option"):
        assert r[name].returncode == 2 and "usage:" in r[name].stderr, explain(r[name])
    assert "--fast" in r["unknown_option"].stderr

    assert r["system_exit_msg"].returncode == 1 and r["system_exit_msg"].stderr.strip() == "bye"


@requires_pth
def test_spawn_children_inherit_the_state(tmp_path):
    """multiprocessing spawn children (fresh interpreters) get the runner's decision via the env."""
    write(
        tmp_path / "spawner.py",
        """
        import multiprocessing as mp, os, sys

        def child(queue, import_hiera):
            state = {"HIERA_OPTIM": os.environ.get("HIERA_OPTIM")}
            state["armed"] = "hiera_autopatch._bootstrap" in sys.modules and bool(
                sys.modules["hiera_autopatch._bootstrap"]._armed
            )
            if import_hiera:
                import hiera
                state["patched"] = bool(getattr(hiera.MaskUnitAttention.forward, "__hiera_autopatch__", None))
            queue.put(state)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue, sys.argv[1] == "import"))
            proc.start()
            state = queue.get(timeout=240)
            proc.join()
            print(sorted(state.items()))
            sys.exit(proc.exitcode)
        """,
    )
    r = in_parallel(
        {
            "on": lambda: run_python([*RUNNER, "spawner.py", "import"], cwd=tmp_path),
            "off": lambda: run_python([*RUNNER, "--off", "spawner.py", "no"], cwd=tmp_path),
        }
    )
    assert r["on"].returncode == 0, explain(r["on"])
    assert r["on"].stdout.strip() == "[('HIERA_OPTIM', '1'), ('armed', True), ('patched', True)]", explain(r["on"])
    assert r["off"].returncode == 0, explain(r["off"])
    assert r["off"].stdout.strip() == "[('HIERA_OPTIM', '0'), ('armed', False)]", explain(r["off"])


def test_status_command():
    pytest.importorskip("hiera")
    r = in_parallel(
        {
            "text": lambda: run_python([*RUNNER, "status"]),
            "json": lambda: run_python(
                [*RUNNER, "status", "--json"], env={"HIERA_OPTIM": "1", "HIERA_OPTIM_DISABLE": "fair.attention"}
            ),
            "no_import": lambda: run_python([*RUNNER, "status", "--no-import", "--json"]),
            "version": lambda: run_python([*RUNNER, "--version"]),
        }
    )
    import hiera_autopatch

    text = r["text"]
    assert text.returncode == 0, explain(text)
    assert f"hiera_autopatch {hiera_autopatch.__version__}" in text.stdout
    assert "patching: off" in text.stdout
    assert "hiera.hiera" in text.stdout and "fair.attention" in text.stdout and "applied" in text.stdout
    assert "attention kernels: our Triton kernel under torch.compile" in text.stdout  # auto's rule

    report = json.loads(r["json"].stdout)
    assert report["enabled"] is True and report["enabled_by"] == "env"
    assert report["version"] == hiera_autopatch.__version__
    target = report["targets"]["hiera.hiera"]
    assert target["imported"] and target["implementation"] == "fair" and "hiera-transformer" in target["version"]
    assert "fair.attention" in target["skipped"] and "fair.encoder" in target["applied"]
    assert report["targets"]["models.hiera"]["imported"] is False

    bare = json.loads(r["no_import"].stdout)
    assert bare["enabled"] is False and not any(t["imported"] for t in bare["targets"].values())
    assert r["version"].stdout.strip() == f"hiera_autopatch {hiera_autopatch.__version__}"


def test_bench_subcommand_is_dispatched():
    import importlib.util

    if importlib.util.find_spec("hiera_autopatch.bench") is None:
        pytest.skip("hiera_autopatch.bench is not there yet")
    result = run_python([*RUNNER, "bench", "--help"])
    assert result.returncode == 0, explain(result)
    assert "usage" in result.stdout.lower()
