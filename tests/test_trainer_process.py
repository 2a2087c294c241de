"""The trainer's supervisor (serve/trainer_process.py) against a stand-in child: restarts of the
actor (pid changes) and of the whole child are counted, what a dead child left in its process group is
killed, stale or missing figures read as down, and ``stop`` ends the child through its stdin. The real child (Ray + the trainer actor) runs in
tests/test_faults.py."""

from __future__ import annotations

import logging
import sys
import time

import psutil

from serve.trainer_process import TrainerProcess, TrainerSpec

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


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_restarts_are_counted_and_stop_reaches_the_child(tmp_path, caplog):
    spec = TrainerSpec(config={}, target_path="t", buffer_dir="b", registry_dir="r", state_dir=str(tmp_path))
    trainer = TrainerProcess(spec, backoff_s=(0.1, 0.1), command=[sys.executable, "-c", CHILD])
    assert trainer.stats() == {"up": False, "restarts": {"actor": 0, "ray": 0}}  # not started yet
    with caplog.at_level(logging.WARNING, logger="online_opd.trainer_process"):
        trainer.start()
        wait_for(lambda: trainer.stats().get("pid") == 21)
        stats = trainer.stats()
        assert stats["up"] and stats["steps"] == 5
        assert stats["restarts"] == {"actor": 1, "ray": 1}
        orphan = psutil.Process(int((tmp_path / "orphan").read_text())) if psutil.pid_exists(
            int((tmp_path / "orphan").read_text())) else None
        assert orphan is None or orphan.status() == psutil.STATUS_ZOMBIE  # killed with run 1's group
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
