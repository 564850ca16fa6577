"""GELU in the MLP GEMMs' epilogue (ops/triton/gemm_gelu.py) against what the graphed step runs now.

    python scripts/bench_gemm_gelu.py --json out.json [--shapes decoder,stage3] [--budget-s 240]

For each Hiera-B MAE MLP shape (batch 128, bf16), two pairs of ops, each timed as CUDA-graph
replays (GPU time, no launch overhead):

- forward:  ``hidden = x @ w1^T + b1; act = gelu(hidden)``
- backward: ``d_hidden = gelu'(hidden) * (d_out @ w2); act = gelu(hidden)`` (fc2's data gradient
  with GELU's backward, and the recomputed GELU that fc2's weight gradient reads), and fc1's bias
  gradient ``d_hidden.sum(0)``

``baseline`` is what the graphed step runs: forward, the pair compiled by Inductor (cuBLAS GEMM plus
a fused Triton elementwise kernel); backward, cuBLAS plus our GELU-backward kernel with the bias
sums (``ops/triton/gelu.py``). ``fused`` is our one-GEMM kernel (the backward's bias sums kept per
row block in its epilogue, then added up) over a grid of block configs.
Every timed config is checked against an fp32 reference, as accurate as the baseline or close.
The JSON gives, per shape and pass, both times, the best config, and the saving per step (calls
per step x difference). ``--device cpu`` dry-runs the script in Triton's interpreter on tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _timing import kernel_ms, results_header, save_json  # scripts/, this script's directory

# name: (tokens per sample, width C, hidden Hid, MLP calls per step) for Hiera-B MAE at 224 px,
# mask 0.6 (19 of 49 mask units kept): stage s has 19*64/4^(s-1) tokens; the decoder sees all 196
SHAPES = {  # decoder and stage 3 first: the largest GELU kernels of the step (h200_profile_final.json)
    "decoder": (196, 512, 2048, 8),
    "stage3": (76, 384, 1536, 16),
    "stage1": (1216, 96, 384, 2),
    "stage2": (304, 192, 768, 3),
    "stage4": (19, 768, 3072, 2),
}


BLOCKS = (  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the usual Hopper bf16 GEMM tiles
    (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 256, 64, 8, 4),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 5), (64, 64, 64, 4, 4),
)


FETCHES = {"persistent": {"TMA": 1, "PERSISTENT": 1}, "tma": {"TMA": 1}, "pointers": {"TMA": 0}}
"""how a config fetches its tiles: persistent TMA (one program per SM), TMA, pointers"""


def candidates(fetches=tuple(FETCHES.values())):
    """Each of ``BLOCKS`` with each way of fetching tiles: 24 configs, so that Triton's compiles (a
    second or two each, shared by shapes) fit a short run."""
    for fetch in fetches:
        for bm, bn, bk, warps, stages in BLOCKS:
            yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
                   "num_stages": stages, **fetch}


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting configs after this")
    ap.add_argument("--fetch", default=",".join(FETCHES), help="which of persistent,tma,pointers to try")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from hiera_autopatch.ops.triton import gemm_gelu as gg

    dev = args.device
    started = time.time()
    results = results_header(args.batch, dev)

    def save():
        save_json(args.json, results)

    def gpu_ms(fn):
        return kernel_ms(fn, dev)

    # the baselines as the graphed step runs them: forward, Inductor's cuBLAS GEMM + fused GELU
    # kernel (eager ops in the interpreter dry run); backward, the cuBLAS GEMM + our GELU backward
    # with fc1's bias gradient (ops/mlp.GeluMlp.backward)
    compile_ = (lambda fn: torch.compile(fn, dynamic=False)) if dev == "cuda" else (lambda fn: fn)
    from hiera_autopatch.ops.triton import gelu as triton_gelu

    def shipped_backward(d_out, w2, hidden):
        act, d_hidden, d_bias = triton_gelu.gelu_backward_bias(d_out.matmul(w2), hidden)
        return d_hidden, act, d_bias

    for name in [n for n in args.shapes.split(",") if n]:
        if time.time() - started > args.budget_s:
            results["not_run"] = results.get("not_run", []) + [name]  # no time left for its baselines
            continue
        tokens, C, Hid, calls = SHAPES[name]
        if dev == "cpu":  # tiny, odd sizes: masks on every edge
            M, C, Hid = 37, 24, 40
        else:
            M = args.batch * tokens
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(M, C, device=dev, dtype=dtype, generator=gen)
        w1 = (torch.randn(Hid, C, device=dev, dtype=dtype, generator=gen) * C ** -0.5)
        b1 = torch.randn(Hid, device=dev, dtype=dtype, generator=gen) * 0.1
        w2 = (torch.randn(C, Hid, device=dev, dtype=dtype, generator=gen) * Hid ** -0.5)
        d_out = torch.randn(M, C, device=dev, dtype=dtype, generator=gen)
        hidden = torch.nn.functional.linear(x, w1, b1)
        ref_fwd = gg.linear_gelu_reference(x.double(), w1.double(), b1.double())
        ref_bwd = gg.matmul_gelu_backward_reference(d_out.double(), w2.double(), hidden.double())
        ref_bwd = (*ref_bwd, ref_bwd[0].sum(0))  # d_hidden, act, fc1's bias gradient
        entry = results["shapes"][name] = {"M": M, "C": C, "Hid": Hid, "calls_per_step": calls}

        passes = {
            "fwd": (compile_(gg.linear_gelu_reference), (x, w1, b1), gg.linear_gelu, ref_fwd),
            "bwd": (shipped_backward, (d_out, w2, hidden),
                    lambda *a, config: gg.matmul_gelu_backward(*a, config=config, bias_grad=True), ref_bwd),
        }
        for phase, (baseline_fn, inputs, fused_fn, ref) in passes.items():
            base_out = baseline_fn(*inputs)
            base = {"ms": gpu_ms(lambda: baseline_fn(*inputs)),
                    "rel_err": max(rel_err(o, r) for o, r in zip(base_out, ref))}
            bound = 2 * max(base["rel_err"], 1e-3)
            trials = []
            for cfg in candidates(tuple(FETCHES[name] for name in args.fetch.split(","))):
                if time.time() - started > args.budget_s:
                    entry["cut_short"] = True
                    break
                record = {"config": cfg}
                try:
                    out = fused_fn(*inputs, config=cfg)
                    record["rel_err"] = max(rel_err(o, r) for o, r in zip(out, ref))
                    record["ms"] = gpu_ms(lambda: fused_fn(*inputs, config=cfg))
                except Exception as exc:  # a config that does not compile or fit: recorded, skipped
                    record["error"] = repr(exc)[:200]
                trials.append(record)
                if dev == "cpu":
                    break  # the dry run checks one config
            ok = sorted((t for t in trials if "ms" in t and t["rel_err"] <= bound), key=lambda t: t["ms"])
            entry[phase] = {"baseline": base, "trials": trials}
            if ok:
                best = ok[0]
                entry[phase]["best"] = best
                entry[phase]["saving_ms_per_step"] = calls * (base["ms"] - best["ms"])
            print(f"{name} {phase}: baseline {base['ms']:.4f} ms, best fused "
                  f"{ok[0]['ms'] if ok else None} ({ok[0]['config'] if ok else '-'})", file=sys.stderr, flush=True)
            save()
    results["saving_ms_per_step"] = sum(e[p].get("saving_ms_per_step", 0.0)
                                        for e in results["shapes"].values() for p in ("fwd", "bwd") if p in e)
    save()
    print(json.dumps({"saving_ms_per_step": results["saving_ms_per_step"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
