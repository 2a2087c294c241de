"""Replay recorded engine steps through the step-cost table: how steady is the ratio the policy compares?

The policy decides at each batch size b by t(b, K) / t(b, 0) (online_opd/speculation/policy.py). This
replays the decode steps of ``--step-profile`` runs (benchmarks/serving_overhead.py writes
``<dir>/<variant>/scheduler-<pid>.jsonl``) through ``StepCosts``, once with the speed factor (the
default) and once with the former per-bucket EMA (``track_speed=False``), and reports, for the (b, K)
pairs measured at both K and 0 (at least ``--min-steps`` steps each), the ratio the table gave every
``--every`` steps: mean, standard deviation and range, and the ratio of the two buckets' medians
within windows of ``--window-s`` seconds where both ran (a local comparison, free of drift, but
noisy: few plain steps per window), with the table's root-mean-square error against it.

    python benchmarks/step_cost_drift.py runs/b31/c1_steps/fresh/scheduler-*.jsonl

Prints JSON. Needs no engine: the files are what a benchmark recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from online_opd.speculation.costs import StepCosts


def steady_steps(path: Path) -> list[dict]:
    """Decode steps where every request verified K drafts (what the engine's table times)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "decode" and r["verified"] == r["k"] * r["b"]]


def local_ratio(steps: list[dict], b: int, k: int, window_s: float) -> float | None:
    """Median over windows of the ratio of the two buckets' median seconds in the window."""
    t0, ratios = steps[0]["time"], []
    windows: dict[int, dict[int, list[float]]] = {}
    for r in steps:
        if r["b"] == b and r["k"] in (0, k):
            windows.setdefault(int((r["time"] - t0) // window_s), {}).setdefault(r["k"], []).append(r["seconds"])
    for by_k in windows.values():
        if len(by_k.get(0, ())) >= 2 and len(by_k.get(k, ())) >= 2:
            ratios.append(statistics.median(by_k[k]) / statistics.median(by_k[0]))
    return round(statistics.median(ratios), 4) if ratios else None


def replay(steps: list[dict], costs: StepCosts, pairs: list[tuple[int, int]], every: int,
           local: dict[tuple[int, int], float | None]) -> dict:
    seen: dict[tuple[int, int], list[float]] = {p: [] for p in pairs}
    for i, r in enumerate(steps):
        costs.observe(r["b"], r["k"], r["seconds"])
        if i % every:
            continue
        table = {(b, k): (seconds, n) for b, k, seconds, n, *_ in costs.to_rows()}
        for b, k in pairs:
            spec, plain = table.get((b, k)), table.get((b, 0))
            if spec and plain and spec[1] >= 8 and plain[1] >= 8:
                seen[(b, k)].append(spec[0] / plain[0])
    out = {}
    for (b, k), v in seen.items():
        if not v:
            continue
        row = {"mean": round(statistics.fmean(v), 4), "sd": round(statistics.pstdev(v), 4),
               "min": round(min(v), 4), "max": round(max(v), 4), "final": round(v[-1], 4)}
        if local.get((b, k)):  # relative root-mean-square error of the table's ratio, over the run
            row["rms_error_vs_local"] = round(
                statistics.fmean([(x / local[(b, k)] - 1.0) ** 2 for x in v]) ** 0.5, 4)
        out[f"b={b},K={k}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="scheduler-<pid>.jsonl step profiles")
    parser.add_argument("--min-steps", type=int, default=8, help="steps at K and at 0 for a pair to count")
    parser.add_argument("--every", type=int, default=10, help="read the table every N steps")
    parser.add_argument("--window-s", type=float, default=15.0, help="window of the local comparison")
    args = parser.parse_args(argv)
    runs = []
    for path in args.files:
        steps = steady_steps(path)
        if not steps:
            print(f"{path}: no steady decode steps", file=sys.stderr)
            continue
        count = Counter((r["b"], r["k"]) for r in steps)
        pairs = sorted((b, k) for (b, k), n in count.items()
                       if k > 0 and n >= args.min_steps and count.get((b, 0), 0) >= args.min_steps)
        local = {(b, k): local_ratio(steps, b, k, args.window_s) for b, k in pairs}
        runs.append({
            "file": str(path), "steady_steps": len(steps),
            "steps": {f"b={b},K={k}": count[(b, k)] for b, k in sorted(count)},
            "local_ratio": {f"b={b},K={k}": local[(b, k)] for b, k in pairs},
            "speed_factor": replay(steps, StepCosts(), pairs, args.every, local),
            "former_ewma": replay(steps, StepCosts(track_speed=False), pairs, args.every, local),
        })
    print(json.dumps({"benchmark": "step_cost_drift", "window_s": args.window_s, "runs": runs}, indent=1))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
