"""GPU time of kernel groups in a committed profile: ms and calls per step of the kernels whose
names match each regex, from a ``scripts/profile_step.py`` JSON's ``top_kernels_ms`` list.

    python scripts/kernel_groups.py benchmarks/results/h200_profile_final.json --mode graphs \
        --group 'pure sums=^triton_(red|per)_fused_sum_view_\\d+$' --group 'split-K reduce=splitKreduce'

Each kernel counts in the first group it matches. Only the listed kernels are seen (``--top`` of the
run that made the file). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Dict, List, Tuple


def parse_group(text: str) -> Tuple[str, str]:
    name, sep, pattern = text.partition("=")
    if not sep or not name or not pattern:
        raise argparse.ArgumentTypeError(f"--group wants NAME=REGEX, got {text!r}")
    re.compile(pattern)
    return name, pattern


def group_kernels(kernels: List[dict], groups: List[Tuple[str, str]]) -> Dict[str, dict]:
    """{group: {"ms": per step, "calls": per step, "kernels": distinct names}} for the ``kernels``
    entries ({"name", "ms", "calls"}), each in the first group whose regex finds its name."""
    totals = {name: {"ms": 0.0, "calls": 0.0, "kernels": 0} for name, _ in groups}
    for kernel in kernels:
        for name, pattern in groups:
            if re.search(pattern, kernel["name"]):
                totals[name]["ms"] += kernel["ms"]
                totals[name]["calls"] += kernel["calls"]
                totals[name]["kernels"] += 1
                break
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a scripts/profile_step.py JSON")
    parser.add_argument("--mode", required=True, help="one of the file's modes, e.g. graphs")
    parser.add_argument("--group", type=parse_group, action="append", required=True, metavar="NAME=REGEX")
    args = parser.parse_args(argv)
    with open(args.profile) as fh:
        modes = json.load(fh).get("modes", {})
    if args.mode not in modes or "kernels" not in modes[args.mode]:
        parser.error(f"{args.profile} has no kernel list for mode {args.mode!r} (modes: {', '.join(modes)})")
    kernels = modes[args.mode]["kernels"]
    result = {"profile": args.profile, "mode": args.mode, "listed_kernels": len(kernels["top_kernels_ms"]),
              "kernel_ms_per_step": kernels["total_ms"],
              "groups": group_kernels(kernels["top_kernels_ms"], args.group)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
