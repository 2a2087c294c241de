"""Domain-shift arms over seeds: the held-out tau each arm ends on, with 95% intervals and paired differences.

Reads `domain_shift.json` files written by benchmarks/domain_shift.py, one or more per seed (an arm's runs
may be split over several invocations, e.g. `--arms auto --seed 1` and `--arms target_rollout,draft_opd
--seed 1`). Runs are compared only when they share the held-out set and the static drafter's tau (same
bootstrap, same prompts), the minutes per arm, the speculation mode, feature capture and the code the arms ran
(`code_version`; `--allow-mixed-commits` to compare different code anyway, `--by-code` to compare an arm
with itself on different code: each arm is then named `<arm>@<code>`, `--same-code A=B` to read code A as
B where their difference does not touch the arms; `--by-set` to compare an arm with itself under different
`--set` overrides: each arm is then named `<arm>+<overrides>`, or `<arm>` with none); anything else is refused
with the differing setting named. Per arm: the held-out tau of the version serving at the end of
each seed's run (its last promotion or rollback), its ratio to the static drafter, mean and Student-t 95%
interval over seeds, trainer steps and keep-up (trained / served tokens per second); per pair of arms:
the paired difference on the seeds both ran, and at equal trainer steps: at each seed S = the fewer final
steps of the two, each arm's held-out tau of the last version it promoted (or rolled back to) that was
trained for at most S steps (the timeline's `step`, or for runs before that field the version's manifest
in the arm's registry when its run folder is still there; the static drafter is step 0). Prints JSON.

    python benchmarks/domain_shift_seeds.py runs/ds-s*/domain_shift.json \\
        --json-out benchmarks/results/domain_shift_seeds.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

from intervals import t_interval  # sibling module: benchmarks/ leads sys.path
from provenance import print_result

SHARED = ("static_tau", "held_out_prompts", "max_tokens", "speculation", "capture_features", "minutes_per_arm",
          "traffic", "set")
FIRST_TRAFFIC = "humaneval-train-first-16"  # runs without a `traffic` field: the same 16 prompts all along


def settings(run: dict) -> dict:
    """The settings two runs must share; minutes per arm read from the command for runs that predate the
    `minutes_per_arm` field (the script's default then: 14), and FIRST_TRAFFIC for runs before `traffic`."""
    out = {k: run.get(k) for k in SHARED}
    out["traffic"] = out["traffic"] or FIRST_TRAFFIC
    out["set"] = out["set"] or []  # runs before `--set`: none
    if out["minutes_per_arm"] is None:
        found = re.search(r"--minutes[ =](\S+)", run.get("command") or "")
        out["minutes_per_arm"] = float(found.group(1)) if found else 14.0
    out["static_tau"] = round(float(out["static_tau"]), 6)
    return out


def version_step(arm: dict, point: dict) -> int | None:
    """The trainer step of the version a timeline point switched to: the point's `step`, else the
    version's manifest under the arm's run folder; None when neither is there."""
    if point.get("step") is not None:
        return int(point["step"])
    if not (arm.get("run_dir") and point.get("version")):
        return None
    manifest = Path(arm["run_dir"]) / "registry" / "versions" / point["version"] / "manifest.json"
    return int(json.loads(manifest.read_text())["step"]) if manifest.is_file() else None


def steps_timeline(arm: dict, static_tau: float) -> list[tuple[int, float]] | None:
    """[(trainer step, held-out tau)] of the versions the arm served in order, from (0, static tau); None
    when a step is unknown. The first point is the bootstrap drafter itself (its step is the bootstrap's)."""
    points = [(0, static_tau)]
    for point in arm["timeline"][1:]:
        step = version_step(arm, point)
        if step is None:
            return None
        points.append((step, float(point["tau_held_out"])))
    return points


def tau_at_step(points: list[tuple[int, float]], steps: float) -> float:
    """The held-out tau of the last version served whose trainer step is at most `steps`."""
    return [tau for step, tau in points if step <= steps][-1]


def arm_name(arm: dict, commit: str, overrides: list[str], by_code: bool, by_set: bool) -> str:
    """The arm's key: its name, then ``@<code>`` with ``by_code``, then ``+<overrides>`` with ``by_set``."""
    name = f"{arm['name']}@{commit}" if by_code else arm["name"]
    return f"{name}+{','.join(overrides)}" if by_set and overrides else name


def collect(paths: list[Path], allow_mixed_commits: bool = False, by_code: bool = False,
            same_code: dict[str, str] | None = None,
            by_set: bool = False) -> tuple[dict, dict[str, dict[int, dict]]]:
    """(shared settings, {arm: {seed: figures}}); refuses runs that differ, an arm seen twice at a seed, and
    (unless ``allow_mixed_commits`` or ``by_code``) runs of different code (``code_version``: the served and
    trained code, whatever else the commits changed; else ``commit``; "unknown" for runs that recorded
    neither). ``by_code``: arms are keyed ``<arm>@<code>``, so the pairs compare code versions seed by seed.
    ``same_code``: code versions to read as another (``{"174444aeddfd": "d5680d6ead01"}``: the caller
    checked that what differs between them does not touch the arms compared; the JSON lists both).
    ``by_set``: runs may differ in their ``--set`` overrides, and arms are keyed ``<arm>+<overrides>``
    (the shared settings' ``set`` then lists each run's)."""
    shared, arms, commits, overrides = None, {}, set(), []
    same_code = same_code or {}
    for path in paths:
        run = json.loads(path.read_text())
        recorded = run.get("code_version") or run.get("commit") or "unknown"
        commit = same_code.get(recorded, recorded)
        commits.add(commit)
        if len(commits) > 1 and not (allow_mixed_commits or by_code):
            raise SystemExit(f"{path}: ran on code {commit}, the runs before it on {sorted(commits - {commit})}; "
                             "--allow-mixed-commits to compare them anyway")
        these = settings(run)
        run_set = these["set"]
        if by_set:
            if run_set not in overrides:
                overrides.append(run_set)
            these["set"] = None  # compared by arm name instead
        if shared is None:
            shared = these
        elif these != shared:
            diff = {k: (shared[k], these[k]) for k in SHARED if shared[k] != these[k]}
            raise SystemExit(f"{path}: not comparable with the runs before it: {diff}")
        seed = int(run.get("seed", 0))
        for arm in run["arms"]:
            name = arm_name(arm, commit, run_set, by_code, by_set)
            if seed in arms.setdefault(name, {}):
                raise SystemExit(f"{path}: arm {name} at seed {seed} appears twice")
            end = arm["timeline"][-1]["tau_held_out"] if arm["timeline"] else run["static_tau"]
            keep_up = arm.get("keep_up") or {}
            arms[name][seed] = {"tau": float(end), "steps": arm.get("trainer_steps"),
                                "by_step": steps_timeline(arm, float(run["static_tau"])),
                                "promotions": sum(p["event"] == "promote" for p in arm["timeline"][1:]),
                                "keep_up": keep_up.get("keep_up"), "source": str(path), "code": recorded}
    if shared is None:
        raise SystemExit("no runs given")
    if by_set:
        shared["set"] = overrides
    return {**shared, "code": sorted(commits)}, arms


def equal_steps(a: dict[int, dict], b: dict[int, dict], seeds: list[int]) -> dict | None:
    """The pair at each seed's fewer final trainer steps (``tau_at_step``), on the seeds where both arms' version
    steps are known; None when there are none."""
    known = [s for s in seeds if a[s]["by_step"] and b[s]["by_step"] and a[s]["steps"] is not None
             and b[s]["steps"] is not None]
    if not known:
        return None
    steps = {s: min(a[s]["steps"], b[s]["steps"]) for s in known}
    taus = {s: (tau_at_step(a[s]["by_step"], steps[s]), tau_at_step(b[s]["by_step"], steps[s])) for s in known}
    return {"seeds": known, "steps": [steps[s] for s in known], "taus": [list(taus[s]) for s in known],
            "diff": t_interval([ta - tb for ta, tb in taus.values()]),
            "ratio": t_interval([ta / tb for ta, tb in taus.values()])}


def summarise(shared: dict, arms: dict[str, dict[int, dict]]) -> dict:
    static = shared["static_tau"]
    per_arm = {}
    for name, by_seed in sorted(arms.items()):
        seeds = sorted(by_seed)
        taus = [by_seed[s]["tau"] for s in seeds]
        keep = [by_seed[s]["keep_up"] for s in seeds if by_seed[s]["keep_up"] is not None]
        per_arm[name] = {"seeds": seeds, "tau": t_interval(taus),
                         "ratio_to_static": t_interval([t / static for t in taus]),
                         "per_seed": {s: by_seed[s] for s in seeds},
                         "keep_up": t_interval(keep) if keep else None}
    pairs = {}
    for a, b in itertools.combinations(sorted(arms), 2):
        common = sorted(set(arms[a]) & set(arms[b]))
        if common:
            diffs = [arms[a][s]["tau"] - arms[b][s]["tau"] for s in common]
            pairs[f"{a} - {b}"] = {"seeds": common, "diff": t_interval(diffs),
                                   "ratio": t_interval([arms[a][s]["tau"] / arms[b][s]["tau"] for s in common]),
                                   "equal_steps": equal_steps(arms[a], arms[b], common)}
    return {"settings": shared, "arms": per_arm, "paired": pairs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="domain_shift.json files")
    p.add_argument("--json-out", type=Path, help="also write the summary here")
    p.add_argument("--allow-mixed-commits", action="store_true",
                   help="compare runs made on different source commits (each seed's commit is listed)")
    p.add_argument("--by-code", action="store_true",
                   help="name each arm <arm>@<code version>: the same arm run on two code versions becomes two "
                        "arms, paired seed by seed (implies --allow-mixed-commits)")
    p.add_argument("--same-code", action="append", default=[], metavar="CODE=AS",
                   help="read code version CODE as AS (repeatable): runs whose code differs only where the arms "
                        "compared never read it (check with git diff first)")
    p.add_argument("--by-set", action="store_true",
                   help="name each arm <arm>+<its run's --set overrides>: the same arm run with other overrides "
                        "becomes another arm, paired seed by seed")
    args = p.parse_args(argv)
    aliases = dict(pair.split("=", 1) for pair in args.same_code if "=" in pair)
    if len(aliases) != len(args.same_code):
        p.error("--same-code takes CODE=AS")
    summary = summarise(*collect(args.runs, args.allow_mixed_commits, args.by_code, aliases, args.by_set))
    print_result(summary, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
