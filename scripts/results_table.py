#!/usr/bin/env python
"""The README results table, generated from benchmarks/results/*.json (no hand-typed numbers).

    python scripts/results_table.py                        # print the markdown
    python scripts/results_table.py --write README.md      # replace the block between the markers
    python scripts/results_table.py path/to/a.json ...     # other files

The block in README.md sits between ``<!-- results:begin -->`` and ``<!-- results:end -->``.
Every number comes from a JSON file written by ``python -m hiera_autopatch bench`` or
``scripts/bench_matrix.py``; each table names the file and the command that made it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
SCHEMA_PREFIX = "hiera_autopatch.bench/"


def load(paths: List[str]) -> List[tuple]:
    records = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"results_table: skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(data, dict) and str(data.get("schema", "")).startswith(SCHEMA_PREFIX):
            records.append((path, data))
        elif is_timed_profile(data):
            records.append((path, data))  # a scripts/profile_step.py profile
    return records  # other results (kernel timings) live in the same folder


def is_timed_profile(data) -> bool:
    """A scripts/profile_step.py file: every mode has ms/step (scripts/count_flops.py's have none)."""
    if not (isinstance(data, dict) and "command" in data and isinstance(data.get("modes"), dict)):
        return False
    return bool(data["modes"]) and all("ms_per_step" in mode for mode in data["modes"].values())


PROFILE_MODES = {
    "fair": "FAIR eager",
    "patched": "patched eager",
    "patched-sdpa": "patched eager, SDPA attention",
    "graphs": "patched, HIERA_OPTIM_GRAPHS=1",
    "graphs-sdpa": "patched, HIERA_OPTIM_GRAPHS=1, SDPA attention",
    "compile": "patched + user's torch.compile (default mode)",
}


SWITCH_LABELS = {
    "kept_embed": "patch embedding of the kept tokens only",
    "full_embed": "FAIR's full patch embedding",
    "tuned_attention": "attention blocks from a tune_attention.py run",
    "max_autotune": "Inductor max-autotune",
    "autotune_gemm": "Inductor GEMM autotuning",
    "coord_descent": "Inductor coordinate-descent tuning",
    "pdl": "Inductor programmatic dependent launch",
    "no_pdl": "without programmatic dependent launch",
    "mix_split64": "LayerNorm-grad partial sums over 64 rows",
    "mix_split32": "LayerNorm-grad partial sums over 32 rows",
    "no_mix": "LayerNorm row and column grads in separate kernels",
    "mix": "Inductor mix-order LayerNorm-grad reductions",
    "combo": "Inductor combo kernels",
    "no_cudagraphs": "without CUDA graphs",
    "two_graphs": "forward and backward as two graphs (reduce-overhead)",
    "one_graph": "forward and backward in one graph",
    "no_capture": "compiled whole step, not captured",
    "decoder_rows": "decoder's last MLP and head at the masked tokens only",
    "full_decoder": "decoder's last MLP and head at every token",
    "unaligned_embed": "kept-token patch embedding without its aligning zero columns",
    "conv_heads": "MAE fusion heads as FAIR's convolutions",
    "bias_sums": "qkv bias gradients from autograd's reduction",
    "kernel_bias_grad": "qkv bias gradients from the attention kernels",
    "cublaslt": "ATen matmuls through cuBLASLt",
    "fused_ln": "block LayerNorm backward in one pass with the residual gradient",
    "inductor_ln": "block LayerNorm backward in Inductor's kernels",
    "ln_variant": "block LayerNorm backward at the --ln-variant launch",
    "ln_by_width": "block LayerNorm backward launched per row width (layer_norm.BEST_BY_WIDTH)",
    "inductor_gelu": "MLP GELU backward and fc1 bias gradients in Inductor's kernels",
    "gelu_variant": "GELU backward at the --gelu-variant launch",
    "side_dw": "weight-gradient GEMMs on a second stream (session 23, removed)",
    "pdl_ours": "our Triton kernels with programmatic dependent launch",
    "gelu_by_width": "GELU backward launched per row width (gelu.BEST_BY_WIDTH)",
    "gelu_one_launch": "GELU backward at one launch for every row width (gelu.LAUNCH)",
    "keep_act": "the decoder MLPs keep GELU's output for backward",
    "keep_act_all": "every MLP keeps GELU's output for backward",
    "gemm_gelu": "the MLP GEMMs with GELU in their epilogue where bench_gemm_gelu.py found them faster",
    "mask_in_graph": "the forward graph draws the random mask itself",
    "eager_mask": "the random mask drawn by the host before the graph",
    "no_pdl_ours": "our Triton kernels without programmatic dependent launch",
    "ln_one_launch": "LayerNorm backward at one launch for every row width (layer_norm.LAUNCH)",
    "no_dx_sum": "bias gradients that sum a block LayerNorm's input gradient as Inductor's reductions",
    "coop": "Inductor cooperative reductions",
    "aggressive": "Inductor aggressive fusion",
    "nd_tiling": "Inductor 2-D tiling",
}


def profile_label(mode: str) -> str:
    """"graphs-triton~fair.block@flash#2" -> readable words (scripts/profile_step.py's mode syntax)."""
    mode, _, repeat = mode.partition("#")
    mode, _, switches = mode.partition("+")
    mode, _, pinned = mode.partition("@")
    mode, *off = mode.split("~")
    label = PROFILE_MODES.get(mode)
    if label is None:
        config, _, attention = mode.partition("-")
        label = PROFILE_MODES.get(config, config) + (f", {attention} attention everywhere" if attention else "")
    if off:
        label += f", without {', '.join(off)}"
    if pinned:
        label += f", SDPA pinned to {pinned}"
    if switches:
        label += ", " + ", ".join(SWITCH_LABELS.get(name, name) for name in switches.split("+"))
    if repeat:
        label += f" (repeat {repeat})"
    return label


def render_profile(path: str, data: dict, relative_to: str = ROOT) -> str:
    """A scripts/profile_step.py file: ms/step and GPU kernel time by kind, per configuration."""
    source = os.path.relpath(path, relative_to)
    kinds = ["gemm", "attention", "layer_norm", "triton (fused)", "copy/layout", "elementwise", "reduce"]
    lines = [
        f"**{data.get('gpu')}, torch {data.get('torch')}** — `{data.get('model')}`, batch {data.get('batch')}, "
        f"{data.get('dtype')}, {data.get('step')}; median of {data.get('steps', 20)} steps. GPU kernel time per "
        f"step by kind from torch.profiler (GPU span: first kernel start to last kernel end, per step). Source: [`{source}`]({source}), made by `{data.get('command')}`.",
        "",
        *([f"_{data['note']}_", ""] if data.get("note") else []),
        "| configuration | ms/step | vs FAIR eager | peak GiB | warm-up s | GPU kernel ms | GPU span ms | kernels/step | "
        + " | ".join(kinds) + " |",
        "|---|" + "---:|" * (7 + len(kinds)),
    ]
    for mode, entry in data["modes"].items():
        kernels = entry.get("kernels", {})
        by_kind = kernels.get("by_kind_ms", {})
        cells = [
            profile_label(mode),
            _ms(entry["ms_per_step"]["median"]),
            f"**{entry['x_vs_fair_eager']:.2f}x**" if entry.get("x_vs_fair_eager") else "–",
            f"{entry['peak_gib']:.1f}",
            f"{entry['warmup_s']:.0f}",
            _ms(kernels.get("total_ms")),
            _ms(kernels.get("span_ms")),
            f"{kernels['kernels_per_step']:.0f}" if kernels else "–",
        ] + [_ms(by_kind.get(kind)) for kind in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(value) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _gib(value) -> str:
    return f"{value / 2**30:.1f}" if value else "–"


def _shape(config: dict) -> str:
    size = config.get("input_size") or []
    chans = config.get("in_chans")
    return "×".join(str(v) for v in ([chans] if chans else []) + list(size)) or "?"


def _what(config: dict) -> str:
    task = config.get("task")
    if task == "mae":
        what = f"MAE (mask {config.get('mask_ratio')})"
    elif task == "cls":
        what = "classification"
    else:
        what = "?"
    kwargs = config.get("model_kwargs") or {}
    if kwargs:
        what += ", " + ", ".join(f"{k}={v}" for k, v in kwargs.items())
    options = config.get("patch_options") or {}
    if options:
        what += "; patched with " + ", ".join(f"{k}={v}" for k, v in options.items())
    return what


def _numerics(cell: dict) -> str:
    num = cell.get("numerics")
    if not num:
        return "–"
    if num.get("error"):
        return "**check failed to run**"
    verdict = "ok" if num.get("ok") else "**MISMATCH**"
    if num.get("method") == "against an fp32 reference":
        errs = num.get("grad_max_err_vs_fp32", {})
        return f"{verdict} (max grad err vs fp32 {errs.get('unpatched', 0):.0e} → {errs.get('side', 0):.0e})"
    return f"{verdict} (max grad rel diff {num.get('grad_max_rel_norm_diff', 0):.0e})"


def _env_line(env: dict) -> str:
    if env.get("gpu"):
        hw = f"{env['gpu']} (sm {env.get('compute_capability')}, driver {env.get('driver') or '?'})"
    else:
        hw = f"CPU ({env.get('cpu_threads')} threads)"
    parts = [hw, f"torch {env.get('torch')}"]
    for key, name in (("triton", "triton"), ("cudnn", "cuDNN"), ("hiera_transformer", "hiera-transformer"), ("timm", "timm")):
        if env.get(key):
            parts.append(f"{name} {env[key]}")
    if env.get("git_commit"):
        modified = " (package modified)" if env.get("git_package_modified") else ""
        parts.append(f"hiera_autopatch {env.get('hiera_autopatch')} @ {env['git_commit']}{modified}")
    if env.get("source_digest"):
        parts.append(f"source {env['source_digest']}")
    return ", ".join(parts)


def render_record(path: str, data: dict, relative_to: str = ROOT) -> str:
    env = data.get("environment", {})
    cells = [c for c in data.get("results", []) if "config" in c]
    third = any("hiera_optim" in c.get("sides", {}) for c in cells)
    header = ["config", "model", "input", "batch", "dtype", "mode", "unpatched ms", "patched ms", "speed-up"]
    if third:
        header += ["hiera-optim ms", "hiera-optim speed-up"]
    pipelined = any(c.get("pipelined_speedups") for c in cells)
    if pipelined:
        header += ["no per-step sync: ms (unpatched → patched), speed-up"]
    header += ["peak GiB (unpatched → patched)", "compile s (unpatched / patched)", "numerics", "attention (unpatched → patched)"]
    rows = []
    skipped = []
    for cell in cells:
        config = cell["config"]
        name = config.get("label") or config.get("model", "?")
        if cell.get("skipped"):
            skipped.append(f"{name}/{config.get('mode')}")
            continue
        sides = cell.get("sides", {})
        unp, pat = sides.get("unpatched", {}), sides.get("patched", {})
        speedup = cell.get("speedup")
        row = [
            f"{config['label']}: {_what(config)}" if config.get("label") else _what(config),
            f"`{config.get('model')}`",
            _shape(config),
            str(config.get("batch")),
            str(config.get("dtype")),
            str(config.get("mode")),
            _ms(unp.get("ms_median")),
            _ms(pat.get("ms_median")),
            f"**{speedup:.2f}x**" if speedup else ("error" if cell.get("error") else "–"),
        ]
        if third:
            opt = sides.get("hiera_optim", {})
            ratio = (cell.get("speedups") or {}).get("hiera_optim")
            row += [_ms(opt.get("ms_median")), f"{ratio:.2f}x" if ratio else "–"]
        if pipelined:
            ratio = (cell.get("pipelined_speedups") or {}).get("patched")
            row.append(f"{_ms(unp.get('pipelined_ms'))} → {_ms(pat.get('pipelined_ms'))}, "
                       + (f"{ratio:.2f}x" if ratio else "–"))
        compile_s = "–"
        if unp.get("compile_s") is not None or pat.get("compile_s") is not None:
            compile_s = " / ".join(f"{s['compile_s']:.0f}" if s.get("compile_s") is not None else "–" for s in (unp, pat))

        def kernels(side):
            att = side.get("attention") or {}
            return "+".join(att.get("backends") or []) or "–"

        row += [
            f"{_gib(unp.get('peak_mem_bytes'))} → {_gib(pat.get('peak_mem_bytes'))}",
            compile_s,
            _numerics(cell),
            f"{kernels(unp)} → {kernels(pat)}",
        ]
        rows.append(row)
    try:
        shown = os.path.relpath(path, relative_to)
    except ValueError:
        shown = path
    lines = [
        f"**{_env_line(env)}** — median ms per forward+backward step, {_first(cells, 'steps')} timed steps per side; "
        f"speed-up = unpatched ms / patched ms. Source: [`{shown}`]({shown}), made by `{env.get('command', '?')}`.",
        "",
        *([f"_{data['note']}_", ""] if data.get("note") else []),
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 6 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if skipped:
        lines += ["", f"Not run (time budget): {', '.join(skipped)}."]
    return "\n".join(lines)


def _first(cells: List[dict], key: str):
    for cell in cells:
        if cell["config"].get(key) is not None:
            return cell["config"][key]
    return "?"


def render(records: List[tuple], relative_to: str = ROOT) -> str:
    if not records:
        return "_No benchmark results yet: run `scripts/bench_matrix.py` and commit its JSON under `benchmarks/results/`._"
    return "\n\n".join(
        render_profile(p, d, relative_to) if "modes" in d else render_record(p, d, relative_to) for p, d in records
    )


def replace_block(text: str, block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN} ... {END} not found")
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="README results table from benchmark JSON files")
    p.add_argument("files", nargs="*", help="JSON files (default benchmarks/results/*.json)")
    p.add_argument("--write", metavar="README", help="rewrite the block between the results markers in this file")
    args = p.parse_args(argv)
    paths = args.files or sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
    relative_to = os.path.dirname(os.path.abspath(args.write)) if args.write else ROOT
    block = render(load(paths), relative_to)
    if not args.write:
        print(block)
        return 0
    with open(args.write) as f:
        text = f.read()
    try:
        new = replace_block(text, block)
    except ValueError as exc:
        print(f"results_table: error: --write {args.write}: {exc}", file=sys.stderr)
        return 2
    if new != text:
        with open(args.write, "w") as f:
            f.write(new)
    print(f"results_table: {args.write}: {len(paths)} file(s) rendered", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
