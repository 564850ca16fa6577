"""The benchmark command itself, on CPU: arguments, a tiny end-to-end run, JSON, plot, numerics check,
the subprocess path, the matrix script and the README table script.

Everything that turns patching on runs in a fresh interpreter (as conftest.py asks), all of those
at once in one module fixture; argument checks and pure functions run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

import pytest
from conftest import explain, in_parallel, run_python

from hiera_autopatch import _bench_run, bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--device", "cpu", "--res", "64", "--batch", "2", "--steps", "2", "--warmup", "1", "--quiet"]
QUICK = ["--no-profile", "--steps", "1", "--warmup", "0"]

SCENARIOS = """
    # Several runs in one interpreter (each interpreter start costs seconds of imports): a run
    # without hiera-optim installed, then two runs whose patched side is simply wrong (the MAE loss
    # comes back scaled by 1.5). Prints {name: {code, stdout, stderr}} as JSON.
    import contextlib, io, json, sys
    from hiera import hiera_mae
    from hiera_autopatch import _bench_run, bench

    argv, json_path = sys.argv[1:-1], sys.argv[-1]
    out = {}

    def run(name, args):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = bench.main(args)
        out[name] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}

    _bench_run.hiera_optim_available = lambda: False
    run("no_hiera_optim", argv + ["--hiera-optim", "--json", json_path])

    cls = hiera_mae.MaskedAutoencoderHiera
    pristine = cls.__dict__["forward"]
    real_apply = _bench_run.apply_side

    def apply_side(side, extra_modules=(), options=None):
        real_apply(side, extra_modules, options)
        if side == "patched":
            current = cls.__dict__["forward"]

            def forward(self, x, mask_ratio=0.6, mask=None):
                loss, *rest = current(self, x, mask_ratio, mask)
                return (loss * 1.5, *rest)

            cls.forward = forward
        else:
            cls.forward = pristine

    _bench_run.apply_side = apply_side
    run("wrong_fp32", argv + ["--dtype", "fp32"])
    run("wrong_bf16", argv + ["--dtype", "bf16"])
    print(json.dumps(out))
"""

MATRIX_WITH_A_BROKEN_CELL = """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("bench_matrix", "scripts/bench_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    sys.modules["bench_matrix"] = matrix
    spec.loader.exec_module(matrix)
    matrix.default_cells = lambda: [
        matrix.Cell("broken", "mae_hiera_nonexistent_224"),
        matrix.Cell("T-MAE", "mae_hiera_tiny_224"),
    ]
    sys.exit(matrix.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run that patches, each in its own interpreter, all at once: {name: (result, folder)}."""
    folder = tmp_path_factory.mktemp("bench_runs")
    bench_cmd = ["-m", "hiera_autopatch.bench"]
    jobs = {
        "tiny": bench_cmd + TINY + ["--json", str(folder / "tiny.json"), "--plot", str(folder / "tiny.png")],
        "scenarios": ["-c", textwrap.dedent(SCENARIOS)] + TINY + QUICK + [str(folder / "no_hiera_optim.json")],
        "isolated": bench_cmd + TINY + ["--isolate", "--no-profile", "--steps", "1", "--json", str(folder / "isolated.json")],
        "matrix": ["-c", textwrap.dedent(MATRIX_WITH_A_BROKEN_CELL), "--tiny", "--device", "cpu", "--steps", "1",
                   "--no-profile", "--quiet", "--json", str(folder / "matrix.json")],
    }
    results = in_parallel({name: (lambda args=args: run_python(args, cwd=ROOT, timeout=600)) for name, args in jobs.items()})
    return {name: (result, folder) for name, result in results.items()}


def _scenario(runs, name) -> dict:
    result, _ = runs["scenarios"]
    assert result.returncode == 0, explain(result)
    return json.loads(result.stdout.strip().splitlines()[-1])[name]


def _json(runs, name, run="") -> dict:
    result, folder = runs[run or name]
    path = folder / f"{name}.json"
    assert path.exists(), explain(result)
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Timings are not asserted here; one thread keeps a shared CI box from oversubscribing."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--batch", "x"], "--batch"),
        (["--batch", "0"], "--batch"),
        (["--bogus"], "--bogus"),
        (["--model-kwargs", "{not json"], "--model-kwargs"),
        (["--model-kwargs", "[1, 2]"], "--model-kwargs"),
        (["--dtype", "int8"], "--dtype"),
        (["--mode", "fast"], "--mode"),
        (["--res", "64", "--input-size", "64x64"], "--input-size"),
        (["--input-size", "64x"], "--input-size"),
        (["--mask-ratio", "1.5"], "--mask-ratio"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_argument_is_one_line_naming_the_flag(argv, flag, capsys):
    assert bench.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert flag in lines[0] and "Traceback" not in err
    assert out == ""


def test_unknown_model_is_a_usage_error(capsys):
    assert bench.main(["--model", "mae_hiera_nonexistent_224"] + TINY) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0] and "mae_hiera_nonexistent_224" in err[0]


def test_model_that_refuses_its_kwargs_is_a_usage_error(capsys):
    assert bench.main(["--model-kwargs", '{"no_such_argument": 1}'] + TINY) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model-kwargs" in err[0] and "no_such_argument" in err[0]


def test_help_exits_zero(capsys):
    assert bench.main(["--help"]) == 0
    assert "--model-kwargs" in capsys.readouterr().out


def test_model_kwargs_override_the_factory_and_leave_hiera_intact():
    import torch
    import hiera
    from hiera import hiera_mae

    spec = _bench_run.Spec(
        model="mae_hiera_tiny_224",
        model_kwargs={**_bench_run.TINY_MAE_KWARGS, "q_pool": 3},
        res=64,
        device="cpu",
        dtype="fp32",
    )
    built = _bench_run.build_model(spec, torch.device("cpu"))
    assert built.model.q_pool == 3 and built.task == "mae"
    assert built.input_size == (64, 64) and built.in_chans == 3
    assert isinstance(hiera_mae.MaskedAutoencoderHiera, type)  # the capture put the class back
    assert isinstance(hiera.hiera.Hiera, type)


def test_model_name_syntax():
    assert _bench_run.parse_model_name("mae_hiera_base_224") == ("fair", "hiera", "mae_hiera_base_224")
    assert _bench_run.parse_model_name("timm:hiera_base_224") == ("timm", "timm", "hiera_base_224")
    assert _bench_run.parse_model_name("models.hiera:mae_hiera_base_224") == ("factory", "models.hiera", "mae_hiera_base_224")
    with pytest.raises(_bench_run.BenchError):
        _bench_run.parse_model_name("models.hiera:")


# ------------------------------------------------------------------------------------------
# End to end (fresh interpreters)


def test_tiny_run_succeeds_and_numerics_agree(runs):
    result, _ = runs["tiny"]
    cell = _json(runs, "tiny")["results"][0]
    assert cell["error"] is None
    assert cell["numerics"]["ok"], cell["numerics"]["problems"]
    assert result.returncode == 0, explain(result)
    assert "x" in result.stdout and "numerics" in result.stdout and "% faster" not in result.stdout


def test_json_schema(runs):
    record = _json(runs, "tiny")
    assert record["schema"] == "hiera_autopatch.bench/1"
    env = record["environment"]
    for key in ("torch", "triton", "cudnn", "device", "command", "hiera_autopatch", "python",
                "git_commit", "git_package_modified", "source_digest"):
        assert key in env
    assert len(env["source_digest"]) == 16
    assert env["command"].startswith("python -m hiera_autopatch bench --device cpu")
    (cell,) = record["results"]
    config = cell["config"]
    for key in ("model", "input_size", "in_chans", "batch", "mask_ratio", "model_kwargs", "dtype", "mode", "task", "steps"):
        assert key in config
    assert config["input_size"] == [64, 64] and config["batch"] == 2 and config["task"] == "mae"
    assert set(cell["sides"]) == {"unpatched", "patched"}
    for side in cell["sides"].values():
        for key in ("ms_median", "ms_min", "ms_max", "ms_all", "samples_per_s", "peak_mem_bytes", "compile_s", "warmup_s", "patches", "attention"):
            assert key in side
        assert len(side["ms_all"]) == 2 and side["ms_min"] <= side["ms_median"] <= side["ms_max"]
        assert "backends" in side["attention"]
        assert side["pipelined_ms"] > 0  # the same steps back to back, one sync at the end
    assert cell["sides"]["unpatched"]["patches"]["active"] == []
    assert cell["speedup"] == pytest.approx(cell["sides"]["unpatched"]["ms_median"] / cell["sides"]["patched"]["ms_median"])
    assert cell["pipelined_speedups"]["patched"] == pytest.approx(
        cell["sides"]["unpatched"]["pipelined_ms"] / cell["sides"]["patched"]["pipelined_ms"])
    for key in ("loss_abs_diff", "loss_rel_diff", "grad_max_abs_diff", "grad_max_rel_norm_diff", "limits", "ok"):
        assert key in cell["numerics"]


def test_source_digest_names_the_package_code(tmp_path):
    """The digest follows the package's .py files (contents and names), nothing else."""
    import shutil

    from hiera_autopatch import _bench_report

    package = tmp_path / "hiera_autopatch"
    shutil.copytree(os.path.dirname(_bench_report.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    first = _bench_report.source_digest(str(package))
    assert first == _bench_report.source_digest() and len(first) == 16
    (package / "notes.txt").write_text("not code")
    assert _bench_report.source_digest(str(package)) == first
    with open(package / "ops" / "attention.py", "a") as f:
        f.write("\n# changed\n")
    assert _bench_report.source_digest(str(package)) != first


def test_plot_is_a_png(runs):
    result, folder = runs["tiny"]
    with open(folder / "tiny.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", explain(result)


def test_stdout_table_from_json(runs):
    from hiera_autopatch import _bench_report

    text = _bench_report.format_record(_json(runs, "tiny"))
    assert "unpatched" in text and "patched" in text and "1.00x" in text and "numerics" in text
    assert "no per-step sync" in text


# ------------------------------------------------------------------------------------------
# The numerics check catches a wrong patch


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_numerics_check_fails_for_a_wrong_patch(runs, dtype):
    run = _scenario(runs, f"wrong_{dtype}")
    assert run["code"] == 3, run
    assert "MISMATCH" in run["stdout"]


def test_compare_flags_missing_and_nonfinite_gradients():
    import torch

    g = {"a": torch.ones(3), "b": torch.ones(2)}
    loss = torch.tensor(1.0)
    ref = (loss, g)
    assert _bench_run.compare(ref, (loss, dict(g)), "fp32")["ok"]
    assert not _bench_run.compare(ref, (loss, {"a": g["a"], "b": None}), "fp32")["ok"]
    assert not _bench_run.compare(ref, (loss, {"a": torch.full((3,), float("nan")), "b": g["b"]}), "fp32")["ok"]
    assert not _bench_run.compare(ref, (loss, {"a": g["a"] * 1.01, "b": g["b"]}), "fp32")["ok"]
    small = _bench_run.compare(ref, (loss * (1 + 1e-3), {"a": g["a"] * 1.01, "b": g["b"]}), "bf16")
    assert small["ok"] and small["grad_max_rel_norm_param"] == "a"


def test_low_precision_numerics_are_judged_against_fp32():
    import torch

    g32 = {"w": torch.ones(4), "v": torch.ones(4)}
    golden = (torch.tensor(1.0), g32)
    # unpatched bf16 is 30% off on w (real bf16 gradients can be that far off); patched as far: fine
    ref = (torch.tensor(1.001), {"w": g32["w"] * 1.3, "v": g32["v"]})
    same_noise = (torch.tensor(1.001), {"w": g32["w"] * 0.7, "v": g32["v"] * 1.01})
    result = _bench_run.compare(ref, same_noise, "bf16", golden)
    assert result["ok"], result["problems"]
    assert result["method"] == "against an fp32 reference"
    # patched is 50% off where unpatched is exact: wrong
    wrong = (torch.tensor(1.001), {"w": g32["w"] * 1.3, "v": g32["v"] * 1.5})
    result = _bench_run.compare(ref, wrong, "bf16", golden)
    assert not result["ok"] and result["grad_worst_param"] == "v"
    # the loss too
    result = _bench_run.compare(ref, (torch.tensor(1.5), ref[1]), "amp", golden)
    assert not result["ok"] and "loss" in result["problems"][0]


def test_attention_backend_names():
    names = {
        "aten::_scaled_dot_product_attention_math": 2,
        "aten::_scaled_dot_product_flash_attention": 1,
        "aten::_scaled_dot_product_cudnn_attention": 1,
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 1,
    }
    assert set(_bench_run.attention_backends(names)) == {"math", "flash", "cudnn", "efficient"}
    # ours, as the profiler names them inside a CUDA graph (H200 run, h200_bench_graphs.json)
    ours = {"_window_attention_fwd_kernel": 32, "_window_attention_bwd_dkdv_kernel": 32}
    assert _bench_run.attention_backends(ours) == ["triton"]
    assert _bench_run.attention_backends({"hiera_autopatch::window_attention": 8}) == ["triton"]


def test_hiera_optim_side_is_skipped_cleanly_when_absent(runs):
    run = _scenario(runs, "no_hiera_optim")
    assert run["code"] == 0, run
    assert "third side skipped" in run["stderr"]
    cell = _json(runs, "no_hiera_optim", run="scenarios")["results"][0]
    assert set(cell["sides"]) == {"unpatched", "patched"} and "hiera_optim" in cell["note"]


def test_hiera_optim_shims(monkeypatch):
    """The two shims FACTS.md names, applied before hiera-optim's optimize() sees the model."""
    import types

    import hiera
    import torch

    seen = {}

    def optimize(model):
        seen["fusion"] = hasattr(hiera, "apply_fusion_head")
        seen["ckpt"] = model._grad_checkpointing
        return model

    monkeypatch.setitem(sys.modules, "hiera_optim", types.SimpleNamespace(optimize=optimize))
    had = hasattr(hiera, "apply_fusion_head")
    saved = getattr(hiera, "apply_fusion_head", None)
    if had:
        delattr(hiera, "apply_fusion_head")
    try:
        model = torch.nn.Linear(2, 2)
        assert _bench_run.apply_hiera_optim_side(model) is model
        assert seen == {"fusion": True, "ckpt": False}
    finally:
        if had:
            hiera.apply_fusion_head = saved
        elif hasattr(hiera, "apply_fusion_head"):
            delattr(hiera, "apply_fusion_head")


# ------------------------------------------------------------------------------------------
# Sides in fresh processes (the path compile and reduce-overhead take)


def test_isolated_sides_run_in_child_processes(runs):
    result, _ = runs["isolated"]
    cell = _json(runs, "isolated")["results"][0]
    assert result.returncode == 0, explain(result)
    assert cell["sides"]["unpatched"]["ms_median"] > 0 and cell["sides"]["patched"]["ms_median"] > 0
    assert cell["sides"]["unpatched"]["pipelined_ms"] > 0 and cell["sides"]["patched"]["pipelined_ms"] > 0
    assert cell["sides"]["unpatched"]["param_checksum"] == cell["sides"]["patched"]["param_checksum"]
    assert cell["numerics"]["ok"], cell["numerics"]["problems"]
    assert cell["sides"]["unpatched"]["patches"]["active"] == []
    assert cell["sides"]["patched"]["patches"]["for_model"]  # enable() in the child reached FAIR's classes


# ------------------------------------------------------------------------------------------
# Matrix and README table scripts


def test_matrix_records_a_failing_cell_and_goes_on(runs):
    result, folder = runs["matrix"]
    record = _json(runs, "matrix")
    broken, good = record["results"]
    assert "mae_hiera_nonexistent_224" in broken["error"]
    assert good["error"] is None and good["speedup"] and good["config"]["label"] == "T-MAE"
    assert result.returncode == 1, explain(result)
    assert (folder / "matrix.png").exists()


def test_matrix_budget_skips_and_records(tmp_path):
    matrix = _load_script("bench_matrix")
    json_path = str(tmp_path / "b.json")
    assert matrix.main(["--only", "*/compile", "--budget-s", "1", "--device", "cpu", "--json", json_path]) == 0
    with open(json_path) as f:
        results = json.load(f)["results"]
    assert results and all("budget" in r["skipped"] for r in results)


def test_matrix_selection():
    matrix = _load_script("bench_matrix")
    cells = matrix.default_cells()
    modes = {c.mode for c in cells}
    assert modes == {"eager", "compile", "reduce-overhead"}
    assert any(c.model_kwargs.get("q_pool") == 3 for c in cells) and any(c.model_kwargs.get("q_pool") == 2 for c in cells)
    assert any("16x224" in c.model for c in cells) and any(c.model.startswith("timm:") for c in cells)
    eager = matrix.select(cells, "*/eager")
    assert eager and all(c.mode == "eager" for c in eager)
    assert [c.mode for c in matrix.ordered(cells)][0] == "eager"


def test_results_table_renders_and_rewrites_readme(runs, tmp_path):
    table = _load_script("results_table")
    _, folder = runs["tiny"]
    json_path = str(folder / "tiny.json")
    text = table.render(table.load([json_path]))
    assert "| config |" in text and "mae_hiera_tiny_224" in text and "x**" in text
    assert "python -m hiera_autopatch bench" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\n{table.BEGIN}\nold\n{table.END}\n\nafter\n")
    assert table.main([json_path, "--write", str(readme)]) == 0
    new = readme.read_text()
    assert "old" not in new and "mae_hiera_tiny_224" in new and new.endswith("after\n")
    readme.write_text("no markers\n")
    assert table.main([json_path, "--write", str(readme)]) == 2


def test_results_table_takes_timed_profiles_and_leaves_flop_counts_out(tmp_path):
    table = _load_script("results_table")
    timed = {"command": "profile_step.py", "modes": {"graphs": {"ms_per_step": {"median": 30.0}}}}
    flops = {"command": "count_flops.py", "modes": {"fair": {"gflop_per_sample": 60.9}}}
    paths = []
    for name, data in (("timed", timed), ("flops", flops)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(data, f)
    assert [os.path.basename(p) for p, _ in table.load(paths)] == ["timed.json"]


def test_profile_step_idle_gaps_split_short_from_long_and_name_the_long_ones():
    profile_step = _load_script("profile_step")

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    # Two steps of a, b, c: a 2 us gap a->b, a 30 us gap b->c and a 50 us gap between the steps.
    # A CPU event is ignored, and a kernel inside c's span neither opens a gap nor becomes the
    # kernel the next gap comes after.
    events = [kernel("a", 0, 10), kernel("b", 12, 10), {"cat": "cpu_op", "name": "x", "ts": 0, "dur": 999},
              kernel("c", 52, 10), kernel("inner", 53, 2),
              kernel("a", 112, 10), kernel("b", 124, 10), kernel("c", 164, 10)]
    gaps = profile_step.idle_gaps(events, steps=2)
    assert gaps["span_ms"] == pytest.approx(174 / 1000 / 2)
    assert gaps["gaps_ms"] == pytest.approx({"short": 4 / 1000 / 2, "long": (30 + 50 + 30) / 1000 / 2})
    assert gaps["long_gaps_top"] == [
        {"after": "b", "before": "c", "ms": pytest.approx(60 / 1000 / 2), "count": 1.0},
        {"after": "c", "before": "a", "ms": pytest.approx(50 / 1000 / 2), "count": 0.5},
    ]
    assert profile_step.idle_gaps([], steps=1) == {}


def test_profile_step_modes_parse_and_bad_ones_are_rejected():
    profile_step = _load_script("profile_step")
    table = _load_script("results_table")
    spec = profile_step.parse_mode("graphs-triton~fair.block~fair.mae_loss@flash+kept_embed+max_autotune#2")
    assert spec == {"config": "graphs", "attention": "triton", "repeat": "2", "sdpa": "flash",
                    "disabled": {"fair.block", "fair.mae_loss"}, "switches": ["kept_embed", "max_autotune"]}
    assert profile_step.parse_mode("patched")["attention"] == "auto"
    for bad in ("graph", "patched-fast", "patched@math", "graphs+kept"):
        with pytest.raises(ValueError, match="mode"):
            profile_step.parse_mode(bad)
    label = table.profile_label("graphs-triton~fair.block~fair.mae_loss@flash+kept_embed#2")
    assert label == ("patched, HIERA_OPTIM_GRAPHS=1, triton attention everywhere, without fair.block, "
                     "fair.mae_loss, SDPA pinned to flash, patch embedding of the kept tokens only (repeat 2)")
    assert profile_step.parse_mode("patched+full_embed")["switches"] == ["full_embed"]
    assert set(profile_step.SWITCHES) - {"tuned_attention"} <= set(table.SWITCH_LABELS)


def test_profile_step_interleave_takes_only_graphed_modes_with_the_same_patches(capsys):
    """--interleave switches between kept graphs without re-patching: anything else is refused
    before a model is built or torch touches a GPU."""
    profile_step = _load_script("profile_step")
    ok = ["graphs", "graphs+ln_by_width", "graphs#2", "graphs+ln_by_width+max_autotune#2"]
    assert profile_step.interleave_problems(ok) == []
    problems = profile_step.interleave_problems(["graphs", "patched", "graphs+no_capture"])
    assert problems == ["mode 'patched' is not a graphs mode",
                        "mode 'graphs+no_capture': +no_capture runs compiled code, not a kept graph"]
    for differing in (["graphs", "graphs-sdpa"], ["graphs", "graphs~fair.block"], ["graphs", "graphs+full_embed"]):
        assert "differ" in " ".join(profile_step.interleave_problems(differing))
    assert "twice" in " ".join(profile_step.interleave_problems(["graphs", "graphs"]))
    with pytest.raises(SystemExit) as exc:
        profile_step.main(["--interleave", "10", "--modes", "fair,graphs"])
    assert exc.value.code == 2 and "not a graphs mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_step.main(["--interleave", "-1", "--modes", "graphs"])


def test_ab_pairs_ships_only_a_candidate_faster_in_every_complete_pair(tmp_path, capsys):
    """scripts/ab_pairs.py: pairs by repeat, skips a pair a timeout cut, and exits 0 only on a
    win in every pair (at least --min-pairs of them); 2 on a file it cannot read or a mode it lacks."""
    ab_pairs = _load_script("ab_pairs")
    ms = lambda median: {"ms_per_step": {"median": median}}
    modes = {"graphs": ms(30.0), "graphs+x": ms(29.0), "graphs+y": ms(29.5), "graphs#2": ms(31.0),
             "graphs+x#2": ms(30.5), "graphs+y#2": ms(31.5), "graphs#3": ms(30.0), "graphs+x#3": ms(29.9),
             "graphs+y#3": ms(29.0), "graphs#4": ms(30.0), "graphs+x#4": {"peak_gib": 6.5}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"modes": modes}))
    assert [p["repeat"] for p in ab_pairs.pairs(modes, "graphs", "graphs+x")] == ["1", "2", "3"]
    assert ab_pairs.main([str(path), "--candidate", "graphs+x"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "wins every pair"
    assert ab_pairs.main([str(path), "--candidate", "graphs+y"]) == 1
    assert "slower or equal in 1 of 3" in json.loads(capsys.readouterr().out)["verdict"]
    assert ab_pairs.main([str(path), "--candidate", "graphs+x", "--min-pairs", "4"]) == 1
    assert ab_pairs.main([str(path), "--candidate", "graphs+z"]) == 2  # no such mode: bad input
    assert "no mode graphs+z" in capsys.readouterr().err
    assert ab_pairs.main([str(tmp_path / "missing.json"), "--candidate", "graphs+x"]) == 2


def test_ab_pairs_compares_an_interleaved_runs_steps_round_by_round():
    """With --interleave's round_ms, each pair also says in how many rounds the candidate's step
    beat the base's step of the same round, and the median of those differences, which then
    decides the pair."""
    ab_pairs = _load_script("ab_pairs")
    timed = lambda rounds: {"ms_per_step": {"median": sorted(rounds)[len(rounds) // 2]}, "round_ms": rounds}
    modes = {"graphs": timed([30.0, 31.0, 33.0, 30.5]), "graphs+x": timed([29.8, 31.2, 32.5, 30.0]),
             "graphs#2": timed([30.0, 30.0]), "graphs+x#2": timed([29.0, 29.0, 29.0])}  # lengths differ
    first, second = ab_pairs.pairs(modes, "graphs", "graphs+x")
    assert (first["rounds"], first["candidate_faster"]) == (4, 3)
    assert abs(first["median_diff_ms"] - (-0.35)) < 1e-9  # diffs -0.2, +0.2, -0.5, -0.5
    assert "rounds" not in second  # not paired round by round: only the medians are compared
    assert not ab_pairs.lost(first) and not ab_pairs.lost(second)  # second: medians 29.0 vs 30.0
    second["candidate_ms"] = 31.0
    assert ab_pairs.lost(second)  # the medians decide a pair without rounds
    # by rounds, a candidate can win a pair whose median is higher (drift fell on its slow rounds)
    mixed = {"graphs": timed([30.0, 30.0, 33.0]), "graphs+x": timed([29.9, 29.9, 30.5])}
    mixed["graphs+x"]["ms_per_step"]["median"] = 30.5
    assert not ab_pairs.lost(ab_pairs.pairs(mixed, "graphs", "graphs+x")[0])
    assert ab_pairs.by_round({"graphs": {"ms_per_step": {"median": 1.0}}}, "graphs", "graphs+x") == {}


def test_ab_pairs_reports_the_runs_own_noise_from_the_bases_repeats():
    """aa_pairs: each two repeats of the base compared round by round; clear_of_aa_spread: every
    pair's gain beats the widest of those differences (None without round-by-round data)."""
    ab_pairs = _load_script("ab_pairs")
    timed = lambda rounds: {"ms_per_step": {"median": sorted(rounds)[len(rounds) // 2]}, "round_ms": rounds}
    modes = {"graphs": timed([30.0, 30.0, 30.0]), "graphs+x": timed([29.7, 29.8, 29.7]),
             "graphs#2": timed([30.1, 30.1, 30.2]), "graphs+x#2": timed([29.8, 29.8, 30.0]),
             "graphs#3": timed([29.9, 30.0, 30.0])}
    same = ab_pairs.repeat_pairs(modes, "graphs")
    assert [(p["base"], p["other"]) for p in same] == [("graphs", "graphs#2"), ("graphs", "graphs#3"),
                                                      ("graphs#2", "graphs#3")]
    assert abs(same[0]["median_diff_ms"] - 0.1) < 1e-9 and same[0]["other_faster"] == 0
    assert abs(same[2]["median_diff_ms"] - (-0.2)) < 1e-9  # the widest A/A difference: 0.2 ms
    found = ab_pairs.pairs(modes, "graphs", "graphs+x")  # gains 0.3 and 0.3 ms
    assert ab_pairs.clear_of_noise(found, same) is True
    found[1]["median_diff_ms"] = -0.05  # a win, but inside the run's A/A spread
    assert ab_pairs.clear_of_noise(found, same) is False
    assert ab_pairs.clear_of_noise(found, []) is None
    plain = {"graphs": {"ms_per_step": {"median": 30.0}}, "graphs#2": {"ms_per_step": {"median": 30.1}}}
    assert ab_pairs.repeat_pairs(plain, "graphs") == []


def test_profile_step_takes_each_pass_blocks_from_a_tuning_file(tmp_path):
    """``+tuned_attention``: the fastest forward's forward keys and the fastest backward's backward
    keys, the key-tiles switch included, per (T, S, D)."""
    profile_step = _load_script("profile_step")
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"shapes": {
        "decoder": {"T": 196, "S": 1, "D": 32,
                    "fwd_best": {"config": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}},
                    "bwd_best": {"config": {"KEY_TILES_BWD": 1, "BLOCK_M_BWD": 32, "num_warps_bwd": 8}}},
        "stage3-global-mae": {"T": 76, "S": 1, "D": 96,
                              "bwd_best": {"config": {"BLOCK_M_BWD": 64, "BLOCK_N_BWD": 128}}}}}))
    assert profile_step.tuned_blocks(str(path)) == {
        (196, 1, 32): {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                       "KEY_TILES_BWD": 1, "BLOCK_M_BWD": 32, "num_warps_bwd": 8},
        (76, 1, 96): {"BLOCK_M_BWD": 64, "BLOCK_N_BWD": 128}}


def test_profile_step_counts_matmul_flops_from_profiler_shapes():
    profile_step = _load_script("profile_step")
    assert profile_step.matmul_flops("aten::mm", [[128, 96], [96, 384]]) == 2 * 128 * 96 * 384
    assert profile_step.matmul_flops("aten::addmm", [[384], [128, 96], [96, 384], [], []]) == 2 * 128 * 96 * 384
    assert profile_step.matmul_flops("aten::bmm", [[4, 16, 32], [4, 32, 8]]) == 2 * 4 * 16 * 32 * 8
    assert profile_step.matmul_flops("aten::add", [[128, 96], [128, 96]]) == 0
    assert profile_step.matmul_flops("aten::mm", [[128], []]) == 0


def test_profile_step_inductor_switches_add_to_the_graphed_options():
    profile_step = _load_script("profile_step")
    from hiera_autopatch.ops import step_graph

    assert profile_step.inductor_options([]) == step_graph.compile_options == {}  # shipped: default_options()
    assert profile_step.inductor_options(["no_pdl"]) == {"triton.enable_pdl": False}
    assert profile_step.inductor_options(["kept_embed", "one_graph", "coord_descent"]) == {
        "coordinate_descent_tuning": True}
    assert step_graph.backward_graph  # the shipped default: the backward a graph of its own


def test_count_flops_matches_torchs_counter_without_module_hooks():
    """scripts/count_flops.py's counter gives torch's FlopCounterMode totals, and registers no
    module hook (one would turn our hook-sensitive fast paths off while counting)."""
    import torch
    from torch.nn.modules import module as module_globals
    from torch.utils.flop_counter import FlopCounterMode

    count_flops = _load_script("count_flops")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(5, 8, requires_grad=True)
    with count_flops.FlopCount() as ours:
        assert not module_globals._global_forward_pre_hooks and not module_globals._global_forward_hooks
        model(x).sum().backward()
    with FlopCounterMode(display=False) as theirs:
        model(x).sum().backward()
    assert ours.total == theirs.get_total_flops() == 3 * 2 * 5 * (8 * 32 + 32 * 4)  # forward, 2x in backward


class _CountingStep:
    """Stands in for _bench_run.Step: counts calls and the seed each ran under, sleeping ``s``."""

    def __init__(self, s: float):
        self.s, self.seeds = s, []

    def zero_grad(self):
        pass

    def __call__(self):
        import time

        import torch

        self.seeds.append(torch.initial_seed())
        time.sleep(self.s)


def test_warm_up_runs_longer_on_a_gpu_only(monkeypatch):
    """warm_up: spec.warmup steps on the CPU; on a GPU more, until WARMUP_MIN_S have passed after
    the first (at most 10x spec.warmup); none with warmup=0. Seeds continue from spec.seed + 1000."""
    from types import SimpleNamespace

    monkeypatch.setattr(_bench_run, "sync", lambda device: None)
    monkeypatch.setattr(_bench_run, "WARMUP_MIN_S", 0.2)
    spec = _bench_run.Spec(model="m", warmup=2, seed=7)
    cpu, gpu = SimpleNamespace(type="cpu"), SimpleNamespace(type="cuda")
    progress = _bench_run._NullProgress()

    step = _CountingStep(0.001)
    first, total, n = _bench_run.warm_up(step, spec, cpu, progress, "")
    assert n == 2 and step.seeds == [1007, 1008] and 0 < first <= total

    step = _CountingStep(0.01)  # 0.2 s after the first: about 20 steps, within the cap of 50
    first, total, n = _bench_run.warm_up(step, _bench_run.Spec(model="m", warmup=5, seed=7), gpu, progress, "")
    assert 5 < n < 50 and total - first >= 0.2 and step.seeds == list(range(1007, 1007 + n))

    step = _CountingStep(0.02)
    monkeypatch.setattr(_bench_run, "WARMUP_MIN_S", 10.0)
    assert _bench_run.warm_up(step, spec, gpu, progress, "")[2] == 20  # capped at 10x spec.warmup

    step = _CountingStep(0.0)
    first, _, n = _bench_run.warm_up(step, _bench_run.Spec(model="m", warmup=0), gpu, progress, "")
    assert (first, n, step.seeds) == (None, 0, [])


def test_kernel_groups_counts_each_kernel_in_its_first_matching_group(tmp_path):
    groups = _load_script("kernel_groups")
    kernels = [{"name": "triton_red_fused_sum_view_3", "ms": 1.0, "calls": 2.0},
               {"name": "nvjet_sm90_tst_128x128_64x6_1x2_h_bz_splitK_NTT", "ms": 2.0, "calls": 1.0},
               {"name": "void cublasLt::splitKreduce_kernel<32>", "ms": 0.5, "calls": 1.0},
               {"name": "triton_poi_fused_gelu_view_7", "ms": 4.0, "calls": 1.0}]
    wanted = [("sums", r"fused_sum_view_\d+$"), ("split-K", r"splitK"), ("nt", r"_NT[TN]$")]
    totals = groups.group_kernels(kernels, wanted)
    assert totals == {"sums": {"ms": 1.0, "calls": 2.0, "kernels": 1},
                      "split-K": {"ms": 2.5, "calls": 2.0, "kernels": 2},  # first match wins
                      "nt": {"ms": 0.0, "calls": 0.0, "kernels": 0}}
    for bad in ("no-equals", "=regex", "name="):
        with pytest.raises(Exception):
            groups.parse_group(bad)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"modes": {"graphs": {"kernels": {"total_ms": 7.5, "top_kernels_ms": kernels}}}}))
    assert groups.main([str(path), "--mode", "graphs", "--group", "sums=sum_view"]) == 0
    with pytest.raises(SystemExit):
        groups.main([str(path), "--mode", "eager", "--group", "sums=sum_view"])


def test_bench_weight_grads_orders_give_the_same_gradient():
    """scripts/bench_weight_grads.py times dW = dY^T X in other operand orders: each must be dW."""
    import torch

    bench = _load_script("bench_weight_grads")
    shapes = list(bench.linears())
    assert len(shapes) == 20 and ("stage3.fc1", 9728, 384, 1536, 15) in shapes
    gen = torch.Generator().manual_seed(0)
    dy, x = torch.randn(64, 24, generator=gen), torch.randn(64, 8, generator=gen)
    want = dy.t() @ x  # (out, in)
    for name, order in bench.VARIANTS.items():
        got = order(dy, x)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)  # fp32 sums of 64 in another order
    assert not bench.VARIANTS["Xt_dY_T"](dy, x).is_contiguous()  # the transposed view, as timed


def test_bench_dw_overlap_chain_computes_the_block_backward_it_times():
    """scripts/bench_dw_overlap.py's chain: every variant computes the same numbers, and the fc1
    weight gradient it writes is dh^T xn2 for GELU's gradient dh of fc1's output (CPU, fp32)."""
    import torch

    bench = _load_script("bench_dw_overlap")
    torch.manual_seed(0)
    chain = bench.BlockChain(rows=12, width=8, blocks=2, device="cpu", dtype=torch.float32)
    outs = {}
    for variant in bench.VARIANTS:
        outs[variant] = [chain.run(variant)] + chain.weight_grads()
    for variant in bench.VARIANTS[1:]:
        for got, want in zip(outs[variant], outs["serial"]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    last = chain.blocks[-1]
    d_out = chain.d_out  # the last block's incoming gradient is the first's output: recompute it
    for b in chain.blocks[:-1]:
        d_act = d_out @ b["w2"]
        dh = torch.ops.aten.gelu_backward(d_act, b["h"])
        dx2 = chain._ln_backward(dh @ b["w1"], b, "2") + d_out
        dqkv = b["qkv"] * (dx2 @ b["wproj"]).repeat(1, 3)
        d_out = chain._ln_backward(dqkv @ b["wqkv"], b, "1") + dx2
    dh = torch.ops.aten.gelu_backward(d_out @ last["w2"], last["h"])
    torch.testing.assert_close(last["dw1"], dh.t() @ last["xn2"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last["dw2"], d_out.t() @ torch.nn.functional.gelu(last["h"]), rtol=1e-5, atol=1e-5)


def test_time_launches_times_each_variant_not_the_width_table(monkeypatch):
    """A kernel module's ``LAUNCH_BY_WIDTH`` overrides ``LAUNCH`` for its widths: while the benches
    time a variant the table is empty, so each variant runs (session 26's first GELU sweep on the
    H200 ran the table's launches under every variant name). Both are restored after."""
    import torch
    from hiera_autopatch.ops.triton import gelu as tgelu

    timing = _load_script("_timing")
    table, shipped = tgelu.LAUNCH_BY_WIDTH, tgelu.LAUNCH
    ran = []

    def run():
        ran.append(str(tgelu.launch_for(3072)))
        return [torch.ones(2)]

    monkeypatch.setattr(timing, "kernel_ms", lambda fn, device: 1.0)
    entry = {"width": 3072}
    timing.time_launches(tgelu, ["4096x128x4", "1024x64x4p"], run, [torch.ones(2)], entry, "cpu")
    assert ran == ["4096x128x4", "1024x64x4p"]
    assert entry["ours_4096x128x4_ms"] == entry["ours_1024x64x4p_ms"] == 1.0
    assert tgelu.LAUNCH_BY_WIDTH is table and tgelu.LAUNCH is shipped and 3072 in table
    assert entry["shipped"] == str(table[3072])


def test_kernel_bench_scripts_dry_run_in_the_interpreter(tmp_path):
    """scripts/bench_layer_norm.py and bench_gelu.py on the CPU (``--device cpu``: Triton's
    interpreter, fp32, one small shape): every launch variant is checked against Inductor's result
    and gets a time, the shipped launch is named (GELU's for the shape's width, 3072), and the step
    totals add up. A crash here would
    otherwise cost a GPU session."""
    pytest.importorskip("triton")
    jobs = {
        "layer_norm": ["scripts/bench_layer_norm.py", "--device", "cpu", "--batch", "2", "--shapes", "stage4",
                       "--dx-sum", "--variants", "2x4096x2,4x2048x2x8p", "--json", str(tmp_path / "layer_norm.json")],
        "gelu": ["scripts/bench_gelu.py", "--device", "cpu", "--batch", "2", "--shapes", "stage4",
                 "--variants", "4096x128x4,2048x64x4p", "--json", str(tmp_path / "gelu.json")],
    }
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    results = in_parallel({name: (lambda args=args: run_python(args, cwd=ROOT, env=env, timeout=600))
                           for name, args in jobs.items()})
    for name, shipped, variants in (("layer_norm", "2x4096x2", ("2x4096x2", "4x2048x2x8p")),
                                    ("gelu", "2048x64x4", ("4096x128x4", "2048x64x4p"))):
        assert results[name].returncode == 0, explain(results[name])
        report = json.loads((tmp_path / f"{name}.json").read_text())
        entry = report["shapes"]["stage4"]
        assert entry["shipped"] == shipped and entry["inductor_ms"] > 0
        for variant in variants:
            assert max(entry[f"ours_{variant}_rel_err"]) < 1e-5 and entry[f"ours_{variant}_ms"] > 0, (name, variant)
        assert set(report["ms_per_step"]) == {"inductor", *variants}
