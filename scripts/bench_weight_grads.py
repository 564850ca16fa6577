"""Weight-gradient GEMMs of Hiera-B MAE (batch 128, bf16): which operand order cuBLAS runs faster.

A Linear's weight gradient is dW = dY^T X (dY: (T, out), X: (T, in), dW: (out, in)). Autograd and
Inductor emit ``mm(dY.t(), X)``. The same numbers come out of ``mm(X.t(), dY).t()`` (a transposed
view, (in, out) in memory), which cuBLAS sees as a different problem and may tile differently; the
gradient's copy into ``.grad`` would then do the transpose. This times both (and the transposed
order plus an explicit ``.contiguous()``) per Hiera-B Linear shape, each variant replayed from a
CUDA graph of ``--reps`` calls, rounds interleaved. Prints JSON.

``--batched`` adds ``bmm_per_block``: a stage's same-shaped weight gradients (one per block) as one
``bmm`` over stacked operands, its time divided by the blocks. It tells what deferring a stage's
weight gradients to one batched GEMM could win before anything is built (the stacking is not timed).

    python scripts/bench_weight_grads.py --json out.json [--batched]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# (name, tokens at batch 128, in, out, calls per step): the Linears of the blocks of each stage
# (the first block of a q-pooled stage has other widths; it is left out), tokens as the graphed
# step's matmuls saw them (h100_profile_gemm_shapes.json: stage 3 9,728, decoder 25,088).
STAGES = (("stage1", 155648, 96, 2), ("stage2", 38912, 192, 2), ("stage3", 9728, 384, 15),
          ("stage4", 2432, 768, 2), ("decoder", 25088, 512, 7))


def linears():
    for stage, tokens, dim, blocks in STAGES:
        for layer, d_in, d_out in (("qkv", dim, 3 * dim), ("proj", dim, dim),
                                   ("fc1", dim, 4 * dim), ("fc2", 4 * dim, dim)):
            yield f"{stage}.{layer}", tokens, d_in, d_out, blocks


VARIANTS = {
    "dYt_X": lambda dy, x: torch.mm(dy.t(), x),  # what autograd emits: (out, in)
    "Xt_dY_T": lambda dy, x: torch.mm(x.t(), dy).t(),  # (in, out) in memory, viewed as (out, in)
    "Xt_dY_T_contig": lambda dy, x: torch.mm(x.t(), dy).t().contiguous(),
}


def graph_ms(fn, reps: int):
    """(graph, sample): ``sample()`` is the ms per call of ``fn`` in one replay of ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()

    def sample():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    return graph, sample


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    parser.add_argument("--batched", action="store_true", help="also time each stage's blocks as one bmm")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_weight_grads: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"command": " ".join(sys.argv), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
               "reps": args.reps, "rounds": args.rounds, "shapes": {}}
    saving = saving_batched = 0.0
    for name, tokens, d_in, d_out, calls in linears():
        dy = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, generator=gen)
        reference = VARIANTS["dYt_X"](dy, x).float()
        samplers, errors = {}, {}
        for variant, fn in VARIANTS.items():
            errors[variant] = float((fn(dy, x).float() - reference).abs().max())
            graph, sample = graph_ms(lambda fn=fn: fn(dy, x), args.reps)
            samplers[variant] = (graph, sample)
        if args.batched:
            dys = torch.stack([dy] * calls)  # (blocks, T, out); block 0 is dy, the rest copies
            xs = torch.stack([x] * calls)  # (blocks, T, in)
            batched = lambda: torch.bmm(dys.transpose(1, 2), xs)  # (blocks, out, in)
            errors["bmm_per_block"] = float((batched()[0].float() - reference).abs().max())
            graph, sample = graph_ms(batched, args.reps)
            samplers["bmm_per_block"] = (graph, lambda sample=sample: sample() / calls)
        times = {variant: [] for variant in samplers}
        for _ in range(args.rounds):
            for variant, (_, sample) in samplers.items():
                times[variant].append(sample())
        median = {variant: sorted(t)[len(t) // 2] for variant, t in times.items()}
        gflop = 2 * tokens * d_in * d_out / 1e9
        best = min(VARIANTS, key=median.get)  # operand orders only
        saving += calls * (median["dYt_X"] - median[best])
        if args.batched:
            saving_batched += calls * (median["dYt_X"] - median["bmm_per_block"])
        results["shapes"][name] = {
            "tokens": tokens, "in": d_in, "out": d_out, "calls_per_step": calls, "gflop": gflop,
            "ms": median, "tflop_per_s": {v: gflop / ms for v, ms in median.items()},
            "max_abs_diff_vs_dYt_X": errors, "best": best,
        }
        print(f"{name:14s} " + "  ".join(f"{v} {ms * 1e3:7.1f} us ({gflop / ms:4.0f} TF/s)" for v, ms in median.items()),
              file=sys.stderr, flush=True)
        del samplers
    results["saving_ms_per_step_best_order"] = saving
    if args.batched:
        results["saving_ms_per_step_batched"] = saving_batched
    print(json.dumps({k: v for k, v in results.items() if k.startswith("saving_")}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
