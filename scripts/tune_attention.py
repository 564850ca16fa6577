"""Block sizes for our window attention, forward and backward tuned apart: time per config, as JSON.

    python scripts/tune_attention.py --shapes decoder,stage3-global-mae --json out.json

For each Hiera-B shape (``window_attention.HIERA_B_SHAPES``) every candidate config of the forward
launcher and, separately, of the backward launcher is timed as CUDA-graph replays (GPU time, no
launch overhead), and its output / dqkv checked against an fp32 reference on the same input. The
two passes share nothing but the lse layout, so each can take its own blocks (``BLOCK_M_BWD``...).
Stages come second: blocks and warps are searched at the default stages, then the best few
configs are retried at every stage count (``--top 0``: not). ``--configs`` times a given list in
place of the sweep. ``--device cpu`` dry-runs the script in Triton's
interpreter on a tiny batch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from _timing import kernel_ms, results_header, save_json  # scripts/, this script's directory


def _pow2_upto(limit: int, low: int = 16, high: int = 256):
    """16, 32, ... up to the first power of two >= limit (and <= high)."""
    out, block = [], low
    while block <= high:
        out.append(block)
        if block >= limit:
            break
        block *= 2
    return out


def candidates(wa, T: int, S: int, D: int, nw: int, phase: str):
    """Block x warps configs for one phase ("fwd" or "bwd") at the default stages: query blocks
    16-128, key blocks 32-256, 4 or 8 warps (and 2 for tiles up to 64 x 64)."""
    base = wa.default_config(T, S, D, nw)
    G = base["G"]
    suffix = "" if phase == "fwd" else "_BWD"
    warp_key = "num_warps" if phase == "fwd" else "num_warps_bwd"
    out = []
    for bm, bn, w in itertools.product(_pow2_upto(G * (T // S), high=128), _pow2_upto(G * T, low=32),
                                       (2, 4, 8)):
        if bm * bn > 128 * 128 or (w == 2 and bm * bn > 64 * 64):
            continue
        out.append({"BLOCK_M" + suffix: bm, "BLOCK_N" + suffix: bn, warp_key: w})
    return out


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="decoder,stage3-global-mae")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--stages", default="1,2,3", help="stage counts tried on the best configs")
    ap.add_argument("--top", type=int, default=3, help="configs retried at every stage count")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting configs after this")
    ap.add_argument("--phases", default="fwd,bwd", help="which passes to tune (comma list)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--configs", type=json.loads, default=None,
                    help='JSON {"fwd": [config, ...], "bwd": [...]}: time these in place of the sweep')
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from hiera_autopatch.ops.triton import window_attention as wa

    started = time.time()
    dev = args.device
    shapes = {s[0]: s for s in wa.HIERA_B_SHAPES}
    results = results_header(args.batch, dev)

    def save():
        save_json(args.json, results)

    def gpu_ms(fn):
        return kernel_ms(fn, dev, warmup=2)

    for name in [n for n in args.shapes.split(",") if n]:
        _, nw, T, H, D, S = shapes[name]
        Tq = T // S
        gen = torch.Generator(device=dev).manual_seed(0)
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        qkv = torch.randn(args.batch, T * nw, 3 * H * D, device=dev, dtype=dtype, generator=gen)
        dout = torch.randn(args.batch, Tq * nw, H * D, device=dev, dtype=dtype, generator=gen)
        x32 = qkv.float().requires_grad_(True)
        ref = wa.window_attention_reference(x32, nw, H, S, "max")
        (dref,) = torch.autograd.grad(ref, x32, dout.float())
        out0, lse0 = wa.window_attention_forward(qkv, nw, H, S)  # default config: backward's input
        entry = results["shapes"][name] = {"nw": nw, "T": T, "H": H, "D": D, "S": S,
                                           "default": wa.full_config(None, T, S, D, nw), "trials": []}

        def trial(phase, cfg):
            out = torch.empty_like(out0)
            dqkv = torch.empty_like(qkv)
            if phase == "fwd":
                fn = lambda: wa.window_attention_forward(qkv, nw, H, S, cfg, out=out)  # noqa: E731
            else:
                fn = lambda: wa.window_attention_backward(dout, qkv, out0, lse0, nw, H, S, "max", cfg,  # noqa: E731
                                                          dqkv=dqkv)
            record = {"phase": phase, "config": cfg}
            try:
                record["ms"] = gpu_ms(fn)
                record["rel_err"] = rel_err(out, ref) if phase == "fwd" else rel_err(dqkv, dref)
            except Exception as exc:  # a config that does not compile or fit: recorded, skipped
                record["error"] = repr(exc)[:200]
            entry["trials"].append(record)
            return record

        for phase in [p for p in ("fwd", "bwd") if p in args.phases.split(",")]:
            default = trial(phase, {})
            entry[f"{phase}_default_ms"] = default.get("ms")
            tried = [default]
            configs = args.configs.get(phase, []) if args.configs else candidates(wa, T, S, D, nw, phase)
            for cfg in configs:
                if time.time() - started > args.budget_s:
                    entry["cut_short"] = True
                    break
                tried.append(trial(phase, cfg))
            ok = sorted((t for t in tried if "ms" in t), key=lambda t: t["ms"])
            stage_key = "num_stages" if phase == "fwd" else "num_stages_bwd"
            for best in ok[: args.top]:
                for stages in (int(s) for s in args.stages.split(",")):
                    if time.time() - started > args.budget_s:
                        break
                    if stages != wa.default_config(T, S, D, nw)["num_stages"]:
                        tried.append(trial(phase, dict(best["config"], **{stage_key: stages})))
            bound = 2 * max(default.get("rel_err", 0), 1e-3)  # as accurate as the default, or close
            ok = sorted((t for t in tried if "ms" in t and t["rel_err"] <= bound), key=lambda t: t["ms"])
            if ok:
                entry[f"{phase}_best"] = {"config": ok[0]["config"], "ms": ok[0]["ms"], "rel_err": ok[0]["rel_err"],
                                          "full": wa.full_config(ok[0]["config"], T, S, D, nw)}
            print(f"{name} {phase}: default {entry[f'{phase}_default_ms']} ms, best {entry.get(f'{phase}_best')}",
                  file=sys.stderr, flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
