"""Data-parallel training: 2 ranks train as 1 process does on the same global batch.

Fast: the core loop (offline Draft-OPD and the bootstrap's SFT step) in 2 torch.distributed (gloo)
processes on this machine against 1 process, and resumes across world sizes. Slow: Ray Train's TorchTrainer on a local two-raylet Ray cluster.

Tolerance. The ranks compute the same per-record losses as one process, but the gradient of the mean
is summed in another order (two shares all-reduced instead of one mean), so the gradients differ by
float32 rounding, ~1e-7 relative. AdamW's first steps normalise each gradient entry (m / sqrt(v)), so a
rounding difference moves the update of an entry by about its relative size times lr = 1e-2, and the
differences compound only over a few steps: 1e-5 absolute on weights and losses of order 1 leaves two
orders of magnitude of margin over what we measure (~1e-7) and is far below what a wrong reduction
gives (a mean of per-rank means, or unsummed gradients, moves them by 1e-3 and more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from online_opd.config import OnlineOPDConfig, TrainerConfig, load_config
from online_opd.models.drafters.checkpoint import read_manifest, save_drafter
from online_opd.opd.rollout import greedy_blocks
from online_opd.traces.records import SequenceRecord
from online_opd.train import distributed as dp
from online_opd.train.loop import train
from online_opd.train.opd import opd_step_fn, write_records
from online_opd.train.sequences import TrainSequence, compute_aux_hidden
from online_opd.train.state import STATE_FILE
from serve.offline_opd import train_rank
from serve.pipeline import train_sft
from tests.ray_cluster import ray_head, ray_node
from tests.tiny import greedy_sequences, tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]

TOLERANCE = 1e-5
NUM_STEPS = 4
# 3 records a step: shards of 1 and 2 records, where a mean of per-rank means would weigh them unequally
CFG = TrainerConfig(objective="draft_opd", lr=1e-2, num_steps=NUM_STEPS, sequences_per_step=3,
                    anchors_per_sequence=4, warmup_ratio=0.0, checkpoint_every=2, log_every=1)


def make_sequences() -> list[TrainSequence]:
    """Four target-greedy sequences with their target features."""
    target = tiny_target(seed=1)
    seqs = [TrainSequence(tokens, plen) for tokens, plen in greedy_sequences(target, num=4, length=32)]
    compute_aux_hidden(target, seqs, tiny_drafter(target, seed=2).target_layer_ids, progress=False)
    return seqs


def make_records() -> list[SequenceRecord]:
    """The four sequences with the blocks the initial drafter drafts over them."""
    drafter = tiny_drafter(tiny_target(seed=1), seed=2)
    return [SequenceRecord(f"r{i}", "tiny", "v0", 0.0, 1.0, 0, tuple(s.tokens.tolist()), s.prompt_len,
                           tuple(greedy_blocks(drafter, s))) for i, s in enumerate(make_sequences())]


def run_sft(sequences: list[TrainSequence], run_dir: Path) -> Path:
    """The bootstrap's SFT loop (serve/pipeline.train_sft) on the tiny drafter, with CFG's step and
    half of its blocks narrower than K (every rank draws the same widths)."""
    cfg = OnlineOPDConfig.model_validate(
        {"bootstrap": {**CFG.model_dump(exclude={"objective"}), "narrow_block_share": 0.5}})
    return train_sft(cfg, tiny_drafter(tiny_target(seed=1), seed=2), sequences, run_dir, {}, progress=False)


def run_training(records: list[SequenceRecord], run_dir: Path, *, stop_after: int | None = None) -> int:
    """Draft-OPD on the tiny models from their seeds (resuming from run_dir); with `stop_after`, rank 0
    alone sets the stop event during that step, as a signal to one worker would."""
    target = tiny_target(seed=1)
    drafter = tiny_drafter(target, seed=2)
    generator = torch.Generator().manual_seed(CFG.seed)
    step_fn = opd_step_fn(target, drafter, records, CFG, generator=generator)
    stop = threading.Event()

    def stepping(step: int):
        if stop_after is not None and step + 1 == stop_after and dp.is_main_process():
            stop.set()
        return step_fn(step)

    return train(stepping, drafter, CFG, run_dir, progress=False, generator=generator, stop=stop)


def _rank(rank: int, world_size: int, init_file: str, records: list[SequenceRecord],
          sequences: list[TrainSequence], root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        root_dir = Path(root)
        # rank 1 gets a folder of its own in the first run: it must write nothing there
        assert run_training(records, root_dir / ("dp" if rank == 0 else "dp-rank1")) == NUM_STEPS
        assert run_training(records, root_dir / "dp-half", stop_after=2) == 2
        assert run_training(records, root_dir / "one-then-dp") == NUM_STEPS
        run_sft(sequences, root_dir / "sft-dp")
    finally:
        dist.destroy_process_group()


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / STATE_FILE, weights_only=True)["drafter"]


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_two_gloo_ranks_train_as_one_process_and_resume_across_world_sizes(tmp_path):
    records, sequences = make_records(), make_sequences()
    assert run_training(records, tmp_path / "one") == NUM_STEPS
    assert run_training(records, tmp_path / "one-then-dp", stop_after=2) == 2  # resumed by 2 ranks below
    run_sft(sequences, tmp_path / "sft-one")
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), records, sequences, str(tmp_path)), nprocs=2, join=True)

    one = losses(tmp_path / "one")
    assert len(one) == NUM_STEPS and len(set(one)) == NUM_STEPS  # four different steps, not a constant
    dp_losses = losses(tmp_path / "dp")
    assert len(dp_losses) == NUM_STEPS  # rank 0 alone logged
    assert max(abs(a - b) for a, b in zip(one, dp_losses)) < TOLERANCE
    assert max_weight_diff(tmp_path / "one", tmp_path / "dp") < TOLERANCE
    assert not (tmp_path / "dp-rank1").exists()  # rank 1 wrote nothing

    # 1 process resumes what 2 ranks saved at step 2 (stopped there by a stop seen on rank 0 only) ...
    assert losses(tmp_path / "dp-half") == dp_losses[:2]
    assert run_training(records, tmp_path / "dp-half") == NUM_STEPS
    assert max(abs(a - b) for a, b in zip(one, losses(tmp_path / "dp-half"))) < TOLERANCE
    assert max_weight_diff(tmp_path / "one", tmp_path / "dp-half") < TOLERANCE
    # ... and 2 ranks resume what 1 process saved at step 2
    assert losses(tmp_path / "one-then-dp")[:2] == one[:2]
    assert max(abs(a - b) for a, b in zip(one, losses(tmp_path / "one-then-dp"))) < TOLERANCE
    assert max_weight_diff(tmp_path / "one", tmp_path / "one-then-dp") < TOLERANCE
    # the bootstrap's SFT step too; rank 0 saved the drafter, marked with the number of workers
    sft_one = losses(tmp_path / "sft-one")
    assert max(abs(a - b) for a, b in zip(sft_one, losses(tmp_path / "sft-dp"))) < TOLERANCE
    assert len(losses(tmp_path / "sft-dp")) == NUM_STEPS
    assert max_weight_diff(tmp_path / "sft-one", tmp_path / "sft-dp") < TOLERANCE
    assert read_manifest(tmp_path / "sft-dp" / "drafter")["metrics"]["num_workers"] == 2


def test_shards_cover_the_global_batch_in_order_and_one_process_keeps_the_plain_mean():
    terms = [torch.tensor(x) for x in (0.1, 0.7, 0.2)]
    assert dp.shard_bounds(3) == (0, 3) and dp.gather(["a", "b"]) == ["a", "b"]
    assert torch.equal(dp.share_of_mean(terms, 3), torch.stack(terms).mean())  # bit for bit


DRIVER = """
import json, sys, time
from pathlib import Path
import ray
from online_opd.config import load_config
from serve.trainer_dp import train_on_records_dp
cfg = load_config(sys.argv[1], json.loads(sys.argv[2]))
ray.init(address=cfg.trainer.ray_address)
deadline = time.monotonic() + 120
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
    time.sleep(1)  # the second raylet may still be joining
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
result = train_on_records_dp(cfg, *map(Path, sys.argv[3:6]))
print("RESULT", json.dumps({**result, "cluster_node_ids": nodes}))
"""


@pytest.mark.slow
def test_ray_train_on_two_raylets_trains_as_one_worker_and_its_state_resumes(tmp_path):
    target = tiny_target(seed=1)
    target.model.save_pretrained(tmp_path / "target")
    save_drafter(tiny_drafter(target, seed=2), tmp_path / "init")
    records = make_records()
    write_records(tmp_path / "records" / "r.jsonl", records)
    overrides = [f"model.target={tmp_path / 'target'}", "trainer.objective=draft_opd", "trainer.lr=1e-2",
                 "trainer.warmup_ratio=0", "trainer.sequences_per_step=3", "trainer.anchors_per_sequence=4",
                 f"trainer.num_steps={NUM_STEPS}", "trainer.checkpoint_every=2", "trainer.num_threads=1"]
    tiny = ROOT / "configs" / "test-tiny.yaml"
    train_rank(load_config(tiny, overrides), records, tmp_path / "init", tmp_path / "one", progress=False)

    work = Path(tempfile.mkdtemp(prefix="rdp", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(work / "home")  # no saved Ray token: a cluster without authentication
    slot = {"dp_slot": 1}  # one per raylet, one per worker: the two workers land on different nodes
    with ray_head(env, num_cpus=1, resources=slot) as address, ray_node(env, address, num_cpus=1, resources=slot):
        dp_overrides = [*overrides, "trainer.num_workers=2", f"trainer.ray_address={address}",
                        "trainer.worker_resources={dp_slot: 1}"]
        run = subprocess.run([sys.executable, "-c", DRIVER, str(tiny), json.dumps(dp_overrides),
                              str(tmp_path / "records"), str(tmp_path / "init"), str(tmp_path / "dp")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.split("RESULT", 1)[1])
    assert result["num_workers"] == 2 and len(result["cluster_node_ids"]) == 2
    assert sorted(result["worker_node_ids"]) == sorted(result["cluster_node_ids"])  # one rank per raylet
    assert read_manifest(Path(result["drafter"]))["metrics"]["num_workers"] == 2

    one, dp_losses = losses(tmp_path / "one"), losses(tmp_path / "dp")
    assert len(one) == len(dp_losses) == NUM_STEPS  # rank 0 alone logged
    assert max(abs(a - b) for a, b in zip(one, dp_losses)) < TOLERANCE
    assert max_weight_diff(tmp_path / "one", tmp_path / "dp") < TOLERANCE

    # the state rank 0 wrote resumes in one process exactly as the one-worker run's own state does
    longer = load_config(tiny, [*overrides, f"trainer.num_steps={NUM_STEPS + 2}"])
    for name in ("one", "dp"):
        train_rank(longer, records, tmp_path / "init", tmp_path / name, progress=False)
    assert len(losses(tmp_path / "dp")) == NUM_STEPS + 2
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "one"), losses(tmp_path / "dp"))) < TOLERANCE
    assert max_weight_diff(tmp_path / "one", tmp_path / "dp") < TOLERANCE


@pytest.mark.slow
def test_bootstrap_on_two_local_ray_workers_trains_as_one_worker(tmp_path):
    """`online-opd bootstrap` with bootstrap.num_workers=2 on a local Ray (the embedded SmolLM2 target,
    text only): the same curve as one worker. Relative tolerance here: the real model's losses are ~20."""
    overrides = ["bootstrap.rollouts=false", "bootstrap.text_conversations=6", "bootstrap.text_max_tokens=48",
                 f"bootstrap.num_steps={NUM_STEPS}", "bootstrap.sequences_per_step=3", "bootstrap.warmup_ratio=0",
                 "bootstrap.anchors_per_sequence=8", "bootstrap.num_threads=1", "bootstrap.checkpoint_every=2"]

    def bootstrap(run_dir: Path, *extra: str) -> None:
        command = [sys.executable, "-m", "serve.cli", "--no-progress", "bootstrap", "-c",
                   str(ROOT / "configs" / "test-tiny.yaml"), "--run-dir", str(run_dir), *overrides, *extra]
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]

    bootstrap(tmp_path / "one")
    (tmp_path / "dp").mkdir()  # the same text features, computed once
    (tmp_path / "dp" / "text_sequences.safetensors").write_bytes(
        (tmp_path / "one" / "text_sequences.safetensors").read_bytes())
    # with a time budget that fits: the step time measured on a copy of the drafter (its own generator)
    # leaves the curve as it was, and the workers get the budget's deadline
    bootstrap(tmp_path / "dp", "bootstrap.num_workers=2", "bootstrap.time_budget_s=3600")
    one, many = losses(tmp_path / "one"), losses(tmp_path / "dp")
    assert len(one) == len(many) == NUM_STEPS
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, many)), (one, many)
    metrics = read_manifest(tmp_path / "dp" / "drafter")["metrics"]
    assert metrics["num_workers"] == 2 and metrics["budget"]["num_steps"] == NUM_STEPS
