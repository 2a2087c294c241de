"""What a reduced draft vocabulary (drafter.draft_vocab_size) buys and costs, on a bootstrap run's data.

For each size: the share of the target's tokens it covers on held-out sequences (the vocabulary is
chosen on one half of the run's sequences and measured on the other: a token outside it can never
be drafted), the SFT step time (forward + backward, `bootstrap.sequences_per_step` sequences of
`anchors_per_sequence` anchors) and the drafting forward time of one K-token block per anchor, each
against the full vocabulary in the same process, alternating, median of --repeats.

    python benchmarks/draft_vocab.py --run-dir runs/bootstrap --sizes 4096 8192 16384
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch

from online_opd.config import load_config
from online_opd.models.drafters.factory import new_drafter
from online_opd.models.drafters.vocab import count_target_tokens, coverage, select_draft_vocab
from online_opd.models.target_model import TargetModel
from online_opd.train.sequences import load_sequences
from online_opd.train.sft import sample_anchors, sft_loss
from serve.launcher import emit_result
from serve.pipeline import load_tokenizer, resolve_target

logger = logging.getLogger("draft_vocab")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--run-dir", type=Path, required=True, help="a bootstrap run (sequences.safetensors)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    target = resolve_target(cfg)
    target_model = TargetModel.from_pretrained(target, dtype=torch.float32)
    tokenizer = load_tokenizer(target)
    sequences = [s for name in ("sequences.safetensors", "text_sequences.safetensors")
                 if (args.run_dir / name).exists()
                 for s in load_sequences(args.run_dir / name)]
    if len(sequences) < 8:
        raise SystemExit(f"{args.run_dir}: needs a bootstrap run's sequences.safetensors")
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(sequences), generator=gen).tolist()
    chosen_on = [sequences[i] for i in order[: len(order) // 2]]
    measured_on = [sequences[i] for i in order[len(order) // 2:]]
    vocab = target_model.config.vocab_size
    train_counts, test_counts = count_target_tokens(chosen_on, vocab), count_target_tokens(measured_on, vocab)

    def build(size: int | None):
        dcfg = cfg.drafter.model_copy(update={"draft_vocab_size": size})
        drafter = new_drafter(dcfg, target_model.config, tokenizer, target_model)
        drafter.attach_target(target_model.embed_weight, target_model.lm_head_weight)
        if size is not None:
            drafter.set_draft_vocab(select_draft_vocab(train_counts, size, required=[tokenizer.eos_token_id]))
        return drafter

    bcfg = cfg.bootstrap
    batch = [sequences[i] for i in torch.randint(len(sequences), (bcfg.sequences_per_step,), generator=gen)]
    anchors = [sample_anchors(s.prompt_len, s.num_tokens, bcfg.anchors_per_sequence, gen) for s in batch]

    def sft_step(drafter) -> None:
        drafter.zero_grad(set_to_none=True)
        loss = torch.stack([sft_loss(drafter, s, a, decay=bcfg.sft_position_decay)[0]
                            for s, a in zip(batch, anchors)]).mean()
        loss.backward()

    def draft(drafter) -> None:
        with torch.no_grad():
            for s, a in zip(batch, anchors):
                drafter.propose(s.aux_hidden[: int(a.max())], a, s.tokens[a], s.tokens)

    arms = {"full": build(None), **{str(size): build(size) for size in args.sizes}}
    times: dict[str, dict[str, list[float]]] = {name: {"sft_step_s": [], "draft_s": []} for name in arms}
    for _ in range(args.repeats):
        for name, drafter in arms.items():  # alternating: drift of the machine hits every arm alike
            times[name]["sft_step_s"].append(_timed(lambda: sft_step(drafter)))
            times[name]["draft_s"].append(_timed(lambda: draft(drafter)))
    result = {"run_dir": str(args.run_dir), "num_sequences": len(sequences), "repeats": args.repeats,
              "threads": torch.get_num_threads(), "sequences_per_step": bcfg.sequences_per_step,
              "anchors_per_sequence": bcfg.anchors_per_sequence, "block_size": cfg.drafter.block_size,
              "held_out_target_tokens": int(test_counts.sum()), "arms": {}}
    full = {k: statistics.median(v) for k, v in times["full"].items()}
    for name, drafter in arms.items():
        med = {k: statistics.median(v) for k, v in times[name].items()}
        arm = {**{k: round(v, 4) for k, v in med.items()},
               **{f"{k}_speedup": round(full[k] / v, 3) for k, v in med.items()}}
        if name != "full":
            ids = drafter.draft_token_ids()
            arm["held_out_coverage"] = round(coverage(test_counts, ids), 4)
            arm["chosen_on_coverage"] = round(coverage(train_counts, ids), 4)
        result["arms"][name] = arm
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
