"""Activation in every order, for every target, each in a fresh interpreter.

Targets: the PyPI package (``hiera``, ``hiera.hiera``, ``hiera.hiera_mae``), an in-tree copy
(``models.hiera``) and timm (``timm.models.hiera``). Orders: hook armed before import (the .pth,
from ``HIERA_OPTIM=1``), import before activation, activate twice, enable -> disable -> enable,
disable twice. "Patched" means the class attribute carries ``__hiera_autopatch__``.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import (
    MARKER,
    REPO,
    copy_fair_in_tree,
    explain,
    in_parallel,
    our_stderr_lines,
    requires_pth,
    run_code,
    run_python,
    write,
)

pytest.importorskip("hiera")
pytest.importorskip("timm")

# target module -> (the attention class it patches, a class the target itself defines). Listed in
# import order: FAIR's hiera imports timm.models.hiera (through timm.models), so timm goes first.
TARGETS = {
    "timm.models.hiera": ("timm.models.hiera.MaskUnitAttention", "timm.models.hiera.Hiera"),
    "models.hiera": ("models.hiera.MaskUnitAttention", "models.hiera.Hiera"),
    "hiera.hiera_mae": ("hiera.hiera.MaskUnitAttention", "hiera.hiera_mae.MaskedAutoencoderHiera"),
    "hiera.hiera": ("hiera.hiera.MaskUnitAttention", "hiera.hiera.Hiera"),
    "hiera": ("hiera.MaskUnitAttention", "hiera.MaskUnitAttention"),
}
ORDERS = ("armed_before_import", "import_before_activation", "activate_twice", "enable_disable_enable", "disable_twice")

# One fresh interpreter per order; in it, each target goes through that order (imported, checked
# right after its own import, enabled/disabled...). Problems are collected per target, not raised,
# so one target's failure does not hide another's. Prints one JSON line.
SCENARIO = r"""
import importlib, json, sys, traceback

TARGETS, ORDER, MARKER = {targets!r}, {order!r}, {marker!r}
facts = {{"torch_at_start": "torch" in sys.modules, "targets": {{t: {{"errors": []}} for t in TARGETS}}}}

def resolve(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)

def fail(target, message):
    facts["targets"][target]["errors"].append(message)

def forward_of(target):
    return resolve(TARGETS[target][0]).__dict__["forward"]

def check_patched(target):
    fwd = forward_of(target)
    if not getattr(fwd, MARKER, None):
        fail(target, f"{{TARGETS[target][0]}}.forward is not patched")
        return None
    original = fwd.__hiera_autopatch_original__
    if getattr(original, MARKER, None):
        fail(target, "patched twice: the original is itself a replacement")
    return original

def check_unpatched(target, original=None, when=""):
    fwd = forward_of(target)
    if getattr(fwd, MARKER, None):
        fail(target, f"{{TARGETS[target][0]}}.forward still patched {{when}}")
    elif original is not None and fwd is not original:
        fail(target, f"not the exact original function {{when}}")

def attention_instance(target):
    import torch
    torch.manual_seed(0)
    layer = resolve(TARGETS[target][0])(dim=16, dim_out=16, heads=2, q_stride=4, window_size=4, use_mask_unit_attn=True)
    x = torch.randn(2, 2 * 4 * 4, 16)  # (B, windows * q_stride * window_size, C)
    return layer, x

def check_same(target, a, b, when):
    if not bool((a - b).abs().max() < 1e-5):
        fail(target, f"attention output differs {{when}}")

def check_instance_kept(target, cls_id, layer):
    cls = resolve(TARGETS[target][0])
    if id(cls) != cls_id or not isinstance(layer, cls):
        fail(target, "class identity or isinstance lost")

def import_all():
    for target in TARGETS:
        importlib.import_module(target)

import hiera_autopatch
from hiera_autopatch import _bootstrap, _registry

try:
    if ORDER == "armed_before_import":
        assert _bootstrap._started, "HIERA_OPTIM=1 did not run the .pth (is the package installed?)"
        assert _registry.STATE.config.enabled and _registry.STATE.config.source == "env"
        for target in TARGETS:
            # hiera.hiera_mae's import runs hiera/__init__, which imports hiera.hiera: hooks were
            # armed at startup either way.
            facts["targets"][target]["imported_by_an_earlier_step"] = target in sys.modules
            importlib.import_module(target)
            check_patched(target)  # right after its own import
            layer, x = attention_instance(target)
            layer(x)

    elif ORDER == "import_before_activation":
        assert not _bootstrap._started, ".pth ran although HIERA_OPTIM is unset"
        import_all()
        before = {{}}
        for target in TARGETS:
            check_unpatched(target, when="before enable()")
            layer, x = attention_instance(target)
            before[target] = (id(resolve(TARGETS[target][0])), layer, x, layer(x))
        hiera_autopatch.enable()
        for target, (cls_id, layer, x, out) in before.items():
            check_patched(target)  # at once: it was imported already
            check_instance_kept(target, cls_id, layer)
            check_same(target, out, layer(x), "after enable()")

    elif ORDER == "activate_twice":
        hiera_autopatch.enable()
        hiera_autopatch.enable()
        import_all()
        originals = {{t: check_patched(t) for t in TARGETS}}
        n = len(_registry.STATE.log)
        hiera_autopatch.enable()
        _bootstrap.process_startup()
        _bootstrap.process_startup()
        for target in TARGETS:
            if len(_registry.STATE.log) != n:
                fail(target, "a second enable() applied something again")
            if check_patched(target) is not originals[target]:
                fail(target, "the replacement now wraps something else")
            layer, x = attention_instance(target)
            layer(x)

    elif ORDER == "enable_disable_enable":
        hiera_autopatch.enable()
        import_all()
        state = {{}}
        for target in TARGETS:
            layer, x = attention_instance(target)
            state[target] = (check_patched(target), id(resolve(TARGETS[target][0])), layer, x, layer(x))
        n = len(_registry.STATE.log)
        hiera_autopatch.disable()
        for target, (original, _, layer, x, first) in state.items():
            check_unpatched(target, original, "after disable()")
            check_same(target, first, layer(x), "after disable()")
        with hiera_autopatch.disabled():
            pass
        for target, (original, *_) in state.items():
            check_unpatched(target, original, "after disabled() while off")
        hiera_autopatch.enable()
        if len(_registry.STATE.log) != n:
            fail(next(iter(TARGETS)), f"log has {{len(_registry.STATE.log)}} entries after re-enable, {{n}} before")
        with hiera_autopatch.disabled():
            for target, (original, *_) in state.items():
                check_unpatched(target, original, "inside disabled()")
        for target, (original, cls_id, layer, x, first) in state.items():
            if check_patched(target) is not original:
                fail(target, "re-enabled replacement does not wrap the original")
            check_instance_kept(target, cls_id, layer)
            check_same(target, first, layer(x), "after re-enable")

    elif ORDER == "disable_twice":
        hiera_autopatch.enable()
        import_all()
        originals = {{t: check_patched(t) for t in TARGETS}}
        hiera_autopatch.disable()
        hiera_autopatch.disable()
        reverted_again = _registry.revert_all()
        for target in TARGETS:
            check_unpatched(target, originals[target], "after disable() twice")
            if reverted_again or _registry.STATE.log:
                fail(target, "the log is not empty after disable()")
            if hiera_autopatch.status()["enabled"] is not False:
                fail(target, "status says enabled after disable()")
            layer, x = attention_instance(target)
            layer(x)
except Exception:
    facts["crash"] = traceback.format_exc()

status = hiera_autopatch.status()["targets"]
for target, (attn, defined) in TARGETS.items():
    entry = facts["targets"][target]
    entry["defined_patched"] = sorted(
        k for k, v in vars(resolve(defined)).items() if getattr(v, MARKER, None)
    ) if target in sys.modules else None
    entry["status"] = status.get(target, {{}})
facts["hiera_identity"] = (
    "hiera" in sys.modules and sys.modules["hiera"].MaskUnitAttention is sys.modules["hiera.hiera"].MaskUnitAttention
    and sys.modules["hiera"].MaskedAutoencoderHiera is sys.modules["hiera.hiera_mae"].MaskedAutoencoderHiera
)
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One fresh interpreter per order (run two at a time), each covering every target."""
    if not __import__("conftest").pth_installed():
        pytest.skip("needs the .pth installed (pip install -e .)")
    cwd = copy_fair_in_tree(tmp_path_factory.mktemp("intree"))

    def scenario(order):
        code = SCENARIO.format(targets=TARGETS, order=order, marker=MARKER)
        env = {"HIERA_OPTIM": "1"} if order == "armed_before_import" else {}
        return run_code(code, env=env, cwd=cwd)

    return in_parallel({order: (lambda o=order: scenario(o)) for order in ORDERS})


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_order(results, target, order):
    result = results[order]
    assert result.returncode == 0, explain(result)
    assert not our_stderr_lines(result.stderr), explain(result)
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert "crash" not in facts, facts["crash"]
    assert facts["torch_at_start"] is False
    assert facts["hiera_identity"], "hiera re-exports are no longer hiera.hiera's / hiera.hiera_mae's classes"
    entry = facts["targets"][target]
    assert entry["errors"] == [], entry["errors"]
    if order == "disable_twice":
        assert entry["defined_patched"] == [], entry
        assert entry["status"].get("applied", []) == []
    else:
        assert entry["defined_patched"], f"nothing patched on {TARGETS[target][1]}"
        if target != "hiera":  # the package only re-exports; classes are patched where defined
            assert entry["status"]["applied"], entry["status"]


# --- the .pth file ---------------------------------------------------------------------------


@requires_pth
def test_pth_off_and_startup_cost():
    """HIERA_OPTIM unset, 0 or off: the .pth imports nothing of ours and Hiera stays as FAIR wrote
    it. HIERA_OPTIM=1 with no target imported: hooks armed, torch not imported."""
    off_code = """
        import sys
        assert not any(m.startswith("hiera_autopatch") for m in sys.modules), "the .pth imported us"
        if IMPORT_HIERA:
            import hiera
            assert not getattr(hiera.MaskUnitAttention.forward, "__hiera_autopatch__", None)
            assert not any(m.startswith("hiera_autopatch") for m in sys.modules)
        print("ok")
    """
    on_code = """
        import sys
        from hiera_autopatch import _bootstrap, _registry
        assert _bootstrap._started and _registry.STATE.config.enabled
        assert sorted(_bootstrap._armed) == sorted(_registry.targets_for(_registry.STATE.config))
        bad = [m for m in ("torch", "hiera", "timm", "numpy") if m in sys.modules]
        assert not bad, f"imported at startup: {bad}"
        print("ok")
    """
    # What the .start file calls (Python 3.15+) with HIERA_OPTIM unset: returns before importing
    # the config parser.
    start_code = """
        import sys
        from hiera_autopatch import _bootstrap
        _bootstrap.process_startup()
        assert not _bootstrap._armed and "hiera_autopatch._config" not in sys.modules
        assert "dataclasses" not in sys.modules or "dataclasses" in BEFORE
        print("ok")
    """
    jobs = {
        "unset": lambda: run_code("IMPORT_HIERA = True\n" + textwrap.dedent(off_code)),
        "zero": lambda: run_code("IMPORT_HIERA = False\n" + textwrap.dedent(off_code), env={"HIERA_OPTIM": "0"}),
        "off": lambda: run_code("IMPORT_HIERA = False\n" + textwrap.dedent(off_code), env={"HIERA_OPTIM": " Off "}),
        "on": lambda: run_code(on_code, env={"HIERA_OPTIM": "yes"}),
        "start_off": lambda: run_code(
            "import sys; BEFORE = set(sys.modules)\n" + textwrap.dedent(start_code)
        ),
    }
    for name, result in in_parallel(jobs).items():
        assert result.returncode == 0 and result.stdout.strip() == "ok", f"{name}: {explain(result)}"
        assert not result.stderr.strip(), f"{name}: {explain(result)}"


def test_pth_line_is_cheap_when_off():
    """The line itself, HIERA_OPTIM unset: one environment lookup, far under 2 ms."""
    line = (REPO / "hiera_autopatch.pth").read_text().strip()
    assert "\n" not in line and line.startswith("import ")
    code = f"""
        import os, sys, time
        os.environ.pop("HIERA_OPTIM", None)
        line = {line!r}
        n = 2000
        start = time.perf_counter()
        for _ in range(n):
            exec(line)
        per_call = (time.perf_counter() - start) / n
        assert "hiera_autopatch" not in sys.modules
        print(per_call)
    """
    result = run_code(code)
    assert result.returncode == 0, explain(result)
    assert float(result.stdout) < 1e-3, f"{float(result.stdout) * 1e3:.3f} ms per interpreter start"


def test_pth_survives_missing_package(tmp_path):
    """A half-uninstalled package (the .pth left behind) never breaks Python: one line, exit 0."""
    line = (REPO / "hiera_autopatch.pth").read_text().strip()
    code = f"import os; os.environ['HIERA_OPTIM'] = '1'; exec({line!r}); print('alive')"
    # -I -S: no site-packages and no working directory on sys.path, so the package is not found.
    result = run_python(["-I", "-S", "-c", code], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "alive", explain(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "hiera_autopatch: not started" in lines[0], explain(result)


def test_pth_and_start_files_name_the_entry_point():
    from hiera_autopatch import _bootstrap, _config

    import pkgutil

    start = (REPO / "hiera_autopatch.start").read_text().split()
    assert start == ["hiera_autopatch._bootstrap:process_startup"]
    assert pkgutil.resolve_name(start[0]) is _bootstrap.process_startup  # as PEP 829 resolves it
    line = (REPO / "hiera_autopatch.pth").read_text()
    off_words = line.split("not in (")[1].split(")")[0]
    assert set(eval("(" + off_words + ")")) == set(_config.FALSE_WORDS) == set(_bootstrap._OFF_WORDS)
    assert "torch" not in line


# --- env variables, each in a fresh interpreter ------------------------------------------------


@requires_pth
def test_env_variables(fair_in_tree):
    """Bad values warn once and change nothing else; DISABLE, VERBOSE, MODULES do what they say."""
    # An in-tree copy under a name nobody watches by default, for HIERA_OPTIM_MODULES.
    copy_fair_in_tree(fair_in_tree, "research.backbones")
    patched = "bool(getattr({}, '__hiera_autopatch__', None))"
    jobs = {
        # Off because of the bad value: nothing armed; the program runs.
        "bad_switch": lambda: run_code(
            "from hiera_autopatch import _bootstrap, _registry; "
            "print(sorted(_bootstrap._armed), _registry.STATE.config.enabled)",
            env={"HIERA_OPTIM": "maybe"},
        ),
        # A bad VERBOSE value warns once and is treated as off: no other line; patching still on.
        "bad_verbose": lambda: run_code(
            f"import hiera; print({patched.format('hiera.MaskUnitAttention.forward')})",
            env={"HIERA_OPTIM": "1", "HIERA_OPTIM_VERBOSE": "loud"},
        ),
        "disable_verbose_modules": lambda: run_code(
            f"""
            import json, hiera, timm.models.hiera, research.backbones.hiera as copy, hiera_autopatch
            status = hiera_autopatch.status()["targets"]
            print(json.dumps({{
                "attention": {patched.format('hiera.MaskUnitAttention.forward')},
                "encoder": {patched.format('hiera.Hiera.forward')},
                "copy_encoder": {patched.format('copy.Hiera.forward')},
                "copy_attention": {patched.format('copy.MaskUnitAttention.forward')},
                "skipped": status["hiera.hiera"]["skipped"],
                "copy_status": status["research.backbones.hiera"],
            }}))
            """,
            env={
                "HIERA_OPTIM": "1",
                "HIERA_OPTIM_VERBOSE": "1",
                "HIERA_OPTIM_DISABLE": " fair.attention, no.such.patch ,",
                "HIERA_OPTIM_MODULES": "research.backbones.hiera",
            },
            cwd=fair_in_tree,
        ),
    }
    results = in_parallel(jobs)

    r = results["bad_switch"]
    assert r.returncode == 0 and r.stdout.split() == ["[]", "False"], explain(r)
    lines = our_stderr_lines(r.stderr)
    assert len(lines) == 1 and "HIERA_OPTIM='maybe'" in lines[0], explain(r)

    r = results["bad_verbose"]
    assert r.returncode == 0 and r.stdout.strip() == "True", explain(r)
    assert r.stderr.strip().splitlines() == our_stderr_lines(r.stderr), explain(r)  # nothing else
    lines = our_stderr_lines(r.stderr)
    assert len(lines) == 1 and "HIERA_OPTIM_VERBOSE='loud'" in lines[0], explain(r)

    r = results["disable_verbose_modules"]
    assert r.returncode == 0, explain(r)
    facts = json.loads(r.stdout)
    assert facts["attention"] is False and facts["encoder"] is True, facts
    assert facts["copy_attention"] is False and facts["copy_encoder"] is True, facts
    assert "HIERA_OPTIM_DISABLE" in facts["skipped"]["fair.attention"]
    assert facts["copy_status"]["version"] == "in-tree copy"
    lines = our_stderr_lines(r.stderr)
    unknown = [line for line in lines if "no.such.patch" in line]
    assert len(unknown) == 1, explain(r)
    assert "fair.attention" in unknown[0] and "timm.attention" in unknown[0]  # names the known ones
    verbose = sorted(line.split(":")[1].strip() for line in lines if line not in unknown)
    assert verbose == ["hiera.hiera", "hiera.hiera_mae", "research.backbones.hiera", "timm.models.hiera"], explain(r)
    assert r.stderr.strip().splitlines() == lines, explain(r)  # nothing but our lines


@requires_pth
def test_hook_failure_leaves_class_and_import_intact(tmp_path):
    """Patching that fails inside the hook: one report line, the user's import succeeds, the class
    is left as it was."""
    write(tmp_path / "models" / "__init__.py", "")
    write(
        tmp_path / "models" / "hiera.py",
        """
        class _ReadOnly(type):
            def __setattr__(cls, name, value):
                raise RuntimeError("read-only class")

        class MaskUnitAttention(metaclass=_ReadOnly):
            def forward(self, x):
                return x + 1
        """,
    )
    # FORCE skips the source check, so the patch really tries (and fails) to set the attribute.
    result = run_code(
        """
        import models.hiera as m
        print(getattr(m.MaskUnitAttention.forward, "__hiera_autopatch__", None), m.MaskUnitAttention().forward(1))
        """,
        env={"HIERA_OPTIM": "1", "HIERA_OPTIM_FORCE": "fair.attention"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, explain(result)
    assert result.stdout.split() == ["None", "2"], explain(result)
    lines = our_stderr_lines(result.stderr)
    assert len(lines) == 1 and "models.hiera" in lines[0] and "read-only class" in lines[0], explain(result)
