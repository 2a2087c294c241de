"""vLLM's CPU runtime settings (serve/cpu_runtime.py): what goes into the engine's environment."""

import os
from pathlib import Path

import pytest

from online_opd.config import ConfigError, load_config
from serve.cpu_runtime import (
    cpu_runtime_env,
    find_libiomp,
    set_idle_priority,
    trainer_process_env,
)

IOMP = Path("/opt/venv/lib/libiomp5.so")


def test_iomp_is_preloaded_and_cores_unreserved():
    env = cpu_runtime_env("iomp", 0, environ={}, libiomp=IOMP)
    assert env == {"LD_PRELOAD": str(IOMP), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_iomp_goes_before_other_preloads():
    env = cpu_runtime_env("iomp", None, environ={"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}, libiomp=IOMP)
    assert env == {"LD_PRELOAD": f"{IOMP}:/usr/lib/libtcmalloc.so"}


@pytest.mark.parametrize("preload", ["/x/libgomp.so.1", "/y/libiomp5.so", "/z/libomp.so"])
def test_a_users_openmp_preload_is_kept(preload):
    assert cpu_runtime_env("iomp", None, environ={"LD_PRELOAD": preload}, libiomp=IOMP) == {}


def test_gomp_adds_nothing_and_a_users_reservation_is_kept():
    environ = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert cpu_runtime_env("gomp", 0, environ=environ, libiomp=IOMP) == {}
    assert cpu_runtime_env("gomp", None, environ={}, libiomp=IOMP) == {}


def test_missing_libiomp_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr("serve.cpu_runtime.find_libiomp", lambda: None)
    assert cpu_runtime_env("iomp", 0, environ={}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert "libiomp5.so not found" in caplog.text


def test_the_install_ships_libiomp():
    """vllm-cpu depends on intel-openmp, whose wheel puts libiomp5.so under <venv>/lib."""
    lib = find_libiomp()
    assert lib is not None and lib.name == "libiomp5.so"


def test_config_rejects_unknown_openmp(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cpu:\n  openmp: tbb\n")
    with pytest.raises(ConfigError, match="openmp"):
        load_config(path)


FORK_PROBE = """
import os, subprocess
import torch  # starts the preloaded OpenMP runtime, which registers its fork handlers
torch.ones(64, 64) @ torch.ones(64, 64)
parent = sorted(os.sched_getaffinity(0))
# a preexec_fn makes Python fork (not vfork), so fork handlers run, as in Ray's process starts
child = subprocess.run(["grep", "Cpus_allowed_list", "/proc/self/status"], preexec_fn=lambda: None,
                       capture_output=True, text=True, check=True).stdout.split()[-1]
print(parent, child)
"""


def _fork_probe(env: dict[str, str]) -> tuple[str, str]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORK_PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    parent, child = out.strip().rsplit(" ", 1)
    return parent, child


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to see a process bound to one")
def test_the_trainer_process_forks_children_onto_all_its_cores():
    """libiomp5, preloaded as the engine wants it, binds every child a torch process forks to one core
    (its fork handler): the Ray head, raylet and trainer actor all ran on core 0. The trainer process's
    environment switches the handler off."""
    lib = find_libiomp()
    base = {**os.environ, "LD_PRELOAD": str(lib)}
    cores = sorted(os.sched_getaffinity(0))
    allowed = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else None
    parent, child = _fork_probe(base)
    assert parent == str(cores) and child != allowed and "-" not in child and "," not in child  # one core
    parent, child = _fork_probe(trainer_process_env(base))
    assert parent == str(cores) and child == allowed


def test_idle_priority_reaches_the_threads_and_those_they_start():
    import threading

    seen: dict[str, int] = {}
    ready, done = threading.Event(), threading.Event()

    def child() -> None:
        seen["child"] = os.sched_getscheduler(threading.get_native_id())

    def worker() -> None:
        seen["tid"] = threading.get_native_id()
        ready.set()
        done.wait(10)
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()
        seen["self"] = os.sched_getscheduler(threading.get_native_id())

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait(10)
    assert set_idle_priority([seen["tid"], 2**22 + 12345]) == [seen["tid"]]  # a thread that is gone is skipped
    done.set()
    thread.join()
    assert seen["self"] == seen["child"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own class is untouched


def test_config_rejects_unknown_trainer_priority(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("online:\n  cpu_priority: realtime\n")
    with pytest.raises(ConfigError, match="cpu_priority"):
        load_config(path)
