"""An objective's hyper-parameters swept offline: each setting is `objectives.py --arms <arm>` (`--arm`,
default draft_opd) with trainer overrides, over the same seeds, and compared with the first setting seed by seed.

    python benchmarks/objective_sweep.py --seeds 0 1 2 --steps 30 \\
        --setting default= --setting naive=trainer.lambda_rej=0 --setting gamma1=trainer.gamma=1.0
    python benchmarks/objective_sweep.py --arm lk --steps 100 --setting lr3e-4= --setting lr1e-3=trainer.lr=1e-3 \\
        data.prompts=humaneval

Every setting trains in its own folder (`<out>/sweep-<name>`, sharing `objectives.py`'s cached
rollouts and features through symlinks) and writes `<out>/sweep-<name>.json`. The result printed,
and written to `--json-out` after each setting, holds per setting the held-out tau over seeds with
its 95% t-interval and the paired difference from the first setting (the reference).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import t_interval  # noqa: E402


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"setting {text!r}: NAME=override[,override...] (NAME= for none)")
    return name, [o for o in overrides.split(",") if o]


def run_setting(args, name: str, overrides: list[str]) -> dict:
    folder = args.out / f"sweep-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    for cache in ("train", "held_out"):  # objectives.py's rollouts and target features, computed once
        link = folder / cache
        if not link.exists():
            link.symlink_to((args.out / cache).resolve(), target_is_directory=True)
    out_json = args.out / f"sweep-{name}.json"
    if not out_json.exists():
        cmd = [sys.executable, str(Path(__file__).parent / "objectives.py"), "--bootstrap", str(args.bootstrap),
               "--out", str(folder), "--steps", str(args.steps), "--arms", args.arm, "--reference", args.arm,
               "--seeds", *map(str, args.seeds), "--json-out", str(out_json),
               *(["--served-width", str(args.served_width)] if args.served_width else []), *args.overrides, *overrides]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out_json.read_text())


def summarise(results: dict[str, dict], settings: dict[str, list[str]], seeds: list[int],
              arm: str = "draft_opd") -> dict:
    reference = next(iter(results))
    ref_taus = {s: results[reference]["per_seed"][str(s)][arm]["tau"] for s in seeds}
    summary = {}
    for name, result in results.items():
        per_seed = result["per_seed"]
        taus = {s: per_seed[str(s)][arm]["tau"] for s in seeds}
        entry = {"overrides": settings[name], "tau": t_interval(list(taus.values())), "per_seed_tau": taus,
                 "acceptance_rate_per_position": [
                     round(sum(per_seed[str(s)][arm]["acceptance_rate_per_position"][k] for s in seeds)
                           / len(seeds), 4) for k in range(len(per_seed[str(seeds[0])][arm]
                                                                ["acceptance_rate_per_position"]))]}
        if name != reference:
            entry[f"paired_diff_vs_{reference}"] = t_interval([taus[s] - ref_taus[s] for s in seeds])
        summary[name] = entry
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", type=Path, default=Path("runs/exp/bt-text"), help="bootstrap run folder")
    parser.add_argument("--out", type=Path, default=Path("runs/objectives"), help="objectives.py's --out (its cache)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--setting", type=parse_setting, action="append", required=True,
                        help="NAME=override[,override...]; the first one is the reference")
    parser.add_argument("--arm", default="draft_opd", help="the objectives.py arm every setting trains")
    parser.add_argument("--served-width", type=int, default=None, help="objectives.py's --served-width")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides of every setting (objectives.py's), "
                        "e.g. data.prompts=humaneval")
    args = parser.parse_args()
    if len(args.seeds) < 2:
        parser.error("--seeds: at least two, for an interval")
    settings = dict(args.setting)
    if len(settings) != len(args.setting):
        parser.error("--setting: names must differ")
    results: dict[str, dict] = {}
    report: dict = {}
    for name, overrides in settings.items():
        results[name] = run_setting(args, name, overrides)
        report = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "cpu_count": os.cpu_count(), "bootstrap": str(args.bootstrap), "steps": args.steps,
                  "seeds": args.seeds, "arm": args.arm, "overrides": args.overrides,
                  "reference": next(iter(settings)),
                  "bootstrap_tau": results[name]["bootstrap_score"]["tau"],
                  "summary": summarise(results, settings, args.seeds, args.arm)}
        if args.json_out is not None:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
