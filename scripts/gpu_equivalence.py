"""Equivalence figures on the GPU: patched vs unpatched vs an fp32 reference, as JSON.

    python scripts/gpu_equivalence.py --json out.json

For each config: the relative L2 error of every returned tensor and every gradient against an
fp32 unpatched reference, for the unpatched and the patched low-precision step (mean over
tensors, worst tensor, worst patched/unpatched ratio); masks compared bit for bit; and whether
the patched step runs with PyTorch's math SDPA backend forbidden. The pass/fail rules are the
tests' (tests/equivalence.py); this script reports the numbers behind them.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import hiera_autopatch  # noqa: E402
from equivalence import rel_error, run_pair, run_step  # noqa: E402


def summarize(unpatched, patched, reference):
    a, b, r = patched.named(), unpatched.named(), reference.named()
    rows, masks_equal = [], True
    for name, ref in r.items():
        if not ref.is_floating_point():
            masks_equal &= torch.equal(a[name], ref) and torch.equal(b[name], ref)
            continue
        rows.append((name, rel_error(a[name], ref), rel_error(b[name], ref)))
    worst = max(rows, key=lambda row: row[1])
    ratios = [p / u for _, p, u in rows if u > 0]
    return {
        "tensors": len(rows),
        "masks_identical": masks_equal,
        "mean_rel_err_patched": sum(p for _, p, _ in rows) / len(rows),
        "mean_rel_err_unpatched": sum(u for _, _, u in rows) / len(rows),
        "worst_tensor": {"name": worst[0], "patched": worst[1], "unpatched": worst[2]},
        "median_ratio_patched_over_unpatched": sorted(ratios)[len(ratios) // 2],
        "output0_rel_err": {"patched": rows[0][1], "unpatched": rows[0][2]},
    }


def fused_only(model, x, call) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            run_step(model, x, call)
        return "ok"
    except RuntimeError as exc:
        return f"failed: {str(exc)[:200]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    args = parser.parse_args(argv)
    import hiera
    import timm

    hiera_autopatch.enable()
    generator = torch.Generator(device=args.device).manual_seed(0)
    images = torch.randn(args.batch, 3, 224, 224, device=args.device, generator=generator)
    mae = lambda m, x: m(x, mask_ratio=0.6)  # noqa: E731
    cls = lambda m, x: m(x)  # noqa: E731
    configs = [
        ("fair mae_hiera_base_224", lambda: hiera.mae_hiera_base_224(), mae),
        ("fair mae_hiera_large_224", lambda: hiera.mae_hiera_large_224(), mae),
        ("fair hiera_base_224 (classification)", lambda: hiera.hiera_base_224(), cls),
        ("timm hiera_base_224", lambda: timm.create_model("hiera_base_224", pretrained=False), cls),
    ]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"command": " ".join(sys.argv), "torch": torch.__version__, "gpu": gpu,
               "batch": args.batch, "configs": {}}
    for name, build, call in configs:
        torch.manual_seed(0)
        model = build().to(args.device)
        with hiera_autopatch.disabled():
            reference = run_step(copy.deepcopy(model).float(), images, call)
        entry = {}
        for label, dtype, autocast in [("bf16", torch.bfloat16, None), ("amp_bf16", None, torch.bfloat16)]:
            low = copy.deepcopy(model).to(dtype) if dtype else model
            x = images.to(dtype) if dtype else images
            unpatched, patched = run_pair(low, x, call, autocast_dtype=autocast)
            entry[label] = summarize(unpatched, patched, reference)
        if args.device == "cuda":
            entry["fused_sdpa_only"] = fused_only(copy.deepcopy(model).to(torch.bfloat16), images.to(torch.bfloat16), call)
        results["configs"][name] = entry
        print(name, json.dumps({k: (v if isinstance(v, str) else round(v["mean_rel_err_patched"], 5)) for k, v in entry.items()}),
              file=sys.stderr, flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results["configs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
