"""The online trainer as a Ray actor (serve/trainer_actor.py) on tests/online_world.py's tiny world: a local
actor that trains, publishes, resumes after a crash and stops; the actor's replica bookkeeping; and two
servers' trainer children sharing one actor on a `ray start --head` cluster."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from online_opd.release.registry import DrafterRegistry
from tests.online_world import make_world, online_config, setup_run, wait_for_stats


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tests/online_world.py's world, built once for this module."""
    return make_world(tmp_path_factory.mktemp("online"))


@pytest.mark.slow
def test_ray_actor_trains_publishes_resumes_after_a_crash_and_stops(world, tmp_path):
    ray = pytest.importorskip("ray")
    from serve.trainer_actor import start_trainer, stop_trainer, trainer_stats

    paths = setup_run(world, tmp_path)
    registry = DrafterRegistry(paths["registry_dir"])
    handle = start_trainer(online_config(max_steps=6), **paths)
    try:
        done = wait_for_stats(handle, lambda s: s["status"] == "stopped")
        assert done["steps"] == 6 and done["gates"] == 2 and done["errors"] == 0 and not done["running"]
        assert done["last_published"] == "v0003" and len(registry.list()) == 3

        ray.kill(handle, no_restart=False)  # a crash: Ray restarts the actor, which resumes from its state
        again = wait_for_stats(handle, lambda s: s["pid"] != done["pid"] and s["status"] == "stopped")
        assert again["steps"] == 6 and again["gates"] == 2  # counters restored ...
        assert len(registry.list()) == 3  # ... and nothing retrained or published again

        final = stop_trainer(handle)
        assert final is not None and final["status"] == "stopped"
        assert (paths["state_dir"] / "trainer_state.pt").exists()
        assert trainer_stats(handle, timeout=5) is None  # the actor is gone
    finally:
        ray.shutdown()


def test_a_shared_trainer_counts_its_replicas_and_refuses_another_buffer(world, tmp_path):
    from serve.trainer_actor import TrainerActor

    paths = setup_run(world, tmp_path)
    actor = TrainerActor(online_config().model_dump(mode="json"), *(str(paths[k]) for k in
                         ("target_path", "buffer_dir", "registry_dir", "state_dir")), autostart=False)
    assert actor.attach("a", str(paths["buffer_dir"]), str(paths["registry_dir"])) == ["a"]
    assert actor.stats("b")["replicas"] == ["a", "b"]  # a poll attaches (a replica whose attach was lost)
    with pytest.raises(ValueError, match="must share one buffer and one registry"):
        actor.attach("c", str(tmp_path / "elsewhere"), str(paths["registry_dir"]))
    assert actor.detach("a") == ["b"]
    actor._replicas["b"] -= 1000.0  # b stopped polling long ago (crashed without detaching)
    assert actor.detach("z", lease_s=120.0) == []  # so it no longer keeps the trainer alive


@pytest.mark.slow
def test_replicas_joining_one_cluster_share_one_trainer(world, tmp_path):
    """Two servers' trainer children (serve/trainer_process.py) joined to one `ray start --head`: one
    named, detached trainer actor serves both; the first to leave leaves it training, the last stops it."""
    import os
    import subprocess
    import sys

    from serve.trainer_process import TrainerProcess, TrainerSpec
    from tests.ray_cluster import ray_head

    paths = {k: str(v) for k, v in setup_run(world, tmp_path).items()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with ray_head(env, num_cpus=2) as address:
        config = online_config(ray_address=address, num_cpus=1).model_dump(mode="json")
        a, b = (TrainerProcess(TrainerSpec(config=config, replica=name, **paths), backoff_s=(1.0, 2.0))
                for name in ("replica-a", "replica-b"))
        a.start()
        b.start()
        try:
            _wait(lambda: a.stats().get("replicas") == b.stats().get("replicas") == ["replica-a", "replica-b"],
                  timeout=240)
            assert a.stats()["pid"] == b.stats()["pid"]  # one actor
            _wait(lambda: b.stats().get("steps", 0) >= 2, timeout=240)
            a.stop(timeout=60)  # the first replica leaves: training goes on for the other
            steps = b.stats()["steps"]
            _wait(lambda: b.stats().get("steps", 0) > steps and b.stats()["replicas"] == ["replica-b"], timeout=120)
        finally:
            a.stop(timeout=60)
            b.stop(timeout=60)  # the last one leaves: the trainer stops, its state saved
        assert (Path(paths["state_dir"]) / "trainer_state.pt").exists()
        gone = subprocess.run([sys.executable, "-c", (
            "import ray, sys\n"
            "from online_opd.config import load_config\n"
            "from serve.trainer_actor import init_ray\n"
            f"init_ray(load_config(None, ['online.ray_address={address}']).online)\n"  # the replicas' namespace
            "try:\n    ray.get_actor('online-opd-trainer')\nexcept ValueError:\n    sys.exit(3)\n")],
            env=env, capture_output=True, text=True, timeout=120)
        assert gone.returncode == 3, gone.stderr[-2000:]  # no trainer left on the cluster


def _wait(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.5)
