"""Pool one paired comparison of two arms over several `domain_shift_seeds.py` summaries.

Each summary is one comparison (its own bootstrap, minutes per arm, code); within it the two arms ran on
the same seeds. This pools the per-seed ratios A / B of every summary's common seeds into one Student-t
interval (each (summary, seed) pair one observation), lists each summary's own interval beside it, and
tests the pooled mean against `--against` (one-sample t, two-sided). Differences between the summaries
(a stronger bootstrap, longer runs) add to the spread; the pooled interval states what the pairs show
together, not a figure for one setting.

    python benchmarks/pool_comparisons.py benchmarks/results/domain_shift_seeds_2arms.json \\
        benchmarks/results/domain_shift_seeds_trial_vs_target_rollout.json \\
        benchmarks/results/domain_shift_seeds_b46.json --arms auto naive --against 1.05
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from intervals import t_interval  # sibling module: benchmarks/ leads sys.path
from provenance import print_result
from scipy import stats


def ratios(summary: dict, a: str, b: str) -> dict[str, float]:
    """Per seed both arms ran: arm a's final held-out tau / arm b's."""
    arms = summary["arms"]
    missing = [name for name in (a, b) if name not in arms]
    if missing:
        raise ValueError(f"arm(s) {missing} not in this summary (it has {sorted(arms)})")
    ta, tb = arms[a]["per_seed"], arms[b]["per_seed"]
    common = sorted(set(ta) & set(tb), key=int)
    if not common:
        raise ValueError(f"arms {a} and {b} share no seed")
    return {s: ta[s]["tau"] / tb[s]["tau"] for s in common}


def pool(summaries: dict[str, dict], a: str, b: str, against: float | None = None) -> dict:
    per = {}
    for name, summary in summaries.items():
        try:
            per[name] = ratios(summary, a, b)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    values = [r for by_seed in per.values() for r in by_seed.values()]
    out = {"arms": [a, b], "ratio": t_interval(values),
           "comparisons": {name: {"settings": summaries[name].get("settings"),
                                  "ratio_per_seed": {s: round(r, 4) for s, r in by_seed.items()},
                                  "ratio": t_interval(list(by_seed.values()))} for name, by_seed in per.items()}}
    if against is not None and len(values) >= 2:
        test = stats.ttest_1samp(values, against)
        out["against"] = {"ratio": against, "t": round(float(test.statistic), 3), "p": float(f"{test.pvalue:.3g}")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summaries", nargs="+", type=Path, help="domain_shift_seeds.py --json-out files")
    p.add_argument("--arms", nargs=2, default=["auto", "naive"], metavar=("A", "B"),
                   help="the pair, ratio A / B (default: auto naive, the default against target-rollout KL)")
    p.add_argument("--against", type=float, help="also test the pooled mean ratio against this value")
    p.add_argument("--json-out", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    try:
        summaries = {str(path): json.loads(path.read_text()) for path in args.summaries}
        result = pool(summaries, *args.arms, against=args.against)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
        p.exit(2, f"pool_comparisons: {type(exc).__name__}: {exc}\n")
    print_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
