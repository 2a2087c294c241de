"""The online trainer over 2 ranks trains as 1 process does (train/online_dp.py).

Two torch.distributed (gloo) processes: rank 0 an OnlineTrainer running ``run_main`` on a real buffer
and registry, rank 1 a ``Replica``; against one OnlineTrainer stepping on the same buffer. Both resume
from a state one step in, so rank 0's weights and AdamW moments are not the registry's drafter's and
reach rank 1 only through ``broadcast_state``. Three
records a step, so the shards hold 1 and 2 records (a mean of per-rank means would weigh them
unequally). Tolerance 1e-5, as in tests/test_dp_train.py: the gradients are summed in another order,
~1e-7 relative, far below what a wrong reduction moves (1e-3 and more).

Halfway, the registry serves another drafter: rank 0 reloads it and the replicas differ (their
digests say so), until the next loop's broadcast makes them equal again, and the two further steps
still match the one-process trainer that resynced the same way.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from online_opd.config import AutoObjectiveConfig
from online_opd.release.registry import DrafterRegistry
from online_opd.train import online_dp
from online_opd.train.online import OnlineTrainer
from tests.online_world import K, make_world, online_config, setup_run
from tests.tiny import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tests/online_world.py's world, built once for this module."""
    return make_world(tmp_path_factory.mktemp("online"))


TOLERANCE = 1e-5
NUM_RESUMED = 1  # steps before the state both runs resume from
NUM_STEPS = 3  # counted from the start, the resumed step included
NUM_AFTER_RELOAD = 2


def _cfg(max_steps: int, objective: str = "draft_opd"):
    cfg = online_config(max_steps=max_steps, num_threads=1)
    cfg.trainer.sequences_per_step = 3
    cfg.gate.every_steps = 1000  # no gate: it changes no weights and would only cost time
    cfg.trainer.objective = objective
    if objective == "auto":  # the tiny drafter's a1 (0.037) is above up_at: all_forward from step 1 on
        cfg.trainer.auto = AutoObjectiveConfig(strong="all_forward", up_at=0.02, down_at=0.0, min_blocks=32,
                                               window_blocks=4096, min_steps_between_switches=0)
    return cfg


def _promote_other_drafter(registry_dir: Path) -> str:
    """Publish and promote a drafter of other weights (a rollback or a promote by hand, to the trainer)."""
    registry = DrafterRegistry(registry_dir)
    other = tiny_drafter(tiny_target(seed=1), block_size=K, seed=7)
    version = registry.publish(other).version
    registry.promote(version, reason="by hand")
    return version


def _spy_losses(trainer: OnlineTrainer) -> list[float]:
    """The loss of every step ``trainer`` takes from now on (its real ``train_step``, recorded)."""
    losses: list[float] = []
    train_step = trainer.train_step

    def recording(*args, **kwargs):
        stats = train_step(*args, **kwargs)
        losses.append(stats["loss"])
        return stats

    trainer.train_step = recording
    return losses


def _rank(rank: int, init_file: str, paths: dict, out: str, objective: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = _cfg(NUM_STEPS, objective)
        if rank == 0:
            _main_rank(cfg, paths, Path(out))
        else:
            replica = online_dp.Replica(cfg, paths["target_path"])
            assert replica.run() == NUM_STEPS - NUM_RESUMED
            online_dp.parameter_digests(replica.drafter)
            dist.barrier()  # rank 0 reloads and checks the replicas differ
            online_dp.parameter_digests(replica.drafter)
            assert replica.run() == NUM_STEPS - NUM_RESUMED + NUM_AFTER_RELOAD
            online_dp.parameter_digests(replica.drafter)
    finally:
        dist.destroy_process_group()


def _main_rank(cfg, paths: dict, out: Path) -> None:
    trainer = OnlineTrainer(cfg, **paths)
    losses = _spy_losses(trainer)
    assert online_dp.run_main(trainer, threading.Event())["steps"] == NUM_STEPS
    digests = {"trained": online_dp.parameter_digests(trainer.drafter)}
    _promote_other_drafter(paths["registry_dir"])
    dist.barrier()
    assert trainer.sync_with_registry()
    digests["reloaded"] = online_dp.parameter_digests(trainer.drafter)
    trainer.cfg.online.max_steps = NUM_STEPS + NUM_AFTER_RELOAD
    assert online_dp.run_main(trainer, threading.Event())["steps"] == NUM_STEPS + NUM_AFTER_RELOAD
    digests["after"] = online_dp.parameter_digests(trainer.drafter)
    weights = {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}
    torch.save({"losses": losses, "digests": digests, "weights": weights}, out)


def _first_steps(paths: dict, objective: str) -> None:
    """NUM_RESUMED steps in one process, saved: the state both runs resume from."""
    trainer = OnlineTrainer(_cfg(NUM_STEPS, objective), **paths)
    trainer.poll()
    for _ in range(NUM_RESUMED):
        trainer.step()
    trainer.save()


def _one_process(paths: dict, objective: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in one OnlineTrainer: resume, poll, steps, the other drafter promoted, resync, steps."""
    _first_steps(paths, objective)
    trainer = OnlineTrainer(_cfg(NUM_STEPS, objective), **paths)
    trainer.poll()
    losses = [trainer.step()["loss"] for _ in range(NUM_STEPS - NUM_RESUMED)]
    _promote_other_drafter(paths["registry_dir"])
    assert trainer.sync_with_registry()
    losses += [trainer.step()["loss"] for _ in range(NUM_AFTER_RELOAD)]
    return losses, {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}


@pytest.mark.parametrize("objective", ["draft_opd", "auto"])
def test_two_ranks_train_online_as_one_process_and_a_reload_reaches_the_replicas(world, tmp_path,
                                                                                 objective):
    """With auto the replicas take each step's objective from rank 0 (theirs would say "auto")."""
    one_losses, one_weights = _one_process(setup_run(world, tmp_path / "one"), objective)
    assert len(set(one_losses)) == len(one_losses)  # different steps, not a constant

    paths = setup_run(world, tmp_path / "dp")
    _first_steps(paths, objective)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(str(tmp_path / "init"), paths, str(out), objective), nprocs=2, join=True)
    result = torch.load(out, weights_only=True)

    assert len(result["losses"]) == len(one_losses) == NUM_STEPS - NUM_RESUMED + NUM_AFTER_RELOAD
    assert max(abs(a - b) for a, b in zip(one_losses, result["losses"])) < TOLERANCE
    assert one_weights.keys() == result["weights"].keys()
    assert max(float((one_weights[k] - result["weights"][k]).abs().max()) for k in one_weights) < TOLERANCE
    trained, reloaded, after = (result["digests"][k] for k in ("trained", "reloaded", "after"))
    assert trained[0] == trained[1]  # the replicas took the same steps, bit for bit
    assert reloaded[0] != reloaded[1] and reloaded[1] == trained[1]  # rank 0 alone reloaded ...
    assert after[0] == after[1] and after != trained  # ... until its broadcast; then the same steps
    registry = DrafterRegistry(paths["registry_dir"])
    resumed = OnlineTrainer(_cfg(NUM_STEPS, objective), **paths)
    assert resumed.stats()["steps"] == NUM_STEPS + NUM_AFTER_RELOAD  # saved
    assert resumed.stats()["objective"] == ("all_forward" if objective == "auto" else "draft_opd")
    assert registry.current().version == "v0002"


@pytest.mark.slow
def test_trainer_actor_trains_on_two_ray_train_workers_answers_stats_and_saves_on_stop(world, tmp_path):
    """`trainer.num_workers: 2`: the TrainerActor runs rank 0 and a replica as Ray Train workers on a
    local Ray; rank 0's figures reach the actor's ``stats``, and a stop ends both ranks with the state saved."""
    ray = pytest.importorskip("ray")
    from serve.trainer_actor import start_trainer, stop_trainer
    from tests.online_world import wait_for_stats

    paths = setup_run(world, tmp_path)
    cfg = _cfg(max_steps=None)
    cfg.trainer.num_workers = 2
    cfg.gate.every_steps = 2
    handle = start_trainer(cfg, **paths)
    try:
        training = wait_for_stats(handle, lambda s: s.get("steps", 0) >= 3, timeout=300)
        assert training["num_workers"] == 2 and training["running"] and training["errors"] == 0
        assert training["gates"] >= 1 and training["last_published"] is not None
        final = stop_trainer(handle)
        assert final is not None and final["status"] == "stopped" and not final["running"]
        assert final["steps"] >= training["steps"]
        state = torch.load(paths["state_dir"] / "trainer_state.pt", weights_only=True)
        assert state["step"] == final["steps"]
    finally:
        ray.shutdown()
