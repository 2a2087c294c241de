"""Seen against unseen prompts: the exact T=0 tau of drafters on the target's replies to HumanEval prompts the
domain-shift traffic trained on (train split) and to prompts it never saw (held_out split): a drafter whose
held-out tau stalls while it fits the traffic (seen >> unseen) is limited by what transfers from that traffic;
one that fits neither (seen ~ unseen) by what it can learn at all.
The online gate keeps about 15% of the traffic's prompts out of training (by prompt prefix), so some "seen"
prompts were only served, never trained on: the gap it prints is a lower bound.

    python benchmarks/generalisation_gap.py --drafter static=runs/bootstrap/drafter \\
        --drafter s1=runs/b38/ds30-s1/auto/registry/versions/v0047 --out runs/gap.json

``--average NAME=FOLDER:N`` scores the uniform average of the weights of the N newest checkpoints in FOLDER (a
registry's versions folder: a run's last candidates, 25 steps apart in benchmarks/domain_shift.py), as a moving
average of the trained weights would serve them (online.ema_decay):

    python benchmarks/generalisation_gap.py --drafter v0047=runs/b38/ds30-s1/auto/registry/versions/v0047 \
        --average last15=runs/b38/ds30-s1/auto/registry/versions:15

Prints JSON: per drafter, tau on each split and seen - unseen.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from domain_shift import ROOT, HeldOutTau, humaneval_rollouts, load_config, load_drafter  # noqa: E402

from online_opd.models.drafters.checkpoint import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402
from serve.pipeline import resolve_target  # noqa: E402


def average_checkpoints(folder: Path, newest: int, out: Path) -> list[str]:
    """Write to ``out`` the uniform average (in float64, cast back) of the weights of the ``newest``
    checkpoints in ``folder`` (by name: registry versions sort by number); returns their names."""
    versions = sorted(p for p in folder.iterdir() if (p / WEIGHTS_FILE).exists())[-newest:]
    if len(versions) < newest:
        raise SystemExit(f"{folder}: {len(versions)} checkpoints, --average asked for {newest}")
    tensors = [load_file(v / WEIGHTS_FILE) for v in versions]
    save_file({k: (sum(t[k].double() for t in tensors) / len(tensors)).to(v.dtype).contiguous()
               for k, v in tensors[0].items()}, out / WEIGHTS_FILE)
    shutil.copy(versions[0] / CONFIG_FILE, out / CONFIG_FILE)
    return [v.name for v in versions]


def score(args: argparse.Namespace, drafters: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per drafter, the exact T=0 tau on the target's replies to each split's prompts."""
    cfg = load_config(args.config)
    target = resolve_target(cfg, progress=False)
    layer_ids = load_drafter(Path(next(iter(drafters.values())))).target_layer_ids
    taus: dict[str, dict[str, float]] = {name: {} for name in drafters}
    for split in ("train", "held_out"):
        tau_of = HeldOutTau(target, humaneval_rollouts(cfg, target, args.prompts, args.max_tokens, split=split),
                            layer_ids)
        for name, path in drafters.items():
            taus[name][split] = round(tau_of(Path(path)), 4)
    return taus


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="a drafter folder to score (repeatable)")
    p.add_argument("--average", action="append", default=[], metavar="NAME=FOLDER:N",
                   help="score the uniform weight average of the N newest checkpoints in FOLDER (repeatable)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per split")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    bad = [d for d in args.drafter if "=" not in d or not d.split("=", 1)[1]]
    if bad:
        p.error(f"--drafter takes NAME=PATH, got {bad}")
    bad = [a for a in args.average if "=" not in a or not a.rpartition(":")[2].isdigit()]
    if bad or not args.drafter + args.average:
        p.error(f"--average takes NAME=FOLDER:N, got {bad}" if bad else "name a --drafter or an --average")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    drafters = dict(d.split("=", 1) for d in args.drafter)
    averaged: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gap-average-") as scratch:
        for spec in args.average:
            name, rest = spec.split("=", 1)
            folder, _, newest = rest.rpartition(":")
            (Path(scratch) / name).mkdir()
            versions = average_checkpoints(Path(folder), int(newest), Path(scratch) / name)
            averaged[name] = {"folder": folder, "versions": versions}
            drafters[name] = str(Path(scratch) / name)
        start = time.time()
        taus = score(args, drafters)
    result = {"benchmark": "generalisation_gap", "command": " ".join(sys.argv), "prompts_per_split": args.prompts,
              "max_tokens": args.max_tokens,
              "drafters": {name: {**({"averaged": averaged[name]} if name in averaged else {"path": drafters[name]}),
                                  "tau_seen": t["train"], "tau_unseen": t["held_out"],
                                  "seen_minus_unseen": round(t["train"] - t["held_out"], 4)}
                           for name, t in taus.items()},
              "seconds": round(time.time() - start, 1)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
