"""Did a candidate mode beat its base in every interleaved pair of a profile_step.py run?

    python scripts/ab_pairs.py profile.json --candidate graphs+ln_by_width [--base graphs] [--min-pairs 3]

Pairs the two modes by repeat (``graphs`` with ``graphs+ln_by_width``, ``graphs#2`` with
``graphs+ln_by_width#2``, ...) on their median ms/step, prints JSON, and exits 0 only when the
candidate was faster in every complete pair and there were at least ``--min-pairs`` of them (1 when
not, 2 on bad input). Our rule for shipping a default (a step's repeats spread by ~2 ms within one
process, so the sign of every pair is the evidence, not one pair's size). Lets a single device call
run the A/B and, only if it wins, apply the change and bench it:
``python3 scripts/ab_pairs.py $OUT/p.json --candidate graphs+ln_by_width && sed -i ... && bench``.
For a ``profile_step.py --interleave`` run each pair also compares the two modes' steps round by
round (``candidate_faster`` of ``rounds``, ``median_diff_ms``), and a pair is won when that median
difference is below zero: the two medians alone would keep the drift the rounds cancel. The output
also holds ``aa_pairs`` (the base's repeats against each other, the run's own noise) and
``clear_of_aa_spread``: whether every pair's gain exceeds the widest of them (null when the run was
not interleaved). The exit status still says only whether every pair was won.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def median_ms(modes: dict, name: str):
    """A mode's median ms/step, or None when the run did not get to it (cut by a timeout)."""
    return (modes.get(name, {}).get("ms_per_step") or {}).get("median")


def pairs(modes: dict, base: str, candidate: str) -> list:
    """[{repeat, base_ms, candidate_ms}] for each repeat both modes completed, in run order."""
    repeats = list(dict.fromkeys(name.partition("#")[2] for name in modes))  # run order, "" first-run
    found = []
    for repeat in repeats:
        suffix = f"#{repeat}" if repeat else ""
        base_ms, candidate_ms = median_ms(modes, base + suffix), median_ms(modes, candidate + suffix)
        if base_ms is not None and candidate_ms is not None:
            found.append({"repeat": repeat or "1", "base_ms": base_ms, "candidate_ms": candidate_ms,
                          **by_round(modes, base + suffix, candidate + suffix)})
    return found


def by_round(modes: dict, base: str, candidate: str) -> dict:
    """For a --interleave run (modes carry ``round_ms``): the two modes' steps of the same round
    compared, candidate minus base; drift over the run falls on both alike. Empty otherwise."""
    base_ms, candidate_ms = (modes.get(name, {}).get("round_ms") for name in (base, candidate))
    if not base_ms or not candidate_ms or len(base_ms) != len(candidate_ms):
        return {}
    diffs = [c - b for b, c in zip(base_ms, candidate_ms)]
    return {"rounds": len(diffs), "candidate_faster": sum(d < 0 for d in diffs),
            "median_diff_ms": statistics.median(diffs)}


def repeat_pairs(modes: dict, base: str) -> list:
    """A/A pairs of an interleaved run: each two repeats of ``base`` (``graphs`` and ``graphs#2``,
    ...) compared round by round as ``by_round`` does, ``other`` minus ``base``. The same step timed
    twice in one run: how far apart two modes land with nothing changed."""
    names = [name for name in modes if name.partition("#")[0] == base and modes[name].get("round_ms")]
    found = []
    for i, first in enumerate(names):
        for other in names[i + 1:]:
            rounds = by_round(modes, first, other)
            if rounds:
                found.append({"base": first, "other": other, "rounds": rounds["rounds"],
                              "other_faster": rounds["candidate_faster"],
                              "median_diff_ms": rounds["median_diff_ms"]})
    return found


def clear_of_noise(found: list, same: list):
    """Each pair's round-median gain larger than the widest A/A difference of the same run; None
    without round-by-round pairs to judge by."""
    if not same or not found or any("median_diff_ms" not in pair for pair in found):
        return None
    spread = max(abs(pair["median_diff_ms"]) for pair in same)
    return all(-pair["median_diff_ms"] > spread for pair in found)


def lost(pair: dict) -> bool:
    """The candidate did not win this pair: by its steps' median difference round by round where
    the run was interleaved (drift cancels), else by the two modes' medians."""
    if "median_diff_ms" in pair:
        return pair["median_diff_ms"] >= 0
    return pair["candidate_ms"] >= pair["base_ms"]


def verdict(found: list, min_pairs: int) -> str:
    if len(found) < min_pairs:
        return f"undecided: {len(found)} complete pair(s), {min_pairs} needed"
    slower = sum(lost(p) for p in found)
    return "wins every pair" if not slower else f"not a win: slower or equal in {slower} of {len(found)} pairs"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile_json", help="scripts/profile_step.py's --json output")
    parser.add_argument("--candidate", required=True, help="mode without its #n, e.g. graphs+ln_by_width")
    parser.add_argument("--base", default="graphs", help="mode without its #n (default: graphs)")
    parser.add_argument("--min-pairs", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        with open(args.profile_json) as f:
            modes = json.load(f)["modes"]
    except (OSError, ValueError, KeyError) as err:
        print(f"ab_pairs: cannot read modes from {args.profile_json}: {err}", file=sys.stderr)
        return 2
    run = {name.partition("#")[0] for name in modes}
    missing = [name for name in (args.base, args.candidate) if name not in run]
    if missing:
        print(f"ab_pairs: no mode {', '.join(missing)} in {args.profile_json} (it has: {', '.join(sorted(run))})",
              file=sys.stderr)
        return 2
    found = pairs(modes, args.base, args.candidate)
    same = repeat_pairs(modes, args.base)
    result = {"base": args.base, "candidate": args.candidate, "pairs": found,
              "verdict": verdict(found, args.min_pairs), "aa_pairs": same,
              "clear_of_aa_spread": clear_of_noise(found, same)}
    print(json.dumps(result, indent=1))
    return 0 if result["verdict"] == "wins every pair" else 1


if __name__ == "__main__":
    sys.exit(main())
