"""The trainer's supervisor (serve/trainer_process.py) against a stand-in child: restarts of the
actor (pid changes) and of the whole child are counted, what a dead child left in its process group is
killed, stale or missing figures read as down, and ``stop`` ends the child through its stdin. The real child (Ray + the trainer actor) runs in
tests/test_faults.py."""

from __future__ import annotations

import logging
import os
import sys
import time

import psutil
import pytest

from online_opd.config_serving import OnlineConfig
from serve.engine_load import HIBERNATING, Hibernation, ServerLoad
from serve.trainer_process import TrainerProcess, TrainerSpec
from vllm_patches.endpoint import read_trainer_stats_file

# Run 1 starts a process that outlives it, reports actor pid 11, then 12 (Ray restarted the actor), then
# null (restarting), then exits 1 (its Ray head is gone). Run 2 reports pid 21 until "stop" arrives on stdin.
CHILD = r"""
import json, sys, time
from pathlib import Path
spec = json.loads(sys.stdin.readline())
runs = Path(spec["state_dir"]) / "runs"
run = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(run))
if run == 1:  # leaves a process behind in its group, as a lost Ray head's agents are
    import subprocess
    orphan = subprocess.Popen(["sleep", "600"])
    (Path(spec["state_dir"]) / "orphan").write_text(str(orphan.pid))
    for line in ({"pid": 11, "steps": 3}, {"pid": 12, "steps": 3}, None):
        print(json.dumps(line), flush=True)
        time.sleep(0.2)
    sys.exit(1)
print(json.dumps({"pid": 21, "steps": 5}), flush=True)
assert sys.stdin.readline().strip() == "stop"
(Path(spec["state_dir"]) / "stopped").write_text("yes")
"""


def _is_gone(pid: int) -> bool:
    """Dead, or a zombie not yet reaped (it may vanish between two looks: that is gone too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_restarts_are_counted_and_stop_reaches_the_child(tmp_path, caplog):
    spec = TrainerSpec(config={}, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path))
    stats_file = tmp_path / "trainer_stats.json"
    trainer = TrainerProcess(spec, backoff_s=(0.1, 0.1), command=[sys.executable, "-c", CHILD],
                             stats_file=stats_file)
    assert trainer.stats() == {"up": False, "restarts": {"actor": 0, "ray": 0}}  # not started yet
    with caplog.at_level(logging.WARNING, logger="online_opd.trainer_process"):
        trainer.start()
        # the reader thread notes a line, then writes the file: wait for both, not only the first
        wait_for(lambda: trainer.stats().get("pid") == 21
                 and (read_trainer_stats_file(stats_file) or {}).get("pid") == 21)
        stats = trainer.stats()
        assert stats["up"] and stats["steps"] == 5
        assert stats["restarts"] == {"actor": 1, "ray": 1}
        # what API servers in processes of their own read (vllm_patches/endpoint.py)
        assert read_trainer_stats_file(stats_file) == stats
        assert read_trainer_stats_file(stats_file, stale_s=-1.0) == {"up": False, "restarts": stats["restarts"]}
        assert _is_gone(int((tmp_path / "orphan").read_text()))  # killed with run 1's group
        final = trainer.stop(timeout=10)
    assert final["pid"] == 21
    assert (tmp_path / "stopped").read_text() == "yes"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("actor restarted" in m for m in messages) == 1, messages
    assert sum("exited with code 1" in m for m in messages) == 1, messages


def test_figures_older_than_stale_s_read_as_down(tmp_path):
    spec = TrainerSpec(config={}, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path))
    trainer = TrainerProcess(spec, stale_s=0.3)
    trainer._observe({"pid": 7, "steps": 1})
    assert trainer.stats()["up"]
    time.sleep(0.4)
    assert trainer.stats() == {"up": False, "restarts": {"actor": 0, "ray": 0}}
    trainer._observe(None)  # the child answers, the actor does not
    assert not trainer.stats()["up"]


def test_a_missing_or_unreadable_stats_file_reads_as_none(tmp_path):
    assert read_trainer_stats_file(tmp_path / "absent.json") is None
    (tmp_path / "torn.json").write_text('{"up": tr')
    assert read_trainer_stats_file(tmp_path / "torn.json") is None


# Run 1 hangs before its first line (as a child stuck starting Ray would), in a function the stack dump
# must name; run 2 reports every 0.2 s until "stop".
HUNG_CHILD = r"""
import faulthandler, json, signal, sys, time
from pathlib import Path
faulthandler.register(signal.SIGUSR1, all_threads=True)
spec = json.loads(sys.stdin.readline())
runs = Path(spec["state_dir"]) / "runs"
run = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(run))
def stuck_starting_ray():
    time.sleep(3600)
if run == 1:
    stuck_starting_ray()
import threading
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
while not stop.wait(0.2):  # a line every 0.2 s, as the real child writes one every POLL_S
    print(json.dumps({"pid": 31, "steps": 1}), flush=True)
"""


def test_a_hung_child_has_its_stacks_logged_and_is_replaced(tmp_path, caplog, capfd):
    spec = TrainerSpec(config={}, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path))
    trainer = TrainerProcess(spec, backoff_s=(0.1, 0.1), hang_s=1.5, command=[sys.executable, "-c", HUNG_CHILD])
    with caplog.at_level(logging.ERROR, logger="online_opd.trainer_process"):
        trainer.start()
        wait_for(lambda: trainer.stats().get("pid") == 31)
        assert trainer.stats()["restarts"] == {"actor": 0, "ray": 1}
        time.sleep(2.0)  # a child that writes its lines is not hung however long it runs
        assert trainer.stats()["up"] and trainer.stats()["restarts"]["ray"] == 1
        trainer.stop(timeout=10)
    assert (tmp_path / "runs").read_text() == "2"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("it is hung" in m for m in messages) == 1, messages
    assert sum("it hung, or was killed" in m for m in messages) == 1, messages
    assert "in stuck_starting_ray" in capfd.readouterr().err  # the child's own stacks, from faulthandler


# vLLM's CPU worker as the supervisor sees it: a process named VLLM::Worker with one thread bound to core 0
FAKE_WORKER = r"""
import ctypes, os, threading, time
ctypes.CDLL(None).prctl(15, b"VLLM::Worker", 0, 0, 0)  # PR_SET_NAME
bound = threading.Event()
def omp_thread():
    os.sched_setaffinity(0, {0})  # this thread only, as vLLM binds each OpenMP thread
    bound.set()
    time.sleep(600)
threading.Thread(target=omp_thread, daemon=True).start()
bound.wait()
print("bound", flush=True)
time.sleep(600)
"""

AFFINITY_CHILD = r"""
import json, os, sys
from serve.trainer_process import read_spec
spec = read_spec(sys.stdin)
print(json.dumps({"pid": os.getpid(), "cpus": spec.cpus, "affinity": sorted(os.sched_getaffinity(0))}), flush=True)
sys.stdin.readline()
"""


def test_the_trainer_child_runs_beside_the_engine_workers_cores(tmp_path):
    import subprocess

    from serve.trainer_process import cores_beside, engine_cores

    allowed = os.sched_getaffinity(0)
    if 0 not in allowed or len(allowed) < 2:
        pytest.skip(f"needs core 0 and another core; this process may use {sorted(allowed)}")
    assert engine_cores(os.getpid()) == set() and cores_beside(set()) is None  # no worker yet: inherited
    worker = subprocess.Popen([sys.executable, "-c", FAKE_WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "bound"
        assert engine_cores(os.getpid()) == {0}  # its main thread, bound to no single core, is not counted
        spec = TrainerSpec(config={}, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path))
        trainer = TrainerProcess(spec, command=[sys.executable, "-c", AFFINITY_CHILD])
        trainer.start()
        wait_for(lambda: trainer.stats().get("up"))
        stats = trainer.stats()
        trainer.stop(timeout=10)
    finally:
        worker.kill()
        worker.wait()
    assert stats["cpus"] == stats["affinity"] == sorted(allowed - {0}), stats
    assert cores_beside({0, *allowed}) is None  # the engine holds every core: nothing to give


def test_an_unreachable_server_reads_as_unknown_load():
    """No server behind the URL (starting, gone): "unknown", which the trainer counts as serving
    (the "busy" and "idle" readings of a real server: tests/test_online_loop.py)."""
    assert ServerLoad("http://127.0.0.1:9", timeout=1.0).read() == "unknown"


def test_hibernation_wakes_after_idle_after_s_and_sleeps_after_hibernate_after_s_of_serving():
    now = [0.0]
    hib = Hibernation(idle_after_s=10.0, hibernate_after_s=60.0, clock=lambda: now[0])
    assert not hib.may_wake() and not hib.should_sleep()  # nothing read yet
    for state in ("unknown", "busy", "idle"):
        hib.note(state)
        now[0] += 2.0
    assert not hib.may_wake()  # idle for 2 s only
    now[0] += 8.0
    hib.note("idle")  # a further idle read keeps the idle period's start
    assert hib.may_wake() and not hib.should_sleep()
    hib.note("busy")
    now[0] += 59.0
    hib.note("unknown")  # unknown counts as serving: the period goes on
    assert not hib.should_sleep() and not hib.may_wake()
    now[0] += 1.0
    assert hib.should_sleep()
    hib.note("idle")  # one idle read ends the serving period, but wakes nothing yet
    assert not hib.should_sleep() and not hib.may_wake()


def test_hibernation_applies_only_to_a_local_trainer_with_duty_zero_that_reads_the_load():
    def online(**kw):
        return OnlineConfig.model_validate({"duty_cycle": 0, "hibernate_after_s": 30, **kw})

    assert Hibernation.of(online(), has_load=True).hibernate_after_s == 30
    assert Hibernation.of(online(hibernate_after_s=None), has_load=True) is None
    assert Hibernation.of(online(duty_cycle=0.1), has_load=True) is None
    assert Hibernation.of(online(ray_address="auto"), has_load=True) is None
    assert Hibernation.of(online(), has_load=False) is None
    with pytest.raises(ValueError, match="hibernate_after_s"):
        online(hibernate_after_s=-1)


def test_a_hibernating_child_keeps_its_figures_up_and_its_next_actor_is_no_restart(tmp_path):
    spec = TrainerSpec(config={}, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path))
    trainer = TrainerProcess(spec)
    trainer._observe({"pid": 7, "steps": 4})
    trainer._observe({"pid": None, "steps": 4, "status": HIBERNATING})  # Ray and the actor stopped on purpose
    assert trainer.stats()["up"] and trainer.stats()["steps"] == 4
    trainer._observe({"pid": 8, "steps": 4})  # the next actor, once the engine is idle again
    trainer._observe({"pid": 9, "steps": 5})  # Ray restarted that one: a restart
    assert trainer.stats()["restarts"] == {"actor": 1, "ray": 0}


def test_the_real_child_hibernates_while_the_load_reads_as_serving_and_stops_at_once(tmp_path):
    """`python -m serve.trainer_process` with duty 0 and hibernation, its server unreachable (unknown load,
    counted as serving): it starts no Ray, reports "hibernating" every second, and a stop ends it at once."""
    import psutil

    config = {"online": {"duty_cycle": 0, "hibernate_after_s": 5, "idle_after_s": 1}}
    spec = TrainerSpec(config=config, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path),
                       server_url="http://127.0.0.1:9")
    trainer = TrainerProcess(spec)
    trainer.start()
    try:
        wait_for(lambda: trainer.stats().get("status") == HIBERNATING, timeout=60)
        time.sleep(3)
        stats = trainer.stats()
        children = psutil.Process(trainer._proc.pid).children(recursive=True)
    finally:
        started = time.monotonic()
        final = trainer.stop(timeout=30)
    assert stats["up"] and stats["engines_idle"] == 0 and stats["pid"] is None, stats
    assert children == [], [c.name() for c in children]  # no Ray, no actor
    assert final["status"] == HIBERNATING
    assert trainer._proc.returncode == 0 and time.monotonic() - started < 10


def test_only_the_newest_ray_sessions_of_hibernation_cycles_are_kept(tmp_path):
    from serve.trainer_process import prune_sessions

    folders = []
    for i in range(4):
        (tmp_path / f"session_{i}" / "logs").mkdir(parents=True)
        folders.append(tmp_path / f"session_{i}")
    sessions = [folders[0], None, folders[1], folders[2], folders[3]]  # None: a session whose folder was unknown
    prune_sessions(sessions, keep=2)
    assert sessions == folders[2:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session_2", "session_3"]
    prune_sessions(sessions, keep=2)  # nothing more to remove
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session_2", "session_3"]
