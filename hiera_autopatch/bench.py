"""``python -m hiera_autopatch bench``: FAIR/timm Hiera as is vs patched, side by side.

    python -m hiera_autopatch bench                      # CPU: a tiny MAE; GPU: Hiera-B MAE 224, B=128, bf16
    python -m hiera_autopatch bench --model hiera_base_224 --dtype amp --mode all --json out.json --plot out.png
    python -m hiera_autopatch bench --model timm:hiera_base_224
    python -m hiera_autopatch bench --model models.hiera:mae_hiera_base_224 --model-kwargs '{"q_pool": 3}'

Each step is one training step without the optimizer: forward, loss, backward. Eager runs both
sides in this process on one model and the same inputs, interleaved step by step (AB BA AB ...); ``compile`` and ``reduce-overhead`` run each side in a fresh interpreter,
because torch.compile does not notice a method patched after it inlined the original. Warm-up and
compilation are excluded from the timings and reported on their own. Loss and every gradient are
compared between sides outside the timed region.

Exit status: 0 fine, 1 a side failed, 2 bad arguments, 3 numerics differ beyond the dtype's limit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import List, Optional

PROG = "python -m hiera_autopatch bench"
MODE_CHOICES = ("eager", "compile", "reduce-overhead", "all")
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "amp")

GPU_DEFAULTS = dict(model="mae_hiera_base_224", batch=128, steps=20, warmup=3, dtype="bf16")
CPU_DEFAULTS = dict(model="mae_hiera_tiny_224", batch=4, steps=5, warmup=1, dtype="fp32", res=96)
"""No --model on a CPU: a Hiera-T-shaped MAE shrunk to run in seconds (``TINY_MAE_KWARGS``)."""


class UsageError(Exception):
    """Bad arguments: printed as one line naming the flag, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage block
        raise UsageError(message)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError
    return value


_positive_int.__name__ = "positive integer"


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


_nonneg_int.__name__ = "non-negative integer"


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError
    return value


_ratio.__name__ = "ratio in [0, 1)"


def _input_size(text: str) -> List[int]:
    parts = text.replace(",", "x").lower().split("x")
    if len(parts) not in (1, 2, 3):
        raise ValueError
    values = [int(p) for p in parts]
    if any(v <= 0 for v in values):
        raise ValueError
    return values * 2 if len(values) == 1 else values


_input_size.__name__ = "size like 224x224 or 16x224x224"


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError
    return value


_json_object.__name__ = "JSON object"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Time FAIR/timm Hiera unpatched vs patched by hiera_autopatch.")
    p.add_argument(
        "--model",
        help="FAIR name (mae_hiera_base_224, hiera_base_224, mae_hiera_base_16x224, ...), timm:NAME, "
        "or module:factory (an in-tree copy). Default: GPU mae_hiera_base_224; CPU a tiny MAE.",
    )
    p.add_argument("--model-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='constructor arguments, e.g. \'{"q_pool": 3, "embed_dim": 48}\' (override the factory\'s)')
    p.add_argument("--batch", type=_positive_int, help="batch size (GPU default 128, CPU 4)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--res", type=_positive_int, help="spatial resolution R (input RxR, or TxRxR for video)")
    size.add_argument("--input-size", type=_input_size, metavar="HxW|TxHxW", help="full input size")
    p.add_argument("--in-chans", type=_positive_int, help="input channels (default: the model's, 3)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES,
                   help="parameters and inputs in bf16/fp16/fp32, or amp = fp32 params + bf16 autocast "
                   "(GPU default bf16, CPU fp32)")
    p.add_argument("--mode", choices=MODE_CHOICES, default="eager", help="eager (default), compile, reduce-overhead or all")
    p.add_argument("--steps", type=_positive_int, help="timed steps per side (GPU default 20, CPU 5)")
    p.add_argument("--warmup", type=_nonneg_int, help="untimed steps per side before timing (GPU 3, CPU 1); on a GPU more until 2 s have passed after the first")
    p.add_argument("--mask-ratio", type=_ratio, default=None, help="MAE mask ratio (FAIR default 0.6)")
    p.add_argument("--task", choices=("auto", "mae", "cls"), default="auto",
                   help="mae: loss = model(x)[0]; cls: cross-entropy on the logits; auto: by forward's signature")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--json", metavar="PATH", help="write every number and the environment here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the speed-ups (log scale, 1x in the middle)")
    p.add_argument("--no-numerics", action="store_true", help="skip the loss/gradient comparison")
    p.add_argument("--no-fp32-reference", action="store_true",
                   help="bf16/fp16/amp: compare the sides directly instead of against an fp32 step")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler step that names the attention kernels")
    p.add_argument("--graphs", action="store_true",
                   help="patched side with CUDA-graph capture (as HIERA_OPTIM_GRAPHS=1); sides run in separate processes")
    p.add_argument("--attention", choices=("auto", "sdpa", "triton"), default=None,
                   help="patched side's attention backend (as HIERA_OPTIM_ATTENTION; default: the environment's, auto)")
    p.add_argument("--hiera-optim", action="store_true",
                   help="add hiera-optim (if installed) as a third side, in its own process")
    p.add_argument("--isolate", action="store_true", help="run eager sides in separate processes too")
    p.add_argument("--side-timeout", type=float, default=None, metavar="S", help="give up on a side process after S seconds")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    return p


def parse(argv: List[str]):
    """Parsed arguments plus the device they resolve to. Raises UsageError."""
    args = build_parser().parse_args(argv)
    if args._child:
        return args, None
    import torch  # after parsing: a typo never waits for torch to import

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"argument --device: {device!r} is not a device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("argument --device: CUDA is not available here")
    if dev.type not in ("cuda", "cpu"):
        raise UsageError(f"argument --device: {device!r} is not supported (cuda or cpu)")
    return args, dev


def specs_from_args(args, device) -> list:
    from . import _bench_run

    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    model_kwargs = args.model_kwargs
    res = args.res
    if args.model is None:
        model = defaults["model"]
        if device.type == "cpu":
            model_kwargs = {**_bench_run.TINY_MAE_KWARGS, **(model_kwargs or {})}
            if args.input_size is None and res is None:
                res = defaults["res"]
    else:
        model = args.model
    modes = list(_bench_run.MODES) if args.mode == "all" else [args.mode]
    patch_options = {}
    if args.graphs:
        patch_options["graphs"] = True
    if args.attention:
        patch_options["attention"] = args.attention
    specs = []
    for mode in modes:
        specs.append(
            _bench_run.Spec(
                model=model,
                model_kwargs=model_kwargs or {},
                batch=args.batch or defaults["batch"],
                input_size=args.input_size,
                res=res,
                in_chans=args.in_chans,
                dtype=args.dtype or defaults["dtype"],
                mode=mode,
                steps=args.steps or defaults["steps"],
                warmup=args.warmup if args.warmup is not None else (max(defaults["warmup"], 3) if mode != "eager" else defaults["warmup"]),
                mask_ratio=args.mask_ratio if args.mask_ratio is not None else _bench_run.DEFAULT_MASK_RATIO,
                task=args.task,
                seed=args.seed,
                device=str(device),
                numerics=not args.no_numerics,
                fp32_reference=not args.no_fp32_reference,
                patch_options=patch_options,
                profile=not args.no_profile,
                hiera_optim=args.hiera_optim,
                isolate=args.isolate,
                side_timeout_s=args.side_timeout,
            )
        )
    return specs


def run_cell(spec, quiet: bool = False, log=None) -> dict:
    """Measure one cell; a failure is recorded in the cell, never raised (except bad arguments)."""
    import torch

    from . import _bench_report, _bench_run

    log = log or (lambda msg: print(msg, file=sys.stderr))
    device = torch.device(spec.device)
    sides = list(_bench_run.SIDES)
    note = None
    if spec.hiera_optim:
        if _bench_run.hiera_optim_available():
            sides.append(_bench_run.THIRD_SIDE)
        else:
            note = "hiera_optim is not importable here: third side skipped"
            log(f"hiera_autopatch bench: {note}")
    # Graph capture keeps state across steps that toggling patches every step would disturb.
    isolated = spec.mode != "eager" or spec.isolate or len(sides) > 2 or bool(spec.patch_options.get("graphs"))
    try:
        if isolated:
            with tempfile.TemporaryDirectory(prefix="hiera_bench_") as workdir:
                cell = _bench_run.run_isolated(spec, tuple(sides), workdir, log=log)
        else:
            total = 2 * (spec.warmup + spec.steps)
            progress = _bench_report.Progress(total, f"{spec.label or 'bench'} {spec.mode}", enabled=not quiet)
            try:
                cell = _bench_run.run_in_process(spec, device, progress)
            finally:
                progress.close()
    except _bench_run.BenchError:
        raise
    except Exception as exc:
        import traceback

        cell = _bench_run._cell_header(spec, None)
        cell["error"] = f"{type(exc).__name__}: {exc}"
        cell["traceback"] = traceback.format_exc()[-4000:]
        cell["speedups"], cell["speedup"] = {}, None
        if device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    if note:
        cell["note"] = note
    return cell


def exit_status(cells: list) -> int:
    if any(c.get("error") for c in cells):
        return 1
    for cell in cells:
        for key in ("numerics", "numerics_hiera_optim"):
            if cell.get(key) and not cell[key]["ok"]:
                return 3
    return 0


def quiet_known_warnings() -> None:
    """hiera-transformer imports ``timm.models.layers``; its FutureWarning is not the user's to fix."""
    import warnings

    warnings.filterwarnings("ignore", message="Importing from timm.models.layers is deprecated", category=FutureWarning)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, device = parse(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args._child:
        from . import _bench_run

        quiet_known_warnings()
        return _bench_run.child_main(args._child)

    from . import _bench_report, _bench_run

    quiet_known_warnings()
    try:
        specs = specs_from_args(args, device)
        record = _bench_report.new_record(_bench_report.environment(str(device), PROG.split() + argv))
        cells = []
        for spec in specs:
            cell = run_cell(spec, quiet=args.quiet)
            cells.append(cell)
            record["results"] = cells
            if args.json:
                _bench_report.write_json(record, args.json)
            print(_bench_report.format_cell(cell) if len(cells) > 1 else _bench_report.format_record(record), flush=True)
            print(flush=True)
    except _bench_run.BenchError as exc:
        print(f"{PROG}: error: argument {exc}", file=sys.stderr)
        return 2
    if args.plot:
        _bench_report.plot(cells, args.plot, title=_bench_report.format_environment(record["environment"]))
    return exit_status(cells)


if __name__ == "__main__":
    sys.exit(main())
