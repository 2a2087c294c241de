"""False-rollback rate and power of the live check (online_opd/release/live_check.py), simulated.

For each baseline tau and each relative drop of the candidate's tau, runs
``--num-checks`` live checks exactly as the reloader decides them (the serve
config's ``live_check_drafts``, ``live_check_min_windows``, ``live_check_alpha``
and ``rollback_tolerance``, unless overridden) on simulated status polls:
Poisson(``--drafts-per-window``) drafts per poll, each poll's per-position
acceptance drawn from Beta(c p, c (1 - p)) around the p of tau (c =
``--concentration``: how much traffic varies between polls). Prints one JSON
object: the rollback rate per (tau, drop); drop 0 is the false-rollback rate,
the others the power (drops that would put tau below 1 are skipped). Example:

    python benchmarks/live_check_power.py --taus 1.15 1.6 2.5 --drops 0 0.05 0.1 0.25
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from online_opd.config import ServeConfig
from online_opd.release.live_check import simulate_rollback_rate


def parse_args() -> argparse.Namespace:
    defaults = ServeConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--taus", type=float, nargs="+", default=[1.15, 1.6, 2.5], help="baseline taus")
    parser.add_argument("--drops", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.25],
                        help="relative drops of the candidate's tau (0 = as good as the baseline)")
    parser.add_argument("--num-checks", type=int, default=2000, help="simulated checks per figure")
    parser.add_argument("--drafts-per-window", type=float, nargs="+", default=[50.0, 200.0, 1000.0],
                        help="mean drafts served per status poll")
    parser.add_argument("--concentration", type=float, default=50.0,
                        help="Beta concentration of per-poll acceptance (inf: polls differ only by chance)")
    parser.add_argument("--block-size", type=int, default=4, help="K, draft tokens per block")
    parser.add_argument("--min-drafts", type=int, default=defaults.live_check_drafts)
    parser.add_argument("--min-windows", type=int, default=defaults.live_check_min_windows)
    parser.add_argument("--alpha", type=float, default=defaults.live_check_alpha)
    parser.add_argument("--tolerance", type=float, default=defaults.rollback_tolerance)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    rows = []
    for drafts_per_window in args.drafts_per_window:
        for tau in args.taus:
            for drop in args.drops:
                tau_candidate = tau * (1 - drop)
                if tau_candidate < 1.0:  # below one token per step: no drafter does that
                    continue
                result = simulate_rollback_rate(
                    rng, tau_baseline=tau, tau_candidate=tau_candidate, num_checks=args.num_checks,
                    min_drafts=args.min_drafts, min_windows=args.min_windows, tolerance=args.tolerance,
                    alpha=args.alpha, drafts_per_window=drafts_per_window, block_size=args.block_size,
                    concentration=args.concentration)
                rows.append({"drafts_per_window": drafts_per_window, "tau_baseline": tau, "drop": drop,
                             "tau_candidate": round(tau_candidate, 4), **result})
    print(json.dumps({
        "settings": {k: getattr(args, k) for k in ("min_drafts", "min_windows", "alpha", "tolerance",
                                                     "num_checks", "concentration", "block_size", "seed")},
        "false_rollback_rate_max": max(r["rollback_rate"] for r in rows if r["drop"] == 0),
        "results": rows, "seconds": round(time.perf_counter() - start, 1)}, indent=2))


if __name__ == "__main__":
    main()
