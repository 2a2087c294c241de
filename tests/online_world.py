"""The online trainer's test world, shared by its test modules: a saved tiny target, its drafter, 16 greedy
requests served with that drafter, and a buffer, registry and state folder to run a trainer on."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from online_opd.config import OnlineOPDConfig
from online_opd.opd.specdec import speculative_generate
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.buffer import SegmentWriter
from tests.tiny import tiny_drafter, tiny_target

K = 4
HELD_OUT = 0.3
SPLIT_PREFIX = 4  # the prompts are 4 tokens long: each record is keyed by its whole prompt


def make_world(root: Path) -> dict:
    """A saved tiny target (``root``/target), its drafter, and 16 greedy requests served with that drafter
    (the records of drafter version v0001). Build it once per test module (a module-scoped fixture)."""
    target = tiny_target(seed=1)
    target.model.save_pretrained(root / "target")
    drafter = tiny_drafter(target, block_size=K, seed=2)
    records = []
    for i in range(16):
        prompt = torch.randint(1, 60, (4,), generator=torch.Generator().manual_seed(i)).tolist()
        result = speculative_generate(target, drafter, prompt, max_new_tokens=24)
        records.append(result.to_record(record_id=f"req-{i}", model_id="tiny", drafter_version="v0001",
                                        temperature=0.0))
    return {"root": root, "target": target, "drafter": drafter, "records": records}


def online_config(**online) -> OnlineOPDConfig:
    """A config for the tiny world: small steps, a gate every 3 steps, ``online`` fields overridden."""
    return OnlineOPDConfig.model_validate({
        "trainer": {"lr": 3e-3, "warmup_ratio": 0.0, "sequences_per_step": 2, "anchors_per_sequence": 4},
        "gate": {"every_steps": 3, "min_records": 2, "max_records": 8, "held_out_fraction": HELD_OUT,
                 "split_prefix_tokens": SPLIT_PREFIX},
        "online": {"settle_s": 0.0, "poll_s": 0.05, "min_records": 2, "checkpoint_every": 2, **online},
    })


def setup_run(world: dict, tmp_path: Path, records=None) -> dict:
    """A buffer holding `records` (default: the world's) in two segments and a registry serving v0001;
    the paths an OnlineTrainer (or the trainer actor) takes."""
    records = world["records"] if records is None else records
    writer = SegmentWriter(tmp_path / "buffer", writer_id="test")
    writer.write(records[: len(records) // 2])
    writer.write(records[len(records) // 2:])
    registry = DrafterRegistry(tmp_path / "registry")
    registry.promote(registry.publish(world["drafter"]).version, reason="bootstrap")
    return {"target_path": world["root"] / "target", "buffer_dir": tmp_path / "buffer",
            "registry_dir": tmp_path / "registry", "state_dir": tmp_path / "state"}


def wait_for_stats(handle, condition, timeout: float = 120.0) -> dict:
    """The trainer actor's stats once ``condition(stats)`` holds; AssertionError with the last ones after
    ``timeout`` seconds."""
    from serve.trainer_actor import trainer_stats

    deadline, stats = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        stats = trainer_stats(handle, timeout=5)
        if stats is not None and condition(stats):
            return stats
        time.sleep(0.3)
    raise AssertionError(f"trainer actor did not get there in {timeout}s; last stats: {stats}")
