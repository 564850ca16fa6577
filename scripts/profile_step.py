"""Where a training step's GPU time goes: ms/step and kernel time by kind, per configuration.

    python scripts/profile_step.py --json out.json [--modes fair,patched,graphs,compile] [--batch 128]

One process, one model (same weights, same input), configurations run one after the other:
``fair`` (FAIR eager), ``patched`` (hiera_autopatch eager), ``graphs`` (HIERA_OPTIM_GRAPHS: the
static MAE step under CUDA graphs, no user edit), ``compile`` (the user's own ``torch.compile``
of the patched model); suffixes make ablations (``parse_mode``: ``graphs-triton``,
``patched~fair.block``, ``graphs+kept_embed``, ``patched#2``). FAIR is never compiled here, so
class patching cannot leak into a compiled FAIR graph. Prints JSON; ratios in the JSON are
FAIR-eager ms / config ms.

``--interleave ROUNDS`` (graphed modes with the same patches, e.g. an A/B of a launch table with
repeats): each mode gets its own model and its captured graphs stay, then the rounds time one step
of every mode in turn. One after the other, repeats of one mode spread by ~1 ms (session 29 on an
H100: 31.86-32.72 ms), more than the tenths an A/B of a launch looks for. In turns, whatever of that
is drift over the run's minutes falls on every mode alike; what comes with a capture stays with its
``#n``, which is why ``scripts/ab_pairs.py`` still wants a win for every repeat. On an H200 (session
30) the first model captured ran 0.27-0.53 ms a step faster than each of nine later ones, whatever its
mode, while later A/A captures agreed within 0.06 ms
(benchmarks/results/h200_profile_interleaved_captures_session30.json): so an untimed copy of the
first mode is captured first, and no timed mode holds that place.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time

import torch

KERNEL_KINDS = [
    ("attention", r"flash|fmha|attention|sdpa|_attn_|window_attention"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|sm80_"),
    ("conv", r"conv|implicit_convolve|winograd|dgrad|wgrad"),
    ("layer_norm", r"layer_norm|layernorm|LayerNorm"),
    ("index/gather/scatter", r"index|gather|scatter|nonzero|sort|radix"),
    ("copy/layout", r"copy|Copy|transpose|permute|cat_|CatArray"),
    ("reduce", r"reduce|Reduce|sum_|max_|amax|column_sums"),
    ("triton (fused)", r"^triton_|^_gelu_"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


CONFIGS = ("fair", "patched", "graphs", "compile")
INDUCTOR_SWITCHES = {
    # +switch -> Inductor options added to the graphed step's (step_graph.compile_options)
    "max_autotune": {"max_autotune": True, "coordinate_descent_tuning": True},  # mode="max-autotune"
    "autotune_gemm": {"max_autotune_gemm": True},  # Triton GEMM templates vs cuBLAS, epilogue fusion
    "coord_descent": {"coordinate_descent_tuning": True},  # tunes Inductor's own kernels' blocks
    "no_pdl": {"triton.enable_pdl": False},  # without programmatic dependent launch (on by default)
    "mix_split64": {"triton.mix_order_reduction_split_size": 64},  # with +mix: fewer LayerNorm-grad partial rows
    "mix_split32": {"triton.mix_order_reduction_split_size": 32},
    "no_mix": {"triton.mix_order_reduction": False},  # LayerNorm's row and column grads apart (shipped)
    "mix": {"triton.mix_order_reduction": True},  # Inductor's default: one kernel, ATen sums finish
    "combo": {"combo_kernels": True},  # independent small kernels (e.g. weight-grad sums) as one launch
    "coop": {"triton.cooperative_reductions": True},  # a split reduction as one kernel (grid-wide sync)
    "aggressive": {"aggressive_fusion": True},  # fuse nodes that share no memory access too
    "nd_tiling": {"triton.prefer_nd_tiling": True},  # 2-D tiles for pointwise/reductions (LN weight grads)
}
SWITCHES = ("kept_embed", "full_embed", "tuned_attention", "one_graph", "no_capture", "decoder_rows",
            "full_decoder", "unaligned_embed", "conv_heads", "bias_sums", "kernel_bias_grad", "cublaslt", "fused_ln", "inductor_ln",
            "ln_variant", "ln_by_width", "no_dx_sum", "inductor_gelu", "gelu_variant", "gelu_by_width", "gelu_one_launch", "pdl_ours",
            "no_pdl_ours", "ln_one_launch", "keep_act", "keep_act_all", "gemm_gelu", "mask_in_graph", "eager_mask",
            *INDUCTOR_SWITCHES)
SDPA_BACKENDS = ("flash", "efficient", "cudnn")
KEEP_ACT_DECODER = frozenset({2048})  # +keep_act: the MAE decoder's MLP (512 -> 2048)
KEEP_ACT_ALL = frozenset({384, 768, 1536, 3072, 2048})  # +keep_act_all: Hiera-B's four stages and the decoder


def parse_mode(mode: str) -> dict:
    """``config[-attention][~patch...][@sdpa][+switch...][#n]``, e.g. ``graphs-triton~fair.block+kept_embed``.

    config: fair (FAIR eager), patched (eager), graphs (HIERA_OPTIM_GRAPHS), compile (the user's
    torch.compile of the patched model); -attention: auto/sdpa/triton; ~patch: leave that patch off
    (repeatable: ``~fair.block~fair.mae_loss``; commas separate modes in ``--modes``);
    @sdpa: pin SDPA to flash/efficient/cudnn; +switch: kept_embed / full_embed (HIERA_OPTIM_KEPT_EMBED
    on / off; neither: the environment's),
    tuned_attention (our attention's blocks from ``--attention-tuning``, a tune_attention.py JSON),
    one_graph (the graphed step's backward captured into its forward's graph, not a graph of its own),
    no_capture (the whole step compiled but not captured: its kernels can be traced to host ops),
    full_decoder (the MAE decoder's last MLP, norm and head at every token, as before session 12;
    without it they run at the masked tokens only, ops/loss.py; ``decoder_rows`` names that default
    explicitly, as the session-11/12 commands did),
    unaligned_embed (the kept-token patch embedding's matmul without its zero columns: 147-wide
    rows, ops/patch_embed.aligned), conv_heads (the MAE fusion heads as FAIR's convolutions, not
    matmuls: ops/fusion_head.as_matmul), kernel_bias_grad (the qkv bias gradients from our
    attention kernels' partial sums, ops/attention.fused_bias_grad; off by default since session
    15's A/B), bias_sums (from autograd's reduction over dqkv: the default, named explicitly as
    session 15's commands did), cublaslt (ATen's matmuls, Inductor's extern ones too, through
    cuBLASLt: ``torch.backends.cuda.preferred_blas_library("cublaslt")``), fused_ln / inductor_ln (the
    blocks' LayerNorm backward in one pass with the residual's gradient, ops/layer_norm.fused_backward,
    on / off; neither: the shipped default), ln_variant (that backward launched as ``--ln-variant``
    says at every width; without it: the shipped launch), ln_by_width (that backward launched per row
    width as ops/triton/layer_norm.BEST_BY_WIDTH says), no_dx_sum (the bias gradients that sum a block
    LayerNorm's input gradient as Inductor's reductions, not from that kernel: ops/layer_norm.dx_sums),
    inductor_gelu (the MLP's GELU backward and fc1's bias gradient in Inductor's kernels, not ours:
    ops/mlp.fused_gelu_backward), gelu_variant (our GELU backward launched as ``--gelu-variant``
    says, at every width), gelu_by_width / gelu_one_launch (our GELU backward launched per row width
    as ops/triton/gelu.BEST_BY_WIDTH says, shipped since session 26 / at gelu.LAUNCH for every
    width), pdl_ours / no_pdl_ours (our Triton kernels with / without programmatic dependent launch:
    ops/triton/_runtime.PDL, on since session 32), ln_one_launch (the LayerNorm backward at
    ``layer_norm.LAUNCH`` for every width, as before session 32; ``ln_by_width`` names the default),
    keep_act / keep_act_all (the MLP's forward keeps GELU's output for backward instead of
    recomputing it, ops/mlp.keep_act_widths: the MAE decoder's width 2048 / every Hiera-B MAE width),
    gemm_gelu (the MLP GEMMs with GELU in their epilogue where ``--gemm-gelu-bench`` found them faster,
    ops/triton/gemm_gelu.CONFIG_BY_WIDTH), mask_in_graph / eager_mask (the forward graph draws FAIR's
    random mask itself, the default since session 32 / the host draws it before the graph:
    ops/step_graph.mask_in_graph), or one of ``INDUCTOR_SWITCHES`` (Inductor options of the
    graphed step); #n: a repeat, timed again (interleaved A/B).
    """
    rest, _, repeat = mode.partition("#")
    rest, _, switches = rest.partition("+")
    rest, _, sdpa = rest.partition("@")
    rest, *off = rest.split("~")
    config, _, attention = rest.partition("-")
    spec = {
        "config": config, "attention": attention or "auto", "repeat": repeat,
        "disabled": {name for name in off if name},
        "sdpa": sdpa or None, "switches": [name for name in switches.split("+") if name],
    }
    problems = []
    if config not in CONFIGS:
        problems.append(f"config {config!r} is not one of {', '.join(CONFIGS)}")
    if spec["attention"] not in ("auto", "sdpa", "triton"):
        problems.append(f"attention {attention!r} is not auto, sdpa or triton")
    if sdpa and sdpa not in SDPA_BACKENDS:
        problems.append(f"SDPA backend {sdpa!r} is not one of {', '.join(SDPA_BACKENDS)}")
    problems += [f"switch {name!r} is not one of {', '.join(SWITCHES)}" for name in spec["switches"] if name not in SWITCHES]
    if problems:
        raise ValueError(f"mode {mode!r}: " + "; ".join(problems))
    return spec


def kept_embed_override(switches) -> dict:
    """``enable()`` keyword for +kept_embed / +full_embed; neither: the environment's setting."""
    if "kept_embed" in switches:
        return {"kept_embed": True}
    if "full_embed" in switches:
        return {"kept_embed": False}
    return {}


def interleave_problems(modes) -> list:
    """Why these modes cannot be timed by ``--interleave`` (empty: they can). Its rounds switch
    between captured graphs without re-patching, so every mode must be a graphed step with the same
    patches; what differs between them must live inside the graphs (launches, kernels, options)."""
    specs = [parse_mode(mode) for mode in modes]
    problems = [f"mode {mode!r} is not a graphs mode" for mode, spec in zip(modes, specs) if spec["config"] != "graphs"]
    problems += [f"mode {mode!r}: +no_capture runs compiled code, not a kept graph"
                 for mode, spec in zip(modes, specs) if "no_capture" in spec["switches"]]
    patching = {(spec["attention"], tuple(sorted(spec["disabled"])), spec["sdpa"],
                 tuple(sorted(kept_embed_override(spec["switches"]).items()))) for spec in specs}
    if len(patching) > 1:
        problems.append("modes differ in attention, ~patches, @sdpa or kept/full_embed (patches, not graphs)")
    if len(set(modes)) < len(modes):
        problems.append("a mode is listed twice: give repeats a #n")
    return problems


def inductor_options(switches) -> dict:
    """The graphed step's Inductor options for these +switches, over ``step_graph.default_options()``."""
    options = {}
    for name in switches:
        options.update(INDUCTOR_SWITCHES.get(name, {}))
    return options


def tuned_blocks(path: str) -> dict:
    """``window_attention.TUNED`` updates from a scripts/tune_attention.py JSON: (T, S, D) -> the
    forward keys of the fastest forward config and the backward keys of the fastest backward one
    (the keys each trial set; the rest keep the shipped values)."""
    from hiera_autopatch.ops.triton.window_attention import BWD_KEYS

    bwd_keys = set(BWD_KEYS) | {"num_warps_bwd", "KEY_TILES_BWD"}
    with open(path) as fh:
        shapes = json.load(fh)["shapes"]
    tuned = {}
    for entry in shapes.values():
        config = {}
        if "fwd_best" in entry:  # a pass tuned alone (--phases) leaves the other one as shipped
            config.update({k: v for k, v in entry["fwd_best"]["config"].items() if k not in bwd_keys})
        if "bwd_best" in entry:
            config.update({k: v for k, v in entry["bwd_best"]["config"].items() if k in bwd_keys})
        if config:
            tuned[(entry["T"], entry["S"], entry["D"])] = config
    return tuned


def build(args):
    import hiera

    model = getattr(hiera, args.model)().cuda().to(torch.bfloat16).train()
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", generator=generator, dtype=torch.bfloat16)
    return model, x


def step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = out[0] if isinstance(out, tuple) else out.float().square().mean()
    loss.backward()
    return loss


def time_one(fn) -> float:
    """ms of one step with CUDA events, synchronized."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def summary(times) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def time_steps(fn, steps: int):
    """Median/min/max ms per step with CUDA events, one event pair per step."""
    return summary([time_one(fn) for _ in range(steps)])


def cpu_breakdown(fn, steps: int = 3):
    """Host time per step by op (self CPU time): where launch overhead and Python go."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    return [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1000 / steps, "calls": e.count / steps}
            for e in rows]


def kernel_breakdown(fn, steps: int = 3, top: int = 15):
    """GPU kernel time per step by kind and by name, and the idle time between kernels.

    ``span_ms`` runs from the first kernel's start to the last one's end; ``gaps_ms`` is the GPU
    idle time inside it, split into short gaps (< 10 us: launch latency between kernels, even in a
    CUDA graph) and long ones (the GPU waiting on the host)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_kind, by_name, calls, count = {}, {}, {}, 0
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us <= 0 or event.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            continue
        if getattr(event, "device_type", None) is not None and "CUDA" not in str(event.device_type):
            continue
        ms = device_us / 1000 / steps
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0) + ms
        by_name[event.key] = ms
        calls[event.key] = event.count / steps
        count += event.count
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    result = {
        "total_ms": sum(by_kind.values()),
        "kernels_per_step": count / steps,
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [{"name": n[:120], "ms": ms, "calls": calls[n]} for n, ms in ranked],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    result.update(idle_gaps(trace.get("traceEvents", []), steps))
    return result


def idle_gaps(events, steps: int, top: int = 12) -> dict:
    """GPU idle time between the kernels (and copies, memsets) of a Chrome trace, per step.

    Short gaps (< 10 us) are launch latency, even inside a CUDA graph; long ones are the GPU
    waiting on something else. ``long_gaps_top`` names the kernels on either side of the longest
    kinds of long gap (summed over the steps, then per step), so a long gap can be traced to the
    launch that causes it."""
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("name", "?")) for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    if not spans:
        return {}
    short = long = 0.0
    by_pair: dict[tuple[str, str], list] = {}  # (kernel before, kernel after) -> [us, count]
    end, last = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gap = start - end
            if gap < 10:
                short += gap
            else:
                long += gap
                pair = by_pair.setdefault((last[:60], name[:60]), [0.0, 0])
                pair[0] += gap
                pair[1] += 1
        if stop >= end:
            end, last = stop, name
    ranked = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_ms": (spans[-1][1] - spans[0][0]) / 1000 / steps,
        "gaps_ms": {"short": short / 1000 / steps, "long": long / 1000 / steps},
        "long_gaps_top": [{"after": a, "before": b, "ms": us / 1000 / steps, "count": n / steps}
                          for (a, b), (us, n) in ranked],
    }


def matmul_flops(op: str, shapes) -> int:
    """FLOPs of one ``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` call from its input shapes
    (the profiler's ``input_shapes``); 0 for any other op."""
    name = op.split("::")[-1]
    operands = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}.get(name)
    if operands is None or len(shapes) <= operands[1]:
        return 0
    a, b = shapes[operands[0]], shapes[operands[1]]
    if len(a) < 2 or len(b) < 2:
        return 0
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def trace_kernels(fn, pattern: str, top: int = 15):
    """Which host ops launch the kernels whose name matches ``pattern``: op, its parents, input
    shapes, calls per step, and for matmuls their TFLOP/s (FLOPs from the shapes, over the time of
    every matching kernel the call launched: a split-K GEMM's reduction kernel counts). Needs a
    step without CUDA graphs (a replay has no launching op)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    launches = {}
    for event in prof.events():
        matching = [k for k in getattr(event, "kernels", []) if re.search(pattern, k.name)]
        if not matching:
            continue
        chain, parent = [], event
        while parent is not None and len(chain) < 4:
            chain.append(parent.name[:80])
            parent = parent.cpu_parent
        key = " < ".join(chain) + f" {event.input_shapes}"
        entry = launches.setdefault(key, {"launcher": key, "op_calls": 0, "calls": 0, "kernel_ms": 0.0,
                                          "kernels": sorted({k.name[:80] for k in matching}), "gflop": 0.0})
        entry["op_calls"] += 1
        entry["calls"] += len(matching)
        entry["kernel_ms"] += sum(k.duration for k in matching) / 1000
        entry["gflop"] += matmul_flops(event.name, event.input_shapes) / 1e9
    for entry in launches.values():
        if entry["gflop"] and entry["kernel_ms"] > 0:
            entry["tflop_per_s"] = entry["gflop"] / entry["kernel_ms"]
    return sorted(launches.values(), key=lambda e: -e["kernel_ms"])[:top]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mae_hiera_base_224")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="fair,patched,graphs,compile")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile-only", default="", help="comma list: profile only these modes")
    parser.add_argument("--cpu-profile", default="", help="comma list of modes to profile on the host too")
    parser.add_argument("--top", type=int, default=15, help="kernels listed by name per mode")
    parser.add_argument("--trace-kernels", default="",
                        help="regex: for each profiled mode, the host ops that launch matching kernels "
                             "(use on a mode without CUDA graphs, e.g. compile)")
    parser.add_argument("--attention-tuning", help="tune_attention.py JSON for the +tuned_attention switch")
    parser.add_argument("--ln-variant", help="the one-pass LayerNorm backward's launch in modes with +ln_variant, e.g. "
                        "4x2048x2x8: programs per SM x tile elements x sums kind [x warps] "
                        "(scripts/bench_layer_norm.py's variants); other modes: ops/triton/layer_norm.py's")
    parser.add_argument("--gelu-variant", help="our GELU backward's launch in modes with +gelu_variant, e.g. 4096x128x4: "
                        "tile elements x most partial-sum rows x warps (scripts/bench_gelu.py's variants)")
    parser.add_argument("--gemm-gelu-bench", help="scripts/bench_gemm_gelu.py JSON: its winning configs per width "
                        "for the +gemm_gelu switch")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="capture every mode first, each on its own model with its graphs kept, then time "
                             "ROUNDS rounds of one step per mode (the order rotating each round), so drift over "
                             "the run's minutes falls on every mode alike; graphs modes with the same patches only")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    for mode in args.modes.split(","):
        try:
            parse_mode(mode)
        except ValueError as exc:
            parser.error(str(exc))
    if args.interleave < 0:
        parser.error("--interleave takes a number of rounds >= 1")
    problems = interleave_problems(args.modes.split(",")) if args.interleave else []
    if problems:
        parser.error("--interleave: " + "; ".join(problems))
    import hiera_autopatch
    from hiera_autopatch import _bench_report
    from hiera_autopatch.ops import attention as attention_ops
    from hiera_autopatch.ops import fusion_head as fusion_head_ops
    from hiera_autopatch.ops import loss as loss_ops
    from hiera_autopatch.ops import mlp as mlp_ops
    from hiera_autopatch.ops import layer_norm as layer_norm_ops
    from hiera_autopatch.ops import patch_embed as patch_embed_ops
    from hiera_autopatch.ops import step_graph
    from hiera_autopatch.ops.triton import _runtime as triton_runtime
    from hiera_autopatch.ops.triton import gelu as triton_gelu
    from hiera_autopatch.ops.triton import gemm_gelu as triton_gemm_gelu
    from hiera_autopatch.ops.triton import layer_norm as triton_layer_norm
    from hiera_autopatch.ops.triton import window_attention

    shipped_tuning = dict(window_attention.TUNED)
    shipped_ln_launch, shipped_gelu_launch = triton_layer_norm.LAUNCH, triton_gelu.LAUNCH
    try:
        ln_variant_launch = triton_layer_norm.Launch.parse(args.ln_variant) if args.ln_variant else shipped_ln_launch
        gelu_variant_launch = triton_gelu.Launch.parse(args.gelu_variant) if args.gelu_variant else shipped_gelu_launch
    except ValueError as exc:
        parser.error(str(exc))
    if any("ln_variant" in parse_mode(mode)["switches"] for mode in args.modes.split(",")) and not args.ln_variant:
        parser.error("+ln_variant needs --ln-variant")
    if any("gelu_variant" in parse_mode(mode)["switches"] for mode in args.modes.split(",")) and not args.gelu_variant:
        parser.error("+gelu_variant needs --gelu-variant")
    if any("gemm_gelu" in parse_mode(mode)["switches"] for mode in args.modes.split(",")) and not args.gemm_gelu_bench:
        parser.error("+gemm_gelu needs --gemm-gelu-bench")
    shipped_blas = torch.backends.cuda.preferred_blas_library()
    shipped_fused_ln = layer_norm_ops.fused_backward
    shipped_dx_sums = layer_norm_ops.dx_sums
    shipped_fused_gelu = mlp_ops.fused_gelu_backward
    shipped_pdl = triton_runtime.PDL
    shipped_gelu_by_width = dict(triton_gelu.LAUNCH_BY_WIDTH)
    shipped_ln_by_width = dict(triton_layer_norm.LAUNCH_BY_WIDTH)
    shipped_keep_act = mlp_ops.keep_act_widths
    shipped_gemm_gelu = dict(triton_gemm_gelu.CONFIG_BY_WIDTH)
    shipped_mask_in_graph = step_graph.mask_in_graph
    if args.gemm_gelu_bench:
        with open(args.gemm_gelu_bench) as fh:
            gemm_gelu_table = triton_gemm_gelu.best_by_width(json.load(fh))
    tuning = tuned_blocks(args.attention_tuning) if args.attention_tuning else {}
    model, x = build(args)
    results = {
        "command": " ".join(sys.argv),
        "model": args.model, "batch": args.batch, "dtype": "bf16 params", "step": "forward+backward",
        "steps": args.interleave or args.steps,  # --interleave: one step of each mode a round
        "ln_variant": args.ln_variant or "shipped",
        "gelu_variant": args.gelu_variant or "shipped",
        "gemm_gelu": gemm_gelu_table if args.gemm_gelu_bench else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "source_digest": _bench_report.source_digest(),  # the package code that ran (git's HEAD may not be it)
        "interleave_rounds": args.interleave or None,
        "modes": {},
    }
    def set_switches(mode):
        """The module-level switches of one mode (see ``parse_mode``); returns its spec."""
        spec = parse_mode(mode)
        step_graph.compile_options = inductor_options(spec["switches"])
        step_graph.backward_graph = "one_graph" not in spec["switches"]
        step_graph.capture = "no_capture" not in spec["switches"]
        step_graph.mask_in_graph = ((shipped_mask_in_graph or "mask_in_graph" in spec["switches"])
                                    and "eager_mask" not in spec["switches"])
        loss_ops.decoder_rows = "full_decoder" not in spec["switches"]
        patch_embed_ops.aligned = "unaligned_embed" not in spec["switches"]
        fusion_head_ops.as_matmul = "conv_heads" not in spec["switches"]
        attention_ops.fused_bias_grad = "kernel_bias_grad" in spec["switches"]
        layer_norm_ops.dx_sums = shipped_dx_sums and "no_dx_sum" not in spec["switches"]
        mlp_ops.fused_gelu_backward = shipped_fused_gelu and "inductor_gelu" not in spec["switches"]
        triton_runtime.PDL = (shipped_pdl or "pdl_ours" in spec["switches"]) and "no_pdl_ours" not in spec["switches"]
        mlp_ops.keep_act_widths = (KEEP_ACT_ALL if "keep_act_all" in spec["switches"]
                                   else KEEP_ACT_DECODER if "keep_act" in spec["switches"] else shipped_keep_act)
        triton_gemm_gelu.CONFIG_BY_WIDTH = gemm_gelu_table if "gemm_gelu" in spec["switches"] else shipped_gemm_gelu
        triton_gelu.LAUNCH_BY_WIDTH = (
            {} if {"gelu_one_launch", "gelu_variant"} & set(spec["switches"])
            else dict(triton_gelu.BEST_BY_WIDTH) if "gelu_by_width" in spec["switches"]
            else shipped_gelu_by_width)
        triton_gelu.LAUNCH = gelu_variant_launch if "gelu_variant" in spec["switches"] else shipped_gelu_launch
        layer_norm_ops.fused_backward = ("fused_ln" in spec["switches"]
                                         or (shipped_fused_ln and "inductor_ln" not in spec["switches"]))
        triton_layer_norm.LAUNCH = ln_variant_launch if "ln_variant" in spec["switches"] else shipped_ln_launch
        triton_layer_norm.LAUNCH_BY_WIDTH = (
            {} if {"ln_variant", "ln_one_launch"} & set(spec["switches"])
            else dict(triton_layer_norm.BEST_BY_WIDTH) if "ln_by_width" in spec["switches"]
            else shipped_ln_by_width)
        # +cublaslt: ATen's matmuls (Inductor's extern mm/addmm too) through cuBLASLt's own heuristics
        torch.backends.cuda.preferred_blas_library("cublaslt" if "cublaslt" in spec["switches"] else shipped_blas)
        window_attention.TUNED.clear()
        window_attention.TUNED.update(shipped_tuning)
        if "tuned_attention" in spec["switches"]:
            for key, config in tuning.items():
                window_attention.TUNED[key] = {**window_attention.TUNED.get(key, {}), **config}
        attention_ops.sdpa_backend = spec["sdpa"]
        return spec

    kept_alive = []  # --interleave: every mode's compiled step (and its backend), never collected mid-run

    def configure(mode, model=model):
        """Patch state for one mode (see ``parse_mode``); returns the callable model."""
        spec = set_switches(mode)
        if args.interleave:
            # a fresh compile for this mode, and no reset: torch._dynamo.reset() could free (and Triton
            # unload) the kernels an earlier mode's kept graphs replay
            kept_alive.extend(step_graph._compiled.values())
            step_graph._compiled.clear()
        else:
            torch._dynamo.reset()  # each mode compiles afresh: no cache entry of another mode's options
            step_graph.reset()  # and captures afresh
        hiera_autopatch.disable()
        step_graph.enabled = False
        if spec["config"] != "fair":
            hiera_autopatch.enable(graphs=spec["config"] == "graphs", attention=spec["attention"],
                                   disabled_patches=spec["disabled"], **kept_embed_override(spec["switches"]))
        if spec["config"] == "compile":
            return compiled.setdefault(mode.partition("#")[0], torch.compile(model))
        return model

    compiled = {}
    modes = args.modes.split(",")
    spec_of = parse_mode

    def save():  # after every mode too: a run cut short by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)

    def profile(mode, runner):
        step(runner, x)
        results["modes"][mode]["kernels"] = kernel_breakdown(lambda: step(runner, x), top=args.top)
        if args.trace_kernels:
            results["modes"][mode]["launchers"] = trace_kernels(lambda: step(runner, x), args.trace_kernels)
        if mode in args.cpu_profile.split(","):
            results["modes"][mode]["host_ops"] = cpu_breakdown(lambda: step(runner, x))

    if args.interleave:  # capture every mode, then time them in turns
        for name in ("recompile_limit", "cache_size_limit"):  # one compile per mode, none reset
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4 * len(modes)))
        runners = {}
        # the first capture's place (see the module docstring): an untimed copy of the first mode
        torch.manual_seed(0)
        untimed = configure(modes[0], build(args)[0])
        for _ in range(3):  # compile and capture
            step(untimed, x)
        kept_alive.append(untimed)  # its graphs live as long as the model: the next capture is not first
        results["interleave_untimed_first_capture"] = modes[0]
        for mode in modes:
            torch.manual_seed(0)  # every mode's own model starts from the same weights
            runner = runners[mode] = configure(mode, build(args)[0])
            resident_gib = torch.cuda.memory_allocated() / 2**30  # grows: earlier modes' graphs stay
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            for _ in range(3):  # compile and capture
                step(runner, x)
            torch.cuda.synchronize()
            results["modes"][mode] = {
                "resident_gib_at_start": resident_gib,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "warmup_s": time.perf_counter() - started,
                "inductor_options": dict(step_graph.compile_options),
                "attention_tuned": {f"T={t} S={s} D={d}": c for (t, s, d), c in window_attention.TUNED.items()},
                "status": hiera_autopatch.status()["targets"].get("hiera.hiera_mae", {}),
            }
            print(f"{mode:10s} captured  warm-up {results['modes'][mode]['warmup_s']:.1f} s", file=sys.stderr, flush=True)
            save()
        samples = {mode: [] for mode in modes}
        for round_ in range(args.interleave):
            for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
                set_switches(mode)  # the eager parts of the step read them
                samples[mode].append(time_one(lambda: step(runners[mode], x)))
        for mode in modes:
            timing = summary(samples[mode])
            results["modes"][mode].update(ms_per_step=timing, samples_per_s=args.batch * 1000 / timing["median"],
                                          round_ms=samples[mode])  # in round order: ab_pairs.py pairs them by round
            print(f"{mode:10s} {timing['median']:8.2f} ms/step over {args.interleave} interleaved rounds",
                  file=sys.stderr, flush=True)
        results["step_graph"] = step_graph.status()
        save()
        for mode in ([] if args.no_profile else [m for m in modes if not args.profile_only or m in args.profile_only.split(",")]):
            set_switches(mode)
            profile(mode, runners[mode])
            save()
        print(json.dumps({m: e["ms_per_step"]["median"] for m, e in results["modes"].items()}))
        return 0

    # Launch-bound (eager) modes are timed before any profiler runs: profiling may leave host-side
    # overhead behind that would inflate them. Compiled/graphed modes are profiled right after
    # their timing, so they compile once.
    deferred = []
    for mode in modes:
        runner = configure(mode)
        gc.collect()  # the previous mode's graphs and their memory pools go before this mode's peak
        torch.cuda.empty_cache()
        resident_gib = torch.cuda.memory_allocated() / 2**30  # model, input, grads: every mode holds them
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        started = time.perf_counter()
        for _ in range(3):  # warm-up (and compile / graph capture) outside the timing
            step(runner, x)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - started
        timing = time_steps(lambda: step(runner, x), args.steps)
        results["modes"][mode] = {
            "ms_per_step": timing,
            "samples_per_s": args.batch * 1000 / timing["median"],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "resident_gib_at_start": resident_gib,
            "warmup_s": warmup_s,
            "inductor_options": dict(step_graph.compile_options) if spec_of(mode)["config"] == "graphs" else None,
            "step_graph": step_graph.status() if spec_of(mode)["config"] == "graphs" else None,
            "attention_tuned": {f"T={t} S={s} D={d}": c for (t, s, d), c in window_attention.TUNED.items()},
            "status": hiera_autopatch.status()["targets"].get("hiera.hiera_mae", {}),
        }
        print(f"{mode:10s} {timing['median']:8.2f} ms/step  peak {results['modes'][mode]['peak_gib']:.1f} GiB"
              f"  warm-up {warmup_s:.1f} s", file=sys.stderr, flush=True)
        if args.no_profile or (args.profile_only and mode not in args.profile_only.split(",")):
            save()
            continue
        if mode.startswith(("graphs", "compile")):
            profile(mode, runner)
        else:
            deferred.append(mode)
        save()
    for mode in deferred:
        profile(mode, configure(mode))
        save()
    fair_ms = results["modes"].get("fair", {}).get("ms_per_step", {}).get("median")
    if fair_ms:
        for entry in results["modes"].values():
            entry["x_vs_fair_eager"] = fair_ms / entry["ms_per_step"]["median"]
    save()
    print(json.dumps({m: (e["ms_per_step"]["median"], e.get("x_vs_fair_eager")) for m, e in results["modes"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
