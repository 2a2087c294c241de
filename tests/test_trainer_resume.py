"""Trainers resume and follow the registry: the sampling generator survives a save (online and
offline loops), and the online trainer re-syncs to CURRENT after a rollback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from online_opd.config import OnlineOPDConfig, TrainerConfig
from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.buffer import SegmentWriter
from online_opd.train.loop import train
from online_opd.train.online import OnlineTrainer
from tests.online_world import make_world
from tests.tiny import tiny_drafter


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tests/online_world.py's world (a saved tiny target, a drafter, 16 greedy requests served with it)."""
    return make_world(tmp_path_factory.mktemp("resume"))


def _config(**online) -> OnlineOPDConfig:
    return OnlineOPDConfig.model_validate({
        "trainer": {"lr": 3e-3, "warmup_ratio": 0.0, "sequences_per_step": 3, "anchors_per_sequence": 4},
        "gate": {"every_steps": 2, "min_records": 2, "max_records": 8, "held_out_fraction": 0.3, "margin": -1.0},
        "online": {"settle_s": 0.0, "poll_s": 0.05, "min_records": 2, **online},
    })


def _paths(world, tmp_path: Path, state: str = "state") -> dict:
    """The world's records in one buffer segment, a registry serving v0001 (made once per tmp_path)."""
    buffer = tmp_path / "buffer"
    if not buffer.exists():
        SegmentWriter(buffer, writer_id="test").write(world["records"])
        registry = DrafterRegistry(tmp_path / "registry")
        registry.promote(registry.publish(world["drafter"]).version, reason="bootstrap")
    return {"target_path": world["root"] / "target", "buffer_dir": buffer, "registry_dir": tmp_path / "registry",
            "state_dir": tmp_path / state}


def _draw(trainer: OnlineTrainer, times: int) -> list[list[str]]:
    return [[r.record_id for r in trainer.pools.sample(trainer.generator)] for _ in range(times)]


def test_resumed_online_trainer_samples_what_an_uninterrupted_one_would(world, tmp_path):
    cfg = _config(fresh_fraction=0.0)  # every pick is drawn with the generator
    whole = OnlineTrainer(cfg, **_paths(world, tmp_path, "whole"))
    whole.poll()
    expected = _draw(whole, 4)

    first = OnlineTrainer(cfg, **_paths(world, tmp_path, "split"))
    first.poll()
    assert _draw(first, 2) == expected[:2]
    first.save()
    resumed = OnlineTrainer(cfg, **_paths(world, tmp_path, "split"))
    assert [r.record_id for r in resumed.pools.window] == [r.record_id for r in first.pools.window]
    assert _draw(resumed, 2) == expected[2:]

    restarted = OnlineTrainer(cfg, **_paths(world, tmp_path, "fresh-start"))  # the generator from its seed
    restarted.poll()
    assert _draw(restarted, 2) != expected[2:]


def test_offline_train_resumes_the_step_functions_generator(tmp_path):
    drafter = tiny_drafter(seed=3)
    cfg = TrainerConfig(num_steps=6, checkpoint_every=1, warmup_ratio=0.0, lr=1e-3)

    def run(run_dir: Path, num_steps: int) -> list[int]:
        generator = torch.Generator().manual_seed(cfg.seed)
        picks: list[int] = []

        def step_fn(_step: int):
            picks.append(int(torch.randint(1000, (1,), generator=generator)))
            loss = sum((p.float() ** 2).mean() for p in drafter.parameters() if p.requires_grad)
            return loss, {}

        train(step_fn, drafter, cfg.model_copy(update={"num_steps": num_steps}), run_dir, progress=False,
              generator=generator)
        return picks

    whole = run(tmp_path / "whole", 6)
    assert run(tmp_path / "split", 3) == whole[:3]
    assert run(tmp_path / "split", 6) == whole[3:]  # resumed at step 3, drawing on from there


def test_online_trainer_resyncs_to_current_after_a_rollback(world, tmp_path):
    paths = _paths(world, tmp_path)
    registry = DrafterRegistry(paths["registry_dir"])
    trainer = OnlineTrainer(_config(), **paths)
    assert trainer.sync_with_registry() is False  # it started from CURRENT
    trainer.poll()
    trainer.step()
    trainer.step()
    summary = trainer.gate()  # margin -1: promoted, and CURRENT is the trainer's own weights now
    assert summary["status"] == "promoted" and trainer.stats()["trained_from"] == summary["version"]
    assert trainer.sync_with_registry() is False
    trainer.step()
    assert trainer.optimizer.state  # AdamW moments from three steps

    registry.rollback("live check failed", expected_current=summary["version"])
    assert trainer.sync_with_registry() is True
    served = load_drafter(registry.path("v0001")).state_dict()
    weights = trainer.drafter.state_dict()
    assert all(torch.equal(weights[k], served[k]) for k in served)
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0
    assert trainer.average.num_updates == 0  # the weight average starts over from the served weights too
    assert all(torch.equal(v, served[k]) for k, v in trainer.average.average.items())
    stats = trainer.stats()
    assert stats["trained_from"] == "v0001" and stats["resyncs"] == 1
    assert trainer.sync_with_registry() is False
    trainer.step()  # training goes on from the served weights, with the new optimizer
    assert any(not torch.equal(trainer.drafter.state_dict()[k], served[k]) for k in served)
