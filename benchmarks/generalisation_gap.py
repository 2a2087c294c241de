"""Seen against unseen prompts: the exact T=0 tau of drafters on the target's replies to HumanEval prompts the
domain-shift traffic trained on (train split) and to prompts it never saw (held_out split): a drafter whose
held-out tau stalls while it fits the traffic (seen >> unseen) is limited by what transfers from that traffic;
one that fits neither (seen ~ unseen) by what it can learn at all.
The online gate keeps about 15% of the traffic's prompts out of training (by prompt prefix), so some "seen"
prompts were only served, never trained on: the gap it prints is a lower bound.

    python benchmarks/generalisation_gap.py --drafter static=runs/bootstrap/drafter \\
        --drafter s1=runs/b38/ds30-s1/auto/registry/versions/v0047 --out runs/gap.json

Prints JSON: per drafter, tau on each split and seen - unseen.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from domain_shift import ROOT, HeldOutTau, humaneval_rollouts, load_config, load_drafter  # noqa: E402

from serve.pipeline import resolve_target  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                   help="a drafter folder to score (repeatable)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per split")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    bad = [d for d in args.drafter if "=" not in d or not d.split("=", 1)[1]]
    if bad:
        p.error(f"--drafter takes NAME=PATH, got {bad}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    drafters = dict(d.split("=", 1) for d in args.drafter)
    cfg = load_config(args.config)
    target = resolve_target(cfg, progress=False)
    layer_ids = load_drafter(Path(next(iter(drafters.values())))).target_layer_ids
    start = time.time()
    taus: dict[str, dict[str, float]] = {name: {} for name in drafters}
    for split in ("train", "held_out"):
        tau_of = HeldOutTau(target, humaneval_rollouts(cfg, target, args.prompts, args.max_tokens, split=split),
                            layer_ids)
        for name, path in drafters.items():
            taus[name][split] = round(tau_of(Path(path)), 4)
    result = {"benchmark": "generalisation_gap", "prompts_per_split": args.prompts, "max_tokens": args.max_tokens,
              "drafters": {name: {"path": drafters[name], "tau_seen": t["train"], "tau_unseen": t["held_out"],
                                  "seen_minus_unseen": round(t["train"] - t["held_out"], 4)}
                           for name, t in taus.items()},
              "seconds": round(time.time() - start, 1)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
