"""GPU timing and result bookkeeping shared by the kernel scripts (bench_attention_kernels.py,
tune_attention.py, bench_layer_norm.py, bench_gelu.py, bench_gemm_gelu.py)."""


def graph_replay_ms(fn, replays: int = 20, rounds: int = 5, warmup: int = 3) -> float:
    """GPU time of one ``fn()`` without launch overhead: warmed up on a side stream (Triton
    compiles, cuDNN plans), captured once in a CUDA graph, median over rounds of replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def kernel_ms(fn, device: str, warmup: int = 3) -> float:
    """``graph_replay_ms`` on CUDA; on the CPU (a dry run in Triton's interpreter) one call's wall
    time, which only shows that the script runs."""
    if device == "cpu":
        import time

        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return graph_replay_ms(fn, warmup=warmup)


def results_header(batch: int, device: str) -> dict:
    """The JSON head of a kernel script's results: its command line, batch, torch and GPU."""
    import sys

    import torch

    return {"command": " ".join(sys.argv), "batch": batch, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)", "shapes": {}}


def save_json(path, results: dict) -> None:
    """Write ``results`` to ``path`` (no path: nothing), after every shape, so a run cut short keeps them."""
    if path:
        import json

        with open(path, "w") as fh:
            json.dump(results, fh, indent=1)


def bench_parser(doc: str, shapes, cpu_help: str = "a dry run in Triton's interpreter, fp32"):
    """The command line the shape benchmarks share: --json, --batch, --device (cpu: ``cpu_help``,
    which shows that the script runs), --shapes (comma list of ``shapes``)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help=f"cpu: {cpu_help} (shows that the script runs)")
    parser.add_argument("--shapes", default=",".join(shapes))
    return parser


def launch_bench_parser(doc: str, shapes, variants: str, variants_help: str):
    """``bench_parser`` plus --variants: the launch benchmarks' (bench_layer_norm.py, bench_gelu.py)."""
    parser = bench_parser(doc, shapes)
    parser.add_argument("--variants", default=variants, help=variants_help + ", comma list")
    return parser


def time_launches(kernel_module, variants, run, expected, entry: dict, device: str = "cuda") -> None:
    """Each launch variant (``kernel_module.Launch``'s text) of one shape: ``kernel_module.LAUNCH``
    set to it (and a ``LAUNCH_BY_WIDTH`` table, which would override it, emptied), ``run()``'s
    outputs checked against ``expected`` (relative L2 error each), timed (``kernel_ms``) when every
    error is within 2e-2, else recorded untimed (None); the shipped launches restored, and the one
    for ``entry["width"]`` recorded."""
    shipped = kernel_module.LAUNCH
    shipped_by_width = getattr(kernel_module, "LAUNCH_BY_WIDTH", None)
    try:
        if shipped_by_width is not None:
            kernel_module.LAUNCH_BY_WIDTH = {}
        for variant in variants:
            kernel_module.LAUNCH = kernel_module.Launch.parse(variant)
            errors = [float((g.float() - e.float()).norm() / e.float().norm()) for g, e in zip(run(), expected)]
            entry[f"ours_{variant}_rel_err"] = errors
            entry[f"ours_{variant}_ms"] = kernel_ms(run, device) if max(errors) <= 2e-2 else None
    finally:
        kernel_module.LAUNCH = shipped
        if shipped_by_width is not None:
            kernel_module.LAUNCH_BY_WIDTH = shipped_by_width
    entry["shipped"] = str(kernel_module.launch_for(entry["width"]))


def record_best(entry: dict, per_step: int) -> None:
    """One shape's fastest correct ``ours_<variant>_ms`` against ``inductor_ms``: its name, the ms it
    saves a step over ``per_step`` calls, and both sides' TB/s over ``min_bytes``."""
    best = min((v, k) for k, v in entry.items() if k.startswith("ours_") and k.endswith("_ms") and v)
    entry["best"] = best[1]
    entry["saved_ms_per_step"] = (entry["inductor_ms"] - best[0]) * per_step
    entry["best_tb_per_s"] = entry["min_bytes"] / best[0] / 1e9
    entry["inductor_tb_per_s"] = entry["min_bytes"] / entry["inductor_ms"] / 1e9


def record_step_totals(results: dict, variants, path) -> None:
    """A step's time per variant (every shape's time x its calls; only variants that ran correctly on
    every shape) and the best variant, printed and saved."""
    import json

    shapes = list(results["shapes"].values())
    totals = {"inductor": sum(e["inductor_ms"] * e["per_step"] for e in shapes)}
    for variant in variants:
        times = [e[f"ours_{variant}_ms"] for e in shapes]
        if all(times):
            totals[variant] = sum(t * e["per_step"] for t, e in zip(times, shapes))
    results["ms_per_step"] = totals
    results["best_variant"] = min((v for v in totals if v != "inductor"), key=totals.get, default=None)
    print(json.dumps({"ms_per_step": totals, "best_variant": results["best_variant"]}))
    save_json(path, results)
