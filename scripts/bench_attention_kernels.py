#!/usr/bin/env python3
"""Mask-unit attention on the real Hiera-B shapes: FAIR 5-D SDPA vs 4-D SDPA vs our Triton kernel.

    python scripts/bench_attention_kernels.py --json $OUT/attn.json

For each shape (B=128, bf16): errors of each variant against an fp32 reference (out and dqkv,
same input and upstream grad; Triton's buffers are NaN-poisoned first to catch unwritten
elements), then the median forward and forward+backward time of
  fair_5d  FAIR's path: 5-D q/k/v views into SDPA (the math kernel), transpose+reshape out
  sdpa_4d  q/k/v copied to (B*nw, H, T, D), q pooled, fused SDPA, output permuted back
  triton   hiera_autopatch.ops.triton.window_attention (with a small autotune, time permitting)
Prints a table last and writes JSON {shape, ms per variant, winner, errors, failures}.

Robustness: the measuring runs in a child process that appends one JSON line per result; if it
dies (a kernel fault poisons the CUDA context), the parent records the error against the step
that was running and starts a new child for the remaining shapes. One variant failing inside a
shape is caught and recorded; the others still run. A global deadline keeps the run < 2 min.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _timing import graph_replay_ms  # noqa: E402  (scripts/, this script's directory)
from hiera_autopatch.ops.triton.window_attention import HIERA_B_SHAPES as SHAPES  # noqa: E402

VARIANTS = ("fair_5d", "sdpa_4d", "triton", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
COPY_TBPS = 4.3  # device-to-device copy measured on these H200s (KINDS.md): the bytes floor


# ------------------------------------------------------------------------------------------------
# The variants (all take qkv (B, N, 3*H*D) and return (B, Tq*nw, H*D))
# ------------------------------------------------------------------------------------------------


def fair_5d(qkv, nw, H, S, pool="max"):
    from hiera_autopatch.ops.triton.window_attention import window_attention_reference

    return window_attention_reference(qkv, nw, H, S, pool)


def sdpa_4d(qkv, nw, H, S, pool="max"):
    import torch.nn.functional as F

    B, N, C3 = qkv.shape
    D = C3 // (3 * H)
    T = N // nw
    Tq = T // S
    x = qkv.view(B, T, nw, 3, H, D).permute(3, 0, 2, 4, 1, 5)  # (3, B, nw, H, T, D), strided
    q, k, v = x[0], x[1], x[2]
    if S > 1:
        q = q.reshape(B, nw, H, S, Tq, D)  # (B, nw, H, S, Tq, D)
        q = q.max(dim=3).values if pool == "max" else q.amax(dim=3)  # (B, nw, H, Tq, D)
    q = q.reshape(B * nw, H, Tq, D)  # copies (when not pooled)
    k = k.reshape(B * nw, H, T, D)
    v = v.reshape(B * nw, H, T, D)
    o = F.scaled_dot_product_attention(q, k, v)  # (B*nw, H, Tq, D)
    return o.view(B, nw, H, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq * nw, H * D)


def sdpa_backend_variant(name):
    """sdpa_4d with PyTorch's choice of fused kernel pinned to one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(qkv, nw, H, S, pool="max"):
        with sdpa_kernel([backend]):
            return sdpa_4d(qkv, nw, H, S, pool)

    return run


def triton_variant(config):
    from hiera_autopatch.ops.triton.window_attention import window_attention

    def run(qkv, nw, H, S, pool="max"):
        return window_attention(qkv, nw, H, S, pool, config)

    return run


# ------------------------------------------------------------------------------------------------
# Worker: measures the shapes it is given, one JSON line per result
# ------------------------------------------------------------------------------------------------


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _err(out, ref, grad, gref):
    import torch

    return {
        "out_rel": _rel(out, ref),
        "out_max_abs": (out.float() - ref).abs().max().item(),
        "dqkv_rel": _rel(grad, gref),
        "dqkv_max_abs": (grad.float() - gref).abs().max().item(),
        "finite": bool(torch.isfinite(out).all().item() and torch.isfinite(grad).all().item()),
    }


def _candidates(T, S, D, nw, sweep=False):
    """A few configs around the default: warps flipped, twice the windows per program, half the
    query rows. Default first. ``sweep``: every key block x query block x warps combination
    (single windows only)."""
    from hiera_autopatch.ops.triton.window_attention import default_config

    base = default_config(T, S, D, nw)
    out = [base]
    if sweep:
        Tq = T // S
        for bn in (64, 128, 256):
            if bn >= 2 * max(16, 1 << (T - 1).bit_length()):
                continue
            for bm in (16, 32, 64):
                if bm >= 2 * max(16, 1 << (Tq - 1).bit_length()):
                    continue
                for warps, warps_bwd in ((4, 4), (4, 8), (8, 4), (8, 8)):
                    out.append(dict(base, G=1, BLOCK_N=bn, BLOCK_M=bm, num_warps=warps,
                                    num_warps_bwd=warps_bwd))
    flip = dict(base, num_warps=12 - base["num_warps"], num_warps_bwd=12 - base["num_warps_bwd"])
    out.append(flip)
    if base["G"] * T * 2 <= 128 and base["G"] * 2 <= nw:
        g2 = 2 * base["G"]
        bn = max(16, 1 << (g2 * T - 1).bit_length())
        bm = max(16, min(128, 1 << (g2 * (T // S) - 1).bit_length()))
        out.append(dict(base, G=g2, BLOCK_N=bn, BLOCK_M=bm, num_warps=4 if bm * bn <= 4096 else 8))
    if base["BLOCK_M"] > 16:
        out.append(dict(base, BLOCK_M=base["BLOCK_M"] // 2))
    if T > 64 and base["BLOCK_N"] < 256 and T <= 256 and D <= 64:
        out.append(dict(base, BLOCK_N=256, num_warps=8, num_warps_bwd=8))
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq


def worker(args):
    import torch

    try:
        from triton.testing import do_bench
    except Exception:  # fall back to CUDA events
        do_bench = None

    dev = args.device  # "cpu" only to dry-run this script under TRITON_INTERPRET=1

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def bench(fn, rep_ms):
        if dev == "cpu":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        if args.graph:
            try:
                return graph_replay_ms(fn)
            except Exception as exc:  # capture can fail (e.g. a backend that syncs): time eagerly
                print(f"cuda graph timing failed ({exc!r}); eager timing", file=sys.stderr)
        if do_bench is not None:
            return float(do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms,
                                  return_mode="median"))
        for _ in range(5):
            fn()
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[len(times) // 2]

    deadline = float(args.deadline)
    tune_deadline = float(args.tune_deadline)
    jsonl = open(args.jsonl, "a", buffering=1)

    def emit(**rec):
        jsonl.write(json.dumps(rec) + "\n")

    def cuda_alive():
        try:
            sync()
            torch.zeros(1, device=dev).add_(1).item()
            return True
        except Exception:
            return False

    B, dtype, pool = args.batch, getattr(torch, args.dtype), args.pool
    from hiera_autopatch.ops.triton import window_attention as wa

    shapes = {s[0]: s for s in SHAPES}
    for name in args.shapes.split(","):
        _, nw, T, H, D, S = shapes[name]
        Tq = T // S
        emit(shape=name, step="begin")
        gen = torch.Generator(device=dev).manual_seed(0)
        qkv = torch.randn(B, T * nw, 3 * H * D, device=dev, dtype=dtype, generator=gen)
        dout = torch.randn(B, Tq * nw, H * D, device=dev, dtype=dtype, generator=gen)

        # fp32 reference on the same (bf16-valued) input and upstream grad
        x32 = qkv.float().requires_grad_(True)
        ref = fair_5d(x32, nw, H, S, pool)
        (gref,) = torch.autograd.grad(ref, x32, dout.float())
        ref = ref.detach()
        del x32

        variants = {"fair_5d": fair_5d, "sdpa_4d": sdpa_4d}
        for backend in ("flash", "efficient", "cudnn"):
            variants[f"sdpa_{backend}"] = sdpa_backend_variant(backend)
        if "triton" in args.variants:
            if wa.supports(qkv, nw, H, S):
                variants["triton"] = triton_variant(None)
            else:
                emit(shape=name, variant="triton", step="error",
                     error="supports() returned False for this shape")
        for vname in [v for v in args.variants if v in variants]:
            if time.time() > deadline:
                emit(shape=name, variant=vname, step="error", error="skipped: out of time")
                continue
            emit(shape=name, variant=vname, step="start")
            try:
                fn = variants[vname]
                # correctness (triton: poisoned buffers through the launchers, then autograd)
                if vname == "triton":
                    o = torch.full((B, Tq * nw, H * D), float("nan"), device=dev, dtype=dtype)
                    o, lse = wa.window_attention_forward(qkv, nw, H, S, out=o)
                    g = torch.full_like(qkv, float("nan"))
                    wa.window_attention_backward(dout, qkv, o, lse, nw, H, S, pool, dqkv=g)
                    sync()
                    emit(shape=name, variant=vname, step="errors", **_err(o, ref, g, gref))
                x = qkv.detach().clone().requires_grad_(True)
                o = fn(x, nw, H, S, pool)
                (g,) = torch.autograd.grad(o, x, dout)
                sync()
                emit(shape=name, variant=vname, step="errors_autograd", **_err(o, ref, g, gref))
                del o, g

                # autotune (triton only, while the tuning budget lasts): fwd+bwd time decides
                tuned = None
                if vname == "triton" and not args.no_autotune and time.time() < tune_deadline:
                    trials = []
                    for cfg in _candidates(T, S, D, nw, sweep=args.sweep):
                        if time.time() > tune_deadline:
                            break
                        try:
                            f = triton_variant(cfg)
                            ms = bench(lambda: torch.autograd.grad(f(x, nw, H, S, pool), x, dout),
                                       30)
                            trials.append({"config": cfg, "fwd_bwd_ms": ms})
                        except Exception as e:  # a config that does not compile / fit
                            if not cuda_alive():
                                raise
                            trials.append({"config": cfg, "error": repr(e)[:300]})
                    ok = [t for t in trials if "fwd_bwd_ms" in t]
                    if ok:
                        tuned = min(ok, key=lambda t: t["fwd_bwd_ms"])["config"]
                        fn = triton_variant(tuned)
                        o = fn(x, nw, H, S, pool)
                        (g,) = torch.autograd.grad(o, x, dout)
                        emit(shape=name, variant=vname, step="errors_tuned", **_err(o, ref, g, gref))
                        del o, g
                    emit(shape=name, variant=vname, step="autotune", trials=trials, best=tuned)

                with torch.no_grad():
                    fwd = bench(lambda: fn(qkv, nw, H, S, pool), args.rep_ms)
                fwd_bwd = bench(lambda: torch.autograd.grad(fn(x, nw, H, S, pool), x, dout),
                                args.rep_ms)
                emit(shape=name, variant=vname, step="time", fwd_ms=fwd, fwd_bwd_ms=fwd_bwd,
                     config=tuned)
            except Exception as e:
                emit(shape=name, variant=vname, step="error",
                     error="".join(traceback.format_exception_only(type(e), e)).strip()[-1500:])
                if not cuda_alive():
                    emit(shape=name, step="cuda_dead")
                    return 3
        emit(shape=name, step="end")
        del qkv, dout, ref, gref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0


# ------------------------------------------------------------------------------------------------
# Parent: runs workers until every shape is done or failed, then aggregates
# ------------------------------------------------------------------------------------------------


def _floor_us(B, nw, T, H, D, S, elt=2):
    """Bytes floor at the measured copy bandwidth: fwd reads qkv, writes out; bwd reads qkv and
    dout, writes dqkv."""
    qkv = B * nw * T * 3 * H * D * elt
    out = B * nw * (T // S) * H * D * elt
    return {"fwd_us": (qkv + out) / COPY_TBPS / 1e6, "fwd_bwd_us": (3 * qkv + 2 * out) / COPY_TBPS / 1e6}


def parent(args):
    t0 = time.time()
    deadline = t0 + args.budget_s
    tune_deadline = t0 + args.tune_budget_s
    names = [s[0] for s in SHAPES]
    if args.shapes:
        names = [n for n in args.shapes.split(",") if n]
        unknown = set(names) - {s[0] for s in SHAPES}
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {[s[0] for s in SHAPES]}")
    out_dir = Path(args.json).resolve().parent if args.json else Path.cwd()
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "attn_bench_records.jsonl"
    jsonl.write_text("")
    logs = []
    remaining = list(names)
    while remaining and time.time() < deadline:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--jsonl", str(jsonl),
               "--shapes", ",".join(remaining), "--batch", str(args.batch), "--pool", args.pool,
               "--variants", ",".join(args.variants), "--rep-ms", str(args.rep_ms),
               "--device", args.device, "--dtype", args.dtype,
               "--deadline", str(deadline), "--tune-deadline", str(tune_deadline)]
        if args.no_autotune:
            cmd.append("--no-autotune")
        if args.sweep:
            cmd.append("--sweep")
        if not args.graph:
            cmd.append("--no-graph")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True,
                               timeout=max(5.0, deadline - time.time() + 15))
            rc, err = p.returncode, (p.stderr or "")[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", str(e)[-3000:]
        logs.append({"rc": rc, "stderr_tail": err})
        recs = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()]
        ended = {r["shape"] for r in recs if r.get("step") == "end"}
        began = [r["shape"] for r in recs if r.get("step") == "begin"]
        if rc == 0 and all(n in ended for n in remaining):
            remaining = []
            break
        # the worker died (or gave up) inside the last shape it began: record, skip it, go on
        broken = next((n for n in reversed(began) if n not in ended), None)
        with open(jsonl, "a") as f:
            if broken is not None:
                last = [r for r in recs if r["shape"] == broken and r.get("step") == "start"]
                f.write(json.dumps({"shape": broken, "variant": last[-1]["variant"] if last else None,
                                    "step": "error", "error": f"worker exit {rc}: {err[-800:]}"}) + "\n")
                f.write(json.dumps({"shape": broken, "step": "end"}) + "\n")
            else:  # died before beginning any shape: don't loop forever
                for n in remaining:
                    f.write(json.dumps({"shape": n, "step": "error", "variant": None,
                                        "error": f"worker exit {rc}: {err[-800:]}"}) + "\n")
                remaining = []
                break
        done = ended | ({broken} if broken else set())
        remaining = [n for n in remaining if n not in done]

    recs = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()]
    results = []
    shape_of = {s[0]: s for s in SHAPES}
    for n in names:
        _, nw, T, H, D, S = shape_of[n]
        rs = [r for r in recs if r["shape"] == n]
        res = {"shape": {"name": n, "B": args.batch, "nw": nw, "T": T, "H": H, "D": D, "S": S,
                         "dtype": args.dtype, "pool": args.pool},
               "floor": _floor_us(args.batch, nw, T, H, D, S), "ms": {}, "errors": {},
               "failures": {}, "autotune": None}
        for r in rs:
            v, step = r.get("variant"), r.get("step")
            body = {k: x for k, x in r.items() if k not in ("shape", "variant", "step")}
            if step == "time":
                res["ms"][v] = {"fwd": body["fwd_ms"], "fwd_bwd": body["fwd_bwd_ms"]}
                if v == "triton":
                    res["triton_config"] = body.get("config")
            elif step in ("errors", "errors_autograd", "errors_tuned"):
                key = {"errors": f"{v}_poisoned", "errors_autograd": v,
                       "errors_tuned": f"{v}_tuned"}[step]
                res["errors"][key] = body
            elif step == "autotune":
                res["autotune"] = body
            elif step == "error":
                res["failures"][v or "all"] = body["error"]
            elif step == "cuda_dead":
                res["failures"]["cuda"] = "CUDA context dead after this shape's failure"
        if n in remaining:
            res["failures"]["all"] = "not run: out of time"
        timed = {v: m["fwd_bwd"] for v, m in res["ms"].items()}
        res["winner"] = min(timed, key=timed.get) if timed else None
        tri = res["errors"].get("triton")
        res["triton_correct"] = (None if tri is None else bool(
            tri["finite"] and tri["out_rel"] < 2e-2 and tri["dqkv_rel"] < 2e-2
            and all(e["finite"] and e["out_rel"] < 2e-2 and e["dqkv_rel"] < 2e-2
                    for k, e in res["errors"].items() if k.startswith("triton_"))))
        results.append(res)

    env = {}
    try:
        import torch

        env = {"torch": torch.__version__,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        import triton

        env["triton"] = triton.__version__
    except Exception as e:
        env["import_error"] = repr(e)
    doc = {"env": env, "batch": args.batch, "variants": list(args.variants), "results": results,
           "worker_runs": logs, "elapsed_s": round(time.time() - t0, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))

    # the table, last
    print(f"\n{'shape':<20} {'floor':>6} " + " ".join(f"{v + ' f/fb':>17}" for v in args.variants)
          + f" {'winner':>8} {'tri out/dqkv rel':>17} {'fair':>17}")
    for res in results:
        row = f"{res['shape']['name']:<20} {res['floor']['fwd_bwd_us'] / 1000:6.3f} "
        for v in args.variants:
            m = res["ms"].get(v)
            row += (f"{m['fwd']:7.3f}/{m['fwd_bwd']:7.3f}  " if m else
                    f"{'FAIL' if v in res['failures'] else '-':>15}  ")
        tri, fair = res["errors"].get("triton"), res["errors"].get("fair_5d")
        fmt = lambda e: f"{e['out_rel']:.1e}/{e['dqkv_rel']:.1e}" if e else "-"
        row += f"{str(res['winner']):>8} {fmt(tri):>17} {fmt(fair):>17}"
        if res["triton_correct"] is False:
            row += "  TRITON WRONG"
        print(row)
    for res in results:
        for v, e in res["failures"].items():
            print(f"FAILED {res['shape']['name']} {v}: {str(e).strip().splitlines()[-1][:200]}")
    print(f"(ms, median; floor = bytes at {COPY_TBPS} TB/s, fwd+bwd; errors vs fp32 reference; "
          f"{doc['elapsed_s']} s)")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--pool", choices=("max", "amax"), default="max")
    ap.add_argument("--shapes", default="", help="comma list (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench repeat time per timing")
    ap.add_argument("--budget-s", type=float, default=105.0, help="stop starting work after this")
    ap.add_argument("--tune-budget-s", type=float, default=45.0,
                    help="autotune only until this many seconds into the run")
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="autotune over every block/warps combination")
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                    help="time CUDA-graph replays (GPU time, no launch overhead); --no-graph: do_bench")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: dry run of this script only (TRITON_INTERPRET=1, tiny --batch)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", help=argparse.SUPPRESS)
    ap.add_argument("--tune-deadline", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    bad = set(args.variants) - set(VARIANTS)
    if bad:
        raise SystemExit(f"unknown variants {sorted(bad)}; known: {VARIANTS}")
    if args.worker:
        return worker(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
