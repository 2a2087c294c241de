"""Does the drafter know when it is right? Calibration of its confidence, and what trimming blocks by it would pay.

On this CPU verification is compute-bound: every drafted token a step verifies costs about the same
whatever its fate, so at batch size 8 or 32 a block pays only where its tokens are likely accepted
(the break-even tau of K = 1 at b = 32 is about 1.75). The policy chooses one K per batch size from the
drafter's average acceptance; a drafter that is right on some tokens and wrong on most loses
everywhere. This measures whether its own confidence (the top softmax probability of each drafted
position, which vLLM's proposer computes anyway) separates the two, offline and exactly as served at
T = 0 (`rollout.greedy_blocks` semantics: the proposals equal vLLM's per the parity tests):

1. Held-out greedy target rollouts (ShareGPT prompts the bootstrap never saw, cached under --out)
   with their target features; at every anchor the drafter's block of K tokens, each position's
   confidence, and whether the target's tokens match.
2. Calibration (2-fold: fitted on one half of the sequences, applied to the other): per position k
   and confidence bin, the share of blocks whose token k is accepted given tokens 1..k-1 were.
3. Trimming at threshold r: each block keeps its first L tokens, L = the most whose estimated
   probability of all being accepted (the product of the calibrated rates) exceeds r. The greedy
   walk (anchor a -> a + accepted + 1) is replayed with the trimmed blocks: drafted and accepted
   tokens per step.
4. Goodput against plain decoding at batch sizes b from a step-cost model t = c0 + c1 b + c2 K +
   c3 n (n: draft tokens verified in the step; the coefficients a server fitted on this machine,
   --costs), for untrimmed K-blocks and for trimmed ones at the r that is best for each b and at
   r_b = c3 b / t(b, 0) (the marginal rule a server could apply).

    python benchmarks/draft_confidence.py --drafter runs/bootstrap/drafter --out runs/draft_confidence \
        --json-out benchmarks/results/draft_confidence.json

Prints JSON. Offline figures: what a server trimming blocks would gain, before building it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

import torch
from objectives import held_out_sequences  # sibling scripts: benchmarks/ leads sys.path
from provenance import print_result

from online_opd.config import load_config
from serve.pipeline import load_serving_drafter, resolve_target

BINS = 10
#: the bootstrapped drafter's server on this machine, 2026-12-03 (benchmarks/speculation_policy.py,
#: variant boot): t = c0 + c1 b + c2 K + c3 b K fitted over its measured step costs
DEFAULT_COSTS = (0.03095, 0.000562, -0.00019, 0.00101)


@torch.no_grad()
def anchor_table(drafter, seq, num_draft_tokens: int, chunk: int = 256) -> dict[str, torch.Tensor]:
    """At every anchor a of the output: drafts [A, K'], confidence [A, K'] (top softmax probability),
    match [A, K'] (the target's token at a + k equals the draft; False beyond the sequence)."""
    first, last = seq.prompt_len, seq.num_tokens - 1
    anchors = torch.arange(first, last)
    ids = drafter.draft_token_ids()
    drafts, confs = [], []
    for lo in range(0, len(anchors), chunk):
        part = anchors[lo:lo + chunk]
        logits = drafter(seq.aux_hidden[: int(part.max())], part, seq.tokens[part], seq.tokens,
                         num_draft_tokens=num_draft_tokens, draft_space=ids is not None).float()
        conf, index = logits.softmax(-1).max(-1)
        drafts.append(index if ids is None else ids[index])
        confs.append(conf)
    drafts, confs = torch.cat(drafts), torch.cat(confs)
    padded = torch.cat([seq.tokens, torch.full((num_draft_tokens,), -1, dtype=seq.tokens.dtype)])
    truth = torch.stack([padded[anchors + 1 + k] for k in range(num_draft_tokens)], dim=1)
    return {"drafts": drafts, "confidence": confs, "match": drafts == truth}


def fit_calibration(tables: list[dict]) -> torch.Tensor:
    """[K, BINS] P(token k accepted | tokens < k accepted, its confidence in the bin), with one
    pseudo-observation at the bin's centre (bins without data return their confidence)."""
    width = tables[0]["match"].shape[1]
    hits, seen = torch.zeros(width, BINS), torch.zeros(width, BINS)
    for t in tables:
        reached = torch.ones(t["match"].shape[0], dtype=torch.bool)
        for k in range(width):
            b = bin_of(t["confidence"][:, k])
            seen[k].index_add_(0, b[reached], torch.ones(int(reached.sum())))
            hits[k].index_add_(0, b[reached], t["match"][reached, k].float())
            reached = reached & t["match"][:, k]
    centre = (torch.arange(BINS) + 0.5) / BINS
    return (hits + centre) / (seen + 1.0)


def bin_of(conf: torch.Tensor) -> torch.Tensor:
    return (conf * BINS).long().clamp(0, BINS - 1)


def walk(table: dict, calibration: torch.Tensor | None, threshold: float) -> dict[str, int]:
    """The greedy walk with trimmed blocks: steps, drafted and accepted tokens. ``calibration`` None:
    untrimmed."""
    match, conf = table["match"], table["confidence"]
    num, width = match.shape
    if calibration is None:
        keep = torch.full((num,), width)
    else:
        est = calibration[torch.arange(width)[None, :].expand(num, -1), bin_of(conf)].cumprod(1)
        keep = (est > threshold).sum(1)  # est is non-increasing: the leading positions above r
    run = match.long().cumprod(1)  # leading matches
    steps = drafted = accepted = 0
    a = 0
    while a < num:
        L = int(keep[a])
        r = int(run[a, :L].sum()) if L else 0
        steps, drafted, accepted = steps + 1, drafted + L, accepted + r
        a += r + 1
    return {"steps": steps, "drafted": drafted, "accepted": accepted}


def sum_walks(walks: list[dict]) -> dict[str, float]:
    total = {k: sum(w[k] for w in walks) for k in ("steps", "drafted", "accepted")}
    steps = max(total["steps"], 1)
    return {**total, "drafted_per_step": total["drafted"] / steps, "tau": 1.0 + total["accepted"] / steps}


def goodput_ratio(figures: dict, b: int, k: int, costs: tuple[float, ...]) -> float:
    """Output tokens/s against plain decoding at batch size b (every request a step of these figures)."""
    c0, c1, c2, c3 = costs
    plain = c0 + c1 * b
    spec = plain + (c2 * k if figures["drafted_per_step"] > 0 else 0.0) + c3 * b * figures["drafted_per_step"]
    return figures["tau"] * plain / spec


def calibration_rows(tables: list[dict]) -> list[dict]:
    """Per position: blocks reaching it, and per bin (count, mean confidence, acceptance)."""
    width = tables[0]["match"].shape[1]
    rows = []
    for k in range(width):
        conf, hit = [], []
        for t in tables:
            reached = t["match"][:, :k].all(1)
            conf.append(t["confidence"][reached, k])
            hit.append(t["match"][reached, k])
        conf, hit = torch.cat(conf), torch.cat(hit).float()
        bins = []
        for i in range(BINS):
            sel = bin_of(conf) == i
            if sel.any():
                bins.append({"bin": [i / BINS, (i + 1) / BINS], "count": int(sel.sum()),
                             "mean_confidence": round(float(conf[sel].mean()), 4),
                             "accepted": round(float(hit[sel].mean()), 4)})
        rows.append({"position": k + 1, "reaching": int(conf.numel()),
                     "accepted": round(float(hit.mean()), 4) if conf.numel() else None, "bins": bins})
    return rows


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_config(args.config, args.overrides)
    target = resolve_target(cfg)
    drafter, _ = load_serving_drafter(args.drafter, target)
    drafter.eval()
    held = held_out_sequences(cfg, target, args.out / "held_out", args.num_held_out, drafter.target_layer_ids)
    halves = (held[0::2], held[1::2])
    result = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "cpu_count": os.cpu_count(), "drafter": str(args.drafter), "num_held_out_sequences": len(held),
              "costs": {"c0": args.costs[0], "c1_b": args.costs[1], "c2_k": args.costs[2],
                        "c3_per_draft_token": args.costs[3]}, "by_block_size": {}}
    thresholds = [round(0.05 * i, 2) for i in range(1, 20)]
    for k in args.block_sizes:
        tables = [[anchor_table(drafter, seq, k) for seq in half] for half in halves]
        calibrations = [fit_calibration(tables[1]), fit_calibration(tables[0])]  # each half by the other
        untrimmed = sum_walks([walk(t, None, 0.0) for half in tables for t in half])
        trimmed = {r: sum_walks([walk(t, calibrations[h], r) for h, half in enumerate(tables) for t in half])
                   for r in thresholds}
        per_b = {}
        for b in args.batch_sizes:
            plain = args.costs[0] + args.costs[1] * b
            rule = min(max(args.costs[3] * b / plain, thresholds[0]), thresholds[-1])
            rule = min(thresholds, key=lambda r: abs(r - rule))
            best = max(thresholds, key=lambda r: goodput_ratio(trimmed[r], b, k, args.costs))
            per_b[str(b)] = {"untrimmed": round(goodput_ratio(untrimmed, b, k, args.costs), 4),
                             "trimmed_best": round(goodput_ratio(trimmed[best], b, k, args.costs), 4),
                             "best_threshold": best,
                             "trimmed_rule": round(goodput_ratio(trimmed[rule], b, k, args.costs), 4),
                             "rule_threshold": rule}
        result["by_block_size"][str(k)] = {
            "untrimmed": {key: round(v, 4) for key, v in untrimmed.items()},
            "trimmed": {str(r): {key: round(v, 4) for key, v in f.items()} for r, f in trimmed.items()},
            "goodput_vs_plain": per_b,
            "calibration": calibration_rows([t for half in tables for t in half]),
        }
        logging.info("K=%d: untrimmed tau %.4f; goodput vs plain %s", k, untrimmed["tau"], per_b)
    print_result(result, args.json_out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--drafter", type=Path, default=Path("runs/bootstrap/drafter"))
    parser.add_argument("--out", type=Path, default=Path("runs/draft_confidence"), help="held-out rollout cache")
    parser.add_argument("--num-held-out", type=int, default=48, help="held-out prompts (greedy target rollouts)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[1, 4], help="K' drafted per block")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--costs", type=float, nargs=4, default=DEFAULT_COSTS, metavar=("C0", "C1", "C2", "C3"),
                        help="step cost t = C0 + C1 b + C2 K + C3 n seconds (n: draft tokens verified)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    return parser.parse_args()


if __name__ == "__main__":
    main()
