"""Data-parallel offline Draft-OPD: 1 worker against N Ray Train workers at equal global batch.

Records: speculative decoding (online_opd/opd/specdec.py, the server's T = 0 blocks exactly) of a fresh
drafter over ``--num-prompts`` train-split prompts with the config's target (the embedded SmolLM2-135M
by default). The same drafter, records and config then train once in this process
(``serve.offline_opd.train_rank``) and once on ``--workers`` Ray Train workers on a local Ray
(``serve.trainer_dp``, gloo); each step replays ``trainer.sequences_per_step`` records in both, split
among the workers in the second. Prints one JSON object: both loss curves, their largest difference,
the final weights' largest difference, and the median step time of each.

    python benchmarks/dp_train.py -c configs/test-tiny.yaml --workers 2 trainer.num_steps=8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from online_opd.config import apply_overrides, load_config
from online_opd.data import load_prompts
from online_opd.models.drafters.checkpoint import save_drafter
from online_opd.models.target_model import TargetModel
from online_opd.opd.specdec import speculative_generate
from online_opd.train.opd import write_records
from online_opd.train.state import STATE_FILE
from serve.engine import chat_prompt_ids
from serve.offline_opd import read_usable_records, train_rank
from serve.pipeline import fresh_drafter, load_tokenizer, resolve_target
from serve.trainer_dp import train_on_records_dp

DEFAULTS = ["trainer.objective=draft_opd", "trainer.num_steps=8", "trainer.sequences_per_step=4",
            "trainer.anchors_per_sequence=8", "trainer.lr=1e-3", "trainer.warmup_ratio=0",
            "trainer.checkpoint_every=1000", "trainer.num_threads=1", "trainer.log_every=1"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default="configs/test-tiny.yaml")
    parser.add_argument("--workers", type=int, default=2, help="data-parallel workers to compare with 1")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts decoded into records")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens decoded per prompt")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (after the defaults above)")
    return parser.parse_args()


def make_records(cfg, work: Path, num_prompts: int, max_new_tokens: int) -> Path:
    """A fresh drafter saved to work/init and its speculative-decoding records in work/records."""
    target_path = resolve_target(cfg, progress=False)
    target = TargetModel.from_pretrained(target_path, dtype=torch.float32)
    tokenizer = load_tokenizer(target_path)
    drafter, _ = fresh_drafter(cfg, target, tokenizer)
    save_drafter(drafter, work / "init")
    prompts = load_prompts(cfg.data.prompts, num_prompts=num_prompts, seed=cfg.data.seed, split="train",
                           held_out_fraction=cfg.data.held_out_fraction)
    records = []
    for i, ids in enumerate(chat_prompt_ids(tokenizer, [p.messages for p in prompts])):
        result = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens)
        records.append(result.to_record(record_id=f"p{i}", model_id=target_path.name, drafter_version="init",
                                        temperature=0.0))
    write_records(work / "records" / "records.jsonl", records)
    return work / "records"


def curve(run_dir: Path) -> tuple[list[float], float]:
    """(loss per step, median step seconds) from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], statistics.median(r["step_s"] for r in rows)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config, [*DEFAULTS, *args.overrides])
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dp_train"))
    records_dir = make_records(cfg, work, args.num_prompts, args.max_new_tokens)
    records = read_usable_records(records_dir)

    start = time.perf_counter()
    train_rank(cfg, records, work / "init", work / "one", progress=False)
    one_wall = time.perf_counter() - start
    start = time.perf_counter()
    train_on_records_dp(apply_overrides(cfg, [f"trainer.num_workers={args.workers}"]), records_dir,
                        work / "init", work / "dp")
    dp_wall = time.perf_counter() - start

    (one, one_step_s), (many, many_step_s) = curve(work / "one"), curve(work / "dp")
    w_one, w_dp = (torch.load(work / d / STATE_FILE, weights_only=True)["drafter"] for d in ("one", "dp"))
    print(json.dumps({
        "target": str(resolve_target(cfg, progress=False).name), "num_records": len(records),
        "global_batch_records": cfg.trainer.sequences_per_step,
        "anchors_per_sequence": cfg.trainer.anchors_per_sequence, "num_steps": cfg.trainer.num_steps,
        "workers": {"1": {"loss": one, "median_step_s": round(one_step_s, 4), "wall_s": round(one_wall, 1)},
                    str(args.workers): {"loss": many, "median_step_s": round(many_step_s, 4),
                                        "wall_s": round(dp_wall, 1)}},
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(one, many)),
        "max_abs_weight_diff": max(float((w_one[k] - w_dp[k]).abs().max()) for k in w_one),
        "torch_threads_per_worker": cfg.trainer.num_threads,
    }, indent=2))


if __name__ == "__main__":
    main()
