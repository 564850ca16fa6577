"""What the benchmark writes: the environment record, the stdout table, the JSON file, the PNG.

No torch at import time (``environment`` imports it when called), so that the results-table script
can format a JSON file on a machine without torch.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import List, Optional

SCHEMA = "hiera_autopatch.bench/1"


# --------------------------------------------------------------------------------------------
# Environment


def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:
        return None


def _nvidia_smi_driver() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        line = out.stdout.strip().splitlines()
        return line[0].strip() if out.returncode == 0 and line else None
    except Exception:
        return None


def _git_commit() -> Optional[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        return None


def _git_package_modified() -> Optional[bool]:
    """Whether the package's files differ from git's HEAD (a working tree copied onto the GPU
    machine reports main's last landed commit as HEAD: its code is then not that commit's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "hiera_autopatch"],
                             capture_output=True, text=True, timeout=5)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except Exception:
        return None


def source_digest(package_dir: Optional[str] = None) -> str:
    """16 hex digits of sha256 over the package's ``.py`` files (relative paths and bytes, in
    sorted order): names the code that ran, with or without git."""
    package_dir = package_dir or os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, package_dir).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def environment(device_name: str, argv: Optional[List[str]] = None) -> dict:
    """Everything a reader needs to reproduce a run, apart from the cells themselves."""
    import torch

    import hiera_autopatch

    env = {
        "hiera_autopatch": hiera_autopatch.__version__,
        "git_commit": _git_commit(),
        "git_package_modified": _git_package_modified(),
        "source_digest": source_digest(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _dist_version("triton") or _dist_version("pytorch-triton"),
        "hiera_transformer": _dist_version("hiera-transformer"),
        "timm": _dist_version("timm"),
        "hiera_optim": _dist_version("hiera-optim") or _dist_version("hiera_optim"),
        "cudnn": None,
        "device": device_name,
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        env["cudnn"] = torch.backends.cudnn.version()
        env["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        env["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except Exception:
        pass
    if device_name.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device_name).index or 0
        props = torch.cuda.get_device_properties(index)
        major, minor = torch.cuda.get_device_capability(index)
        env.update(
            gpu=torch.cuda.get_device_name(index),
            compute_capability=f"{major}.{minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_count=torch.cuda.device_count(),
            driver=_nvidia_smi_driver(),
        )
        try:
            version = torch._C._cuda_getDriverVersion()
            env["cuda_driver_api"] = f"{version // 1000}.{(version % 1000) // 10}"
        except Exception:
            pass
    env["env_vars"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("HIERA_OPTIM", "TIMM_FUSED"))}
    env["command"] = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv))
    return env


def new_record(env: dict) -> dict:
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "results": [],
    }


def write_json(record: dict, path: str) -> None:
    """Atomic write, so a run cut short leaves the last complete file, never half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Progress on stderr


class Progress:
    """A tiny progress bar: redrawn in place on a terminal, a few plain lines in a log."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream=None):
        self.total = max(int(total), 1)
        self.done = 0
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.last_line = -1.0

    def update(self, n: int = 1, note: str = "") -> None:
        if not self.enabled:
            return
        self.done = min(self.done + n, self.total)
        elapsed = time.perf_counter() - self.start
        if self.tty:
            width = 24
            fill = int(width * self.done / self.total)
            bar = "#" * fill + "." * (width - fill)
            text = f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note[:40]:<40}"
            self.stream.write(text)
            self.stream.flush()
        elif self.done == self.total or elapsed - self.last_line >= 30:
            self.last_line = elapsed
            self.stream.write(f"{self.label}: {self.done}/{self.total} steps, {elapsed:.1f}s {note}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------------------------
# The stdout table


def fmt_ratio(ratio: Optional[float]) -> str:
    return f"{ratio:.2f}x" if ratio else "-"


def _fmt_ms(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _fmt_gib(value: Optional[int]) -> str:
    return f"{value / 2**30:.2f}" if value else "-"


def _fmt_s(value: Optional[float]) -> str:
    return f"{value:.1f}" if value is not None else "-"


def geometry(config: dict) -> str:
    size = config.get("input_size") or []
    chans = config.get("in_chans")
    shape = "x".join(str(v) for v in ([chans] if chans else []) + list(size))
    parts = [config.get("model", "?"), f"input {shape}", f"batch {config.get('batch')}", config.get("dtype", "")]
    task = config.get("task")
    if task == "mae":
        parts.append(f"MAE mask {config.get('mask_ratio')}")
    elif task:
        parts.append("classification")
    if config.get("model_kwargs"):
        parts.append("kwargs " + json.dumps(config["model_kwargs"], separators=(",", ":")))
    if config.get("patch_options"):
        parts.append("patched with " + json.dumps(config["patch_options"], separators=(",", ":")))
    return "  ".join(str(p) for p in parts)


def format_environment(env: dict) -> str:
    if env.get("gpu"):
        hw = f"{env['gpu']} (sm {env.get('compute_capability')}), driver {env.get('driver') or '?'}"
    else:
        hw = f"CPU ({env.get('cpu_threads')} threads)"
    soft = f"torch {env.get('torch')}"
    if env.get("triton"):
        soft += f", triton {env['triton']}"
    if env.get("cudnn"):
        soft += f", cuDNN {env['cudnn']}"
    if env.get("hiera_transformer"):
        soft += f", hiera-transformer {env['hiera_transformer']}"
    if env.get("timm"):
        soft += f", timm {env['timm']}"
    return f"{hw}; {soft}"


def format_cell(cell: dict) -> str:
    """A readable block for one cell: one row per side, then speed-up, numerics, kernels, patches."""
    config = cell["config"]
    lines = [f"[{config.get('mode')}] {(config.get('label') + ': ') if config.get('label') else ''}{geometry(config)}"]
    if cell.get("skipped"):
        lines.append(f"  skipped: {cell['skipped']}")
        return "\n".join(lines)
    header = f"  {'side':<12} {'ms/step':>9} {'min':>8} {'max':>8} {'samples/s':>10} {'peak GiB':>9} {'compile s':>9} {'speed-up':>9}"
    lines.append(header)
    for side, data in cell.get("sides", {}).items():
        if data.get("error") and not data.get("ms_median"):
            lines.append(f"  {side:<12} error: {str(data['error']).splitlines()[0][:100]}")
            continue
        sps = data.get("samples_per_s")
        ratio = "1.00x" if side == "unpatched" else fmt_ratio(cell.get("speedups", {}).get(side))
        lines.append(
            f"  {side:<12} {_fmt_ms(data.get('ms_median')):>9} {_fmt_ms(data.get('ms_min')):>8} "
            f"{_fmt_ms(data.get('ms_max')):>8} {f'{sps:,.0f}' if sps else '-':>10} "
            f"{_fmt_gib(data.get('peak_mem_bytes')):>9} {_fmt_s(data.get('compile_s')):>9} {ratio:>9}"
        )
    pipelined = {side: data.get("pipelined_ms") for side, data in cell.get("sides", {}).items()}
    if any(pipelined.values()):
        parts = [f"{side} {_fmt_ms(ms)}" for side, ms in pipelined.items() if ms]
        ratio = (cell.get("pipelined_speedups") or {}).get("patched")
        lines.append(f"  no per-step sync (ms/step): {', '.join(parts)}"
                     + (f"; speed-up {fmt_ratio(ratio)}" if ratio else ""))
    for key, who in (("numerics", "patched"), ("numerics_hiera_optim", "hiera_optim")):
        num = cell.get(key)
        if num:
            lines.append("  " + format_numerics(num, who, config.get("dtype")))
    for side, data in cell.get("sides", {}).items():
        att = data.get("attention")
        if att and "backends" in att:
            lines.append(f"  attention {side}: {', '.join(att['backends']) or 'none seen'}")
    graph = cell.get("sides", {}).get("patched", {}).get("step_graph")
    if graph and graph.get("enabled"):
        text = f"  CUDA graphs (patched): {graph.get('compiled_steps', 0)} step function(s) compiled"
        if "captured_graphs" in graph:
            text += (f", {graph['captured_graphs']} step signature(s) captured, {graph['replays']} replays,"
                     f" {graph['recomputed_backwards']} backward(s) recomputed")
        if graph.get("failed"):
            text += "; fell back to eager: " + "; ".join(str(f)[:100] for f in graph["failed"])
        lines.append(text)
    patched = cell.get("sides", {}).get("patched", {}).get("patches")
    if patched is not None:
        names = patched.get("for_model", patched.get("active")) or []
        text = f"  patches on this model: {len(names)}" + (f" ({', '.join(names)})" if names else "")
        if patched.get("errors"):
            text += "; errors: " + "; ".join(f"{m}: {e[:80]}" for m, e in patched["errors"].items())
        lines.append(text)
    if cell.get("error"):
        lines.append(f"  error: {str(cell['error']).splitlines()[0][:200]}")
    return "\n".join(lines)


def format_numerics(num: dict, who: str, dtype) -> str:
    if num.get("error"):
        return f"numerics ({who} vs unpatched): could not run: {num['error'][:160]}"
    verdict = "ok" if num["ok"] else "MISMATCH: " + "; ".join(num["problems"])
    text = (
        f"numerics ({who} vs unpatched, {dtype}): loss {num['loss_ref']:.6g} vs {num['loss']:.6g} "
        f"(rel {num['loss_rel_diff']:.1e}); grads max |d| {num['grad_max_abs_diff']:.1e}, "
        f"max rel-norm {num['grad_max_rel_norm_diff']:.1e}"
    )
    if num.get("grad_max_rel_norm_param"):
        text += f" ({num['grad_max_rel_norm_param']})"
    if num.get("method") == "against an fp32 reference":
        worst = num["grad_worst_err_vs_fp32"]
        text += (
            f"; vs fp32: loss err {num['loss_err_vs_fp32']['unpatched']:.1e} -> {num['loss_err_vs_fp32']['side']:.1e}, "
            f"worst grad err {worst['unpatched']:.1e} -> {worst['side']:.1e} ({num.get('grad_worst_param')})"
        )
    return f"{text} -> {verdict}"


def format_record(record: dict) -> str:
    out = [f"hiera_autopatch bench  ({format_environment(record['environment'])})"]
    for cell in record["results"]:
        out.append(format_cell(cell))
    return "\n\n".join(out)


# --------------------------------------------------------------------------------------------
# The PNG


def cell_label(config: dict) -> str:
    if config.get("label"):
        return f"{config['label']}\n{config.get('mode')}"
    model = str(config.get("model", "?")).split(":")[-1]
    return f"{model}\n{config.get('dtype')} B{config.get('batch')}\n{config.get('mode')}"


def plot(cells: List[dict], path: str, title: str = "") -> None:
    """Speed-up bars (baseline ms / side ms) on a log axis centred at 1x; one group per cell."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    cells = [c for c in cells if c.get("speedups")]
    sides = []
    for cell in cells:
        for side in cell["speedups"]:
            if side not in sides:
                sides.append(side)
    fig_width = max(5.0, 1.1 * len(cells) + 1.5)
    fig, ax = plt.subplots(figsize=(fig_width, 4.4))
    colors = {"patched": "#2a7ab9", "hiera_optim": "#9a9a9a"}
    width = 0.8 / max(len(sides), 1)
    ratios = [r for c in cells for r in c["speedups"].values() if r]
    span = max([abs(math.log(r)) * 1.25 for r in ratios] + [math.log(2.0)])
    for j, side in enumerate(sides):
        xs, heights = [], []
        for i, cell in enumerate(cells):
            r = cell["speedups"].get(side)
            if r:
                xs.append(i + (j - (len(sides) - 1) / 2) * width)
                heights.append(r)
        bars = ax.bar(xs, [h - 1 for h in heights], bottom=1, width=width * 0.9, label=side, color=colors.get(side))
        for bar, h in zip(bars, heights):
            ax.annotate(
                f"{h:.2f}x",
                (bar.get_x() + bar.get_width() / 2, h),
                ha="center",
                va="bottom" if h >= 1 else "top",
                fontsize=8,
                xytext=(0, 2 if h >= 1 else -2),
                textcoords="offset points",
            )
    ax.set_yscale("log")
    ax.set_ylim(math.exp(-span), math.exp(span))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16) if math.exp(-span) <= t <= math.exp(span)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_xlim(-0.5 - 0.5 * (len(cells) < 3), len(cells) - 0.5 + 0.5 * (len(cells) < 3))
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([cell_label(c["config"]) for c in cells], fontsize=7)
    ax.set_ylabel("speed-up vs unpatched (ms/step ratio)")
    if title:
        import textwrap

        ax.set_title("\n".join(textwrap.wrap(title, width=int(fig_width * 13))), fontsize=8)
    if len(sides) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
