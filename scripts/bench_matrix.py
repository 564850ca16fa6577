#!/usr/bin/env python
"""Run the benchmark over a matrix of Hiera configs and write one JSON file (after every cell) and a PNG.

    python scripts/bench_matrix.py --list                       # the cells and a rough cost each
    python scripts/bench_matrix.py --budget-s 480 --json benchmarks/results/h200.json --plot benchmarks/results/h200.png
    python scripts/bench_matrix.py --only '*/eager'             # fnmatch on "name/mode"; comma = or
    python scripts/bench_matrix.py --exhaustive --budget-s 3600
    python scripts/bench_matrix.py --tiny --only 'B-MAE/eager'  # CPU smoke test: every model shrunk

Cells run cheapest first (eager, then compile, then reduce-overhead). A cell that fails records its
error and the run goes on; when the time left is less than a cell's rough cost, that cell and the
rest are recorded as skipped. ``--hiera-optim`` adds hiera-optim 0.2.1 as a third side where it is
importable (skipped cleanly elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import sys
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODE_COST_S = {"eager": 20.0, "compile": 300.0, "reduce-overhead": 330.0}
"""Rough H200 wall time of a Hiera-B cell per mode (both sides, build, warm-up, numerics, profile)."""


@dataclasses.dataclass
class Cell:
    name: str
    model: str
    mode: str = "eager"
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    batch: int = 128
    dtype: str = "bf16"
    mask_ratio: float = 0.6
    cost: float = 1.0  # multiplier on MODE_COST_S
    patch_options: dict = dataclasses.field(default_factory=dict)  # enable() overrides for the patched side

    @property
    def key(self) -> str:
        return f"{self.name}/{self.mode}"

    def estimate_s(self) -> float:
        return MODE_COST_S[self.mode] * self.cost


def default_cells() -> List[Cell]:
    """The representative set: sizes, MAE and classification, q_pool 2 and 3, AMP, timm, one video."""
    cells = [
        Cell("B-MAE", "mae_hiera_base_224"),
        Cell("B-MAE amp", "mae_hiera_base_224", dtype="amp"),
        Cell("B-MAE q_pool3", "mae_hiera_base_224", model_kwargs={"q_pool": 3}),
        Cell("B-MAE graphs", "mae_hiera_base_224", patch_options={"graphs": True}, cost=6.0),
        Cell("T-MAE", "mae_hiera_tiny_224", cost=0.7),
        Cell("L-MAE", "mae_hiera_large_224", cost=2.5),
        Cell("B-cls", "hiera_base_224"),  # FAIR's classifier default: q_pool 3
        Cell("B-cls q_pool2", "hiera_base_224", model_kwargs={"q_pool": 2}),
        Cell("B-cls amp", "hiera_base_224", dtype="amp"),
        Cell("T-cls", "hiera_tiny_224", cost=0.7),
        Cell("L-cls", "hiera_large_224", cost=2.5),
        Cell("timm B-cls", "timm:hiera_base_224"),
        Cell("B-MAE video 16x224", "mae_hiera_base_16x224", batch=32, mask_ratio=0.9, cost=1.5),
        Cell("B-MAE", "mae_hiera_base_224", mode="compile"),
        Cell("B-MAE", "mae_hiera_base_224", mode="reduce-overhead"),
        Cell("B-cls", "hiera_base_224", mode="compile"),
    ]
    return cells


def exhaustive_cells() -> List[Cell]:
    sizes = [("T", "tiny", 0.7), ("S", "small", 0.8), ("B", "base", 1.0), ("B+", "base_plus", 1.2),
             ("L", "large", 2.5), ("H", "huge", 5.0)]
    cells = []
    for mode in ("eager", "compile", "reduce-overhead"):
        for short, size, cost in sizes:
            batch = 64 if size == "huge" else 128
            for q_pool in (2, 3):
                for dtype in ("bf16", "amp"):
                    suffix = f"q_pool{q_pool}" + (" amp" if dtype == "amp" else "")
                    cells.append(Cell(f"{short}-MAE {suffix}", f"mae_hiera_{size}_224", mode, {"q_pool": q_pool},
                                      batch, dtype, cost=cost))
                    cells.append(Cell(f"{short}-cls {suffix}", f"hiera_{size}_224", mode, {"q_pool": q_pool},
                                      batch, dtype, cost=cost))
            cells.append(Cell(f"timm {short}-cls", f"timm:hiera_{size}_224", mode, batch=batch, cost=cost))
        for short, size, cost in (("B", "base", 1.5), ("B+", "base_plus", 1.8), ("L", "large", 3.5)):
            cells.append(Cell(f"{short}-MAE video 16x224", f"mae_hiera_{size}_16x224", mode, batch=32,
                              mask_ratio=0.9, cost=cost))
            cells.append(Cell(f"{short}-cls video 16x224", f"hiera_{size}_16x224", mode, batch=16, cost=cost))
    return cells


def select(cells: List[Cell], only: Optional[str]) -> List[Cell]:
    if not only:
        return cells
    patterns = [p.strip() for p in only.split(",") if p.strip()]

    def hit(cell: Cell) -> bool:
        for pat in patterns:
            if any(ch in pat for ch in "*?["):
                if fnmatch.fnmatchcase(cell.key, pat) or fnmatch.fnmatchcase(cell.name, pat):
                    return True
            elif pat in cell.key:
                return True
        return False

    return [c for c in cells if hit(c)]


def ordered(cells: List[Cell]) -> List[Cell]:
    """Cheapest mode first, so that a tight budget still gets every eager cell."""
    rank = {"eager": 0, "compile": 2, "reduce-overhead": 3}
    # Stable: keeps the list's own order within a mode. Eager with our CUDA graphs compiles too.
    return sorted(cells, key=lambda c: rank[c.mode] + (1 if c.patch_options.get("graphs") else 0))


def to_spec(cell: Cell, args, device: str):
    from hiera_autopatch import _bench_run

    kwargs = dict(cell.model_kwargs)
    batch, res, steps, warmup = cell.batch, None, args.steps, None
    if args.tiny:  # CPU smoke test: same code paths, models shrunk to seconds
        tiny = dict(_bench_run.TINY_MAE_KWARGS)
        if not cell.model.startswith("mae_"):
            tiny = {k: v for k, v in tiny.items() if not k.startswith("decoder_")}
        kwargs = {**tiny, **kwargs}
        batch, res, warmup = 2, 64, 1
        steps = steps or 2
    return _bench_run.Spec(
        model=cell.model,
        model_kwargs=kwargs,
        batch=batch,
        res=res,
        dtype=cell.dtype,
        mode=cell.mode,
        steps=steps or 20,
        warmup=warmup if warmup is not None else 3,
        mask_ratio=cell.mask_ratio,
        seed=args.seed,
        device=device,
        numerics=not args.no_numerics,
        profile=not args.no_profile,
        hiera_optim=args.hiera_optim,
        patch_options=dict(cell.patch_options),
        label=cell.name,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exhaustive", action="store_true", help="the full sweep instead of the representative set")
    p.add_argument("--only", help="comma list of fnmatch patterns (or substrings) on 'name/mode'")
    p.add_argument("--budget-s", type=float, default=None, help="skip cells that would not finish in this many seconds")
    p.add_argument("--json", default=None, help="output JSON (default benchmarks/results/matrix-<device>.json)")
    p.add_argument("--plot", default=None, help="output PNG (default: the JSON path with .png)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--hiera-optim", action="store_true", help="third side: hiera-optim 0.2.1, when importable")
    p.add_argument("--no-numerics", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="shrink every model (CPU smoke test of the script)")
    p.add_argument("--list", action="store_true", help="print the selected cells and their rough cost, run nothing")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cells = ordered(select(exhaustive_cells() if args.exhaustive else default_cells(), args.only))
    if not cells:
        print("bench_matrix: error: --only matched no cell (see --list)", file=sys.stderr)
        return 2
    if args.list:
        total = 0.0
        for cell in cells:
            total += cell.estimate_s()
            extra = f" {cell.patch_options}" if cell.patch_options else ""
            print(f"{cell.key:<32} {cell.model:<28} B={cell.batch:<4} {cell.dtype:<5} ~{cell.estimate_s():.0f} s{extra}")
        print(f"{len(cells)} cells, ~{total / 60:.1f} min on an H200 (rough)")
        return 0

    import torch

    from hiera_autopatch import _bench_report, _bench_run, bench

    bench.quiet_known_warnings()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    json_path = args.json or os.path.join(ROOT, "benchmarks", "results", f"matrix-{'gpu' if device.startswith('cuda') else 'cpu'}.json")
    plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
    record = _bench_report.new_record(_bench_report.environment(device, ["scripts/bench_matrix.py"] + list(argv or sys.argv[1:])))
    record["matrix"] = {"exhaustive": args.exhaustive, "only": args.only, "budget_s": args.budget_s, "tiny": args.tiny}
    start = time.perf_counter()
    worst = 0
    for n, cell in enumerate(cells, 1):
        spec = to_spec(cell, args, device)
        elapsed = time.perf_counter() - start
        left = None if args.budget_s is None else args.budget_s - elapsed
        if left is not None and left < cell.estimate_s() * (0.05 if args.tiny else 1.0):
            header = _bench_run._cell_header(spec, None)
            header.update(skipped=f"budget: {left:.0f} s left, cell needs ~{cell.estimate_s():.0f} s", speedups={}, speedup=None)
            record["results"].append(header)
            print(f"[{n}/{len(cells)}] {cell.key}: skipped ({header['skipped']})", file=sys.stderr, flush=True)
            _bench_report.write_json(record, json_path)
            continue
        if left is not None and cell.mode != "eager":
            sides = 3 if args.hiera_optim else 2
            spec.side_timeout_s = max(left / sides, 60.0)
        print(f"[{n}/{len(cells)}] {cell.key} ({elapsed:.0f} s elapsed)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            result = bench.run_cell(spec, quiet=args.quiet)
        except Exception as exc:  # a bad cell (unknown model, wrong kwargs) must not end the run
            result = _bench_run._cell_header(spec, None)
            result.update(error=f"{type(exc).__name__}: {exc}", speedups={}, speedup=None)
        result["cell_s"] = time.perf_counter() - t0
        record["results"].append(result)
        record["elapsed_s"] = time.perf_counter() - start
        _bench_report.write_json(record, json_path)
        print(_bench_report.format_cell(result), flush=True)
        print(flush=True)
        worst = max(worst, bench.exit_status([result]))
    try:
        _bench_report.plot(record["results"], plot_path, title=_bench_report.format_environment(record["environment"]))
    except Exception as exc:
        print(f"bench_matrix: plot failed: {exc!r}", file=sys.stderr)
    print(f"wrote {json_path} and {plot_path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return worst


if __name__ == "__main__":
    sys.exit(main())
