"""How much of a Hiera-B block's backward the weight-gradient GEMMs could hide on a second stream.

A Linear's backward is two GEMMs: the input gradient dX = dY W, which the next kernel waits for,
and the weight gradient dW = dY^T X, which nothing in the block waits for. This replays, per
Hiera-B MAE stage, a chain of block backwards built from the step's own ops (bf16, batch 128):

    d_act = d_out @ w2                        (T, 4C)   fc2's input gradient
    act, dh, db1 = GELU backward + bias sum   (T, 4C)   ops/triton/gelu.py on CUDA
    dxn2 = dh @ w1                            (T, C)    fc1's input gradient
    dx2 = LayerNorm backward(dxn2) + d_out    (T, C)    ATen's kernel
    dattn = dx2 @ wproj                       (T, C)    proj's input gradient
    dqkv = stand-in for attention's backward  (T, 3C)   one pointwise pass over (T, 3C)
    dxn1 = dqkv @ wqkv                        (T, C)    qkv's input gradient
    d_out' = LayerNorm backward(dxn1) + dx2   (T, C)

with the four weight gradients (fc2, fc1, proj, qkv) either in line on the one stream (``serial``)
or on a side stream that waits for each one's inputs and joins at the end of the chain
(``side_mlp``: fc1 and fc2 only; ``side_all``: all four). Every buffer is allocated up front, so
the streams share no allocator state. Each variant is captured in one CUDA graph (scripts/_timing.py),
variants interleaved over ``--rounds``. Attention's own kernels are left out (a pointwise pass over
dqkv stands in): this bounds what overlap can do around the GEMMs, LayerNorm and GELU only.

    python scripts/bench_dw_overlap.py --json out.json [--shapes stage3,decoder]

Prints JSON: per stage the median ms of each variant and what the side stream saves over the
stage's blocks; the sum over the step's blocks.

H100, session 23 (benchmarks/results/failed/h100_bench_dw_overlap.json): 20.86 ms a step's
blocks on one stream, 21.67 with all four weight gradients on the side (stage 3 -0.12 ms, the
decoder +0.91: its large GEMMs on two streams compete for the SMs). The graphed step with the same
move (a post-grad pass, commit 1576980) did not change (failed/h100_profile_side_dw_pdl.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import bench_parser, graph_replay_ms, results_header, save_json  # noqa: E402

# name -> (tokens per sample, width C, blocks a step): 19 kept mask units at mask ratio 0.6
STAGES = {
    "stage1": (19 * 64, 96, 2),
    "stage2": (19 * 16, 192, 3),
    "stage3": (19 * 4, 384, 16),
    "stage4": (19, 768, 3),
    "decoder": (196, 512, 8),
}
VARIANTS = ("serial", "side_mlp", "side_all")


class BlockChain:
    """``blocks`` block backwards of one stage, every input, weight and output preallocated."""

    def __init__(self, rows: int, width: int, blocks: int, device: str, dtype: torch.dtype):
        def rand(*shape, scale=1.0):
            return torch.randn(*shape, device=device, dtype=dtype) * scale

        hid = 4 * width
        self.blocks = [dict(
            w1=rand(hid, width, scale=width ** -0.5), w2=rand(width, hid, scale=hid ** -0.5),
            wproj=rand(width, width, scale=width ** -0.5), wqkv=rand(3 * width, width, scale=width ** -0.5),
            ln_w=rand(width).abs() + 0.5, ln_b=rand(width),
            x1=rand(rows, width), x2=rand(rows, width),  # the two LayerNorms' inputs (T, C)
            xn1=rand(rows, width), xn2=rand(rows, width),  # their outputs: qkv's and fc1's inputs
            h=rand(rows, hid, scale=2.0),  # fc1's output (T, 4C)
            attn_out=rand(rows, width),  # proj's input
            qkv=rand(rows, 3 * width),  # (T, 3C)
            dw1=torch.empty(hid, width, device=device, dtype=dtype),
            dw2=torch.empty(width, hid, device=device, dtype=dtype),
            dwproj=torch.empty(width, width, device=device, dtype=dtype),
            dwqkv=torch.empty(3 * width, width, device=device, dtype=dtype),
        ) for _ in range(blocks)]
        for b in self.blocks:  # LayerNorm statistics of the saved inputs, as the forward kept them
            for x, name in ((b["x1"], "1"), (b["x2"], "2")):
                _, mean, rstd = torch.ops.aten.native_layer_norm(x, (width,), b["ln_w"], b["ln_b"], 1e-6)
                b["mean" + name], b["rstd" + name] = mean, rstd
        self.d_out = rand(rows, width)
        self.side = torch.cuda.Stream() if device == "cuda" else None

    def _ln_backward(self, dy, b, name):
        dx, _, _ = torch.ops.aten.native_layer_norm_backward(
            dy, b["x" + name], (dy.shape[-1],), b["mean" + name], b["rstd" + name], b["ln_w"], b["ln_b"],
            (True, True, True))
        return dx

    def _gelu_backward(self, d_act, h):
        if h.is_cuda:
            from hiera_autopatch.ops.triton import gelu as tgelu

            return tgelu.gelu_backward_bias(d_act, h)
        dh = torch.ops.aten.gelu_backward(d_act, h)
        return torch.nn.functional.gelu(h), dh, dh.sum(0)

    def run(self, variant: str) -> torch.Tensor:
        """One backward through every block; ``variant`` places the weight gradients."""
        side = self.side if variant != "serial" else None
        main = torch.cuda.current_stream() if side is not None else None

        def weight_grad(out, dy, x, on_side):
            # dW = dY^T X: (out, in), on the side stream once dY and X exist on the main one
            if on_side and side is not None:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    torch.mm(dy.t(), x, out=out)
            else:
                torch.mm(dy.t(), x, out=out)

        mlp_side, attn_side = variant in ("side_mlp", "side_all"), variant == "side_all"
        d_out = self.d_out
        for b in self.blocks:
            d_act = d_out @ b["w2"]  # (T, 4C)
            act, dh, _ = self._gelu_backward(d_act, b["h"])
            weight_grad(b["dw2"], d_out, act, mlp_side)
            weight_grad(b["dw1"], dh, b["xn2"], mlp_side)
            dx2 = self._ln_backward(dh @ b["w1"], b, "2") + d_out  # (T, C)
            dattn = dx2 @ b["wproj"]  # (T, C)
            weight_grad(b["dwproj"], dx2, b["attn_out"], attn_side)
            dqkv = b["qkv"] * dattn.repeat(1, 3)  # (T, 3C): stands in for attention's backward
            weight_grad(b["dwqkv"], dqkv, b["xn1"], attn_side)
            d_out = self._ln_backward(dqkv @ b["wqkv"], b, "1") + dx2
        if side is not None:
            main.wait_stream(side)
        return d_out

    def weight_grads(self):
        return [b[k].clone() for b in self.blocks for k in ("dw1", "dw2", "dwproj", "dwqkv")]


def main(argv=None) -> int:
    parser = bench_parser(__doc__, STAGES, cpu_help="fp32, 2 samples")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = args.batch if device == "cuda" else 2
    torch.manual_seed(0)
    results = results_header(batch, device)
    totals = dict.fromkeys(VARIANTS, 0.0)
    for name in args.shapes.split(","):
        tokens, width, blocks = STAGES[name]
        chain = BlockChain(batch * tokens, width, blocks, device, dtype)
        reference = None
        entry = {"rows": batch * tokens, "width": width, "blocks": blocks}
        for variant in VARIANTS:  # same numbers whichever stream computes them
            out = chain.run(variant)
            if device == "cuda":
                torch.cuda.synchronize()
            got = [out.clone()] + chain.weight_grads()
            if reference is None:
                reference = got
            entry[f"{variant}_max_abs_diff"] = max(float((g - r).abs().max()) for g, r in zip(got, reference))
        times = {v: [] for v in VARIANTS}
        for _ in range(args.rounds if device == "cuda" else 1):
            for variant in VARIANTS:
                if device == "cuda":
                    times[variant].append(graph_replay_ms(lambda v=variant: chain.run(v), replays=10))
                else:
                    import time

                    t = time.perf_counter()
                    chain.run(variant)
                    times[variant].append((time.perf_counter() - t) * 1e3)
        for variant in VARIANTS:
            entry[f"{variant}_ms_rounds"] = times[variant]
            entry[f"{variant}_ms"] = sorted(times[variant])[len(times[variant]) // 2]
            totals[variant] += entry[f"{variant}_ms"]
        entry["side_all_saves_ms"] = entry["serial_ms"] - entry["side_all_ms"]
        entry["side_mlp_saves_ms"] = entry["serial_ms"] - entry["side_mlp_ms"]
        results["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
        del chain
        save_json(args.json, results)
    results["ms_per_step"] = totals
    print(json.dumps({"ms_per_step": totals}))
    save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
