"""Soak and faults on the real engine: one `online-opd serve` with its trainer (configs/test-online.yaml,
starting from the memorising drafter of `trained_run`), its trace buffer on a small tmpfs of its own.

In file order: malformed requests; a short soak (mixed greedy and sampled, streamed or not, 10% opted
out, admin hot reloads, the trainer running); then one fault at a time under background traffic, each
checked for recovery before the next: the buffer folder read-only, then full; the registry's CURRENT
corrupted; a checkpoint truncated in a publish; kill -9 of the trainer actor mid-step; kill -9 of the
Ray head. Every fault must leave 0 failed requests and one buffer record per captured request, show on
/metrics and in the log, and heal by itself once the fault is gone. benchmarks/soak.py is the long soak.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from online_opd.files import atomic_write_json
from online_opd.models.drafters.checkpoint import WEIGHTS_FILE
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.buffer import BufferReader
from serve.launcher import ServerProcess
from serve.soak import TrafficSettings, check_soak, problems, run_reloads, run_traffic
from tests.serving import ROOT, TOKEN

pytestmark = pytest.mark.slow
CONFIG = ROOT / "configs" / "test-online.yaml"
MAX_TOKENS = 48  # the rollouts' length: greedy outputs compare whole
SOAK_S = 45.0
TMPFS_BYTES = 32 * 1024**2
RESTART_S = 480.0  # a restarted trainer loads the target on CPUs the engine is busy with (300 s ran out once
# in a full run 25% slower than usual: the promotion after the restart came later, 78 s alone)


def mount_tmpfs(path: Path) -> str | None:
    """Mount a small tmpfs at ``path``; None when done, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults")
    no_tmpfs = mount_tmpfs(run_dir / "buffer")
    srv = ServerProcess(run_dir, CONFIG, "-o", f"bootstrap.output_dir={trained_run}", token=TOKEN)
    srv.no_tmpfs = no_tmpfs
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        if no_tmpfs is None:
            subprocess.run(["umount", "-l", str(srv.buffer)], check=False)
        assert code in (0, -15), srv.tail()


def log_text(server: ServerProcess) -> str:
    server.log.flush()
    return (server.run_dir / "server.log").read_text(errors="replace")


def wait_metrics(server: ServerProcess, condition, timeout: float = 120.0, what: str = "") -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if condition(metrics):
            return metrics
        assert time.monotonic() < deadline, f"not reached in {timeout}s: {what}\n{server.tail(6000)}"
        time.sleep(0.5)


def settled_records(server: ServerProcess, cursor: str | None, quiet_s: float = 2.5, timeout: float = 60.0):
    """Records written after ``cursor``, once their number stopped changing for ``quiet_s``."""
    reader = BufferReader(server.buffer)
    count, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while True:
        records = list(reader.iter_records(after=cursor))
        if len(records) != count:
            count, since = len(records), time.monotonic()
        elif time.monotonic() - since >= quiet_s or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def last_segment(server: ServerProcess) -> str | None:
    segments = BufferReader(server.buffer).segments()
    return segments[-1].name if segments else None


class Traffic:
    """Background soak traffic while a fault is injected (a context manager: it always stops);
    ``finish`` stops it and checks it like the soak."""

    def __init__(self, server: ServerProcess, rollouts, *, concurrency: int = 4):
        self.server = server
        self.settings = TrafficSettings(base_url=server.url, prompts=[p for p, _ in rollouts],
                                        concurrency=concurrency, duration_s=3600, max_tokens=MAX_TOKENS,
                                        seed=random.randrange(1 << 30))
        self.references = {i: out for i, (_, out) in enumerate(rollouts)}
        self.cursor = last_segment(server)
        self.started_at = time.time()  # records of requests that finished earlier can be written later
        self.stop = threading.Event()
        self.requests: list = []
        self.thread = threading.Thread(target=lambda: self.requests.extend(run_traffic(self.settings, self.stop)))
        self.thread.start()

    def __enter__(self) -> Traffic:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(600)

    def finish(self, timeout: float = 300.0) -> dict:
        # A fault can heal before the traffic's first request finished (a torn CURRENT is repaired on the
        # reloader's next 0.5 s poll): keep the traffic going until a request captured since its start
        # is in the buffer, so the checks below see requests that went through the fault.
        deadline = time.monotonic() + timeout
        while not any(r.captured_at >= self.started_at
                      for r in BufferReader(self.server.buffer).iter_records(after=self.cursor)):
            assert time.monotonic() < deadline, f"no captured request in {timeout:.0f}s\n{self.server.tail(6000)}"
            time.sleep(1.0)
        self.__exit__()
        records = [r for r in settled_records(self.server, self.cursor) if r.captured_at >= self.started_at]
        corrupt = BufferReader(self.server.buffer).stats()["corrupt_segments"]
        figures = check_soak(self.settings, self.requests, records, references=self.references,
                             corrupt_segments=corrupt)
        assert figures["ok"] > 0 and problems(figures) == {}, figures
        return figures


def vllm_error(response: httpx.Response) -> dict:
    """vLLM's error object: the body of a 400, or a streamed request's error event (after a 200)."""
    if response.status_code != 200:
        return response.json().get("error", {})
    for line in response.text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            return json.loads(line[6:])["error"]
    return {}


def descendants(server: ServerProcess, name: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if name in proc.name() or name in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


# ------------------------------------------------------------------------------------------ tests


def test_malformed_requests_get_vllm_s_error_and_leave_no_record(server, rollouts):
    before, cursor = server.metrics(), last_segment(server)
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    prompt = rollouts[0][0]
    bad = [("/v1/completions", {"prompt": prompt, "max_tokens": 8, "vllm_xargs": {"online_opd_capture": {"x": 1}}}),
           ("/v1/completions", {"prompt": prompt, "max_tokens": 8, "vllm_xargs": "online_opd_capture=false"}),
           ("/v1/completions", {"prompt": prompt, "max_tokens": 8, "vllm_xargs": {"online_opd_capture": "flase"}}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                     "stream": True, "vllm_xargs": {"online_opd_capture": 2}}),
           ("/v1/completions", {"prompt": prompt, "max_tokens": 10**9}),
           ("/v1/completions", {"prompt": prompt, "max_tokens": -1}),
           ("/v1/chat/completions", {"messages": [], "max_tokens": 8}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9})]
    for route, body in bad:
        response = httpx.post(f"{server.url}{route}", json={"model": model, **body}, timeout=60)
        error = vllm_error(response)
        assert error.get("code") == 400 and error.get("message"), (body, response.status_code, response.text[:500])
    time.sleep(2.0)  # > capture.flush_interval_s: a record would be on disk by now
    after = server.metrics()
    assert after["online_opd_records_captured_total"] == before["online_opd_records_captured_total"]
    assert settled_records(server, cursor, quiet_s=0.5) == []
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_short_soak(server, rollouts):
    """Mixed traffic with hot reloads every 15 s and the trainer running (the long one: benchmarks/soak.py)."""
    registry = DrafterRegistry(server.run_dir / "registry")
    settings = TrafficSettings(base_url=server.url, prompts=[p for p, _ in rollouts], concurrency=8,
                               duration_s=SOAK_S, max_tokens=MAX_TOKENS)
    before, cursor = server.metrics(), last_segment(server)
    stop, reloads = threading.Event(), []
    choose = lambda turn: "v0001" if turn % 2 else registry.current().version  # noqa: E731
    reloader = threading.Thread(target=lambda: reloads.extend(run_reloads(server.admin, choose, 15.0, stop)))
    reloader.start()
    try:
        requests = run_traffic(settings)
    finally:
        stop.set()
        reloader.join(300)
    figures = check_soak(settings, requests, settled_records(server, cursor),
                         references={i: out for i, (_, out) in enumerate(rollouts)},
                         corrupt_segments=BufferReader(server.buffer).stats()["corrupt_segments"], reloads=reloads)
    after = server.metrics()
    assert problems(figures) == {}, figures
    assert figures["greedy"] >= 10 and figures["opted_out"] >= 2 and figures["streamed"] >= 10, figures
    assert figures["reloads"] >= 2, reloads
    for result in ("refused", "failed"):
        key = f"online_opd_reloads_total{{result={result}}}"
        assert after.get(key, 0) == before.get(key, 0), (key, reloads)
    assert after["online_opd_trainer_steps_total"] > before.get("online_opd_trainer_steps_total", 0)


def test_buffer_read_only_then_full_holds_records_and_resumes(server, rollouts):
    if server.no_tmpfs is not None:
        pytest.skip(f"the buffer needs its own tmpfs to be made read-only or full as root: {server.no_tmpfs}")
    with Traffic(server, rollouts) as traffic:
        try:
            for fault in ("read-only", "full"):
                errors = server.metrics()["online_opd_buffer_write_errors_total"]
                set_buffer_fault(server, fault, True)
                wait_metrics(server, lambda m: m["online_opd_buffer_write_errors_total"] >= errors + 2
                             and m["online_opd_buffer_held_records"] > 0, what=f"write errors while {fault}")
                set_buffer_fault(server, fault, False)
                wait_metrics(server, lambda m: m["online_opd_buffer_held_records"] == 0,
                             what=f"recovery from {fault}")
        finally:
            set_buffer_fault(server, "read-only", False)
            set_buffer_fault(server, "full", False)
        traffic.finish()  # nothing lost: the held records were written once the buffer took them
    log = log_text(server)
    assert log.count("buffer writes to") == 4, log[-6000:]  # failing + resumed, per fault, once each
    assert "Read-only file system" in log and "No space left on device" in log
    assert server.metrics()["online_opd_records_dropped_total"] == 0


def set_buffer_fault(server: ServerProcess, fault: str, is_on: bool) -> None:
    """Remount the buffer's tmpfs read-only (or back), or fill it with a file (or remove it)."""
    filler = server.buffer / "filler.bin"
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount," + ("ro" if is_on else "rw"), str(server.buffer)], check=is_on)
    elif not is_on:
        filler.unlink(missing_ok=True)
    else:
        with open(filler, "wb") as f:  # ENOSPC ends the loop: the tmpfs is full
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass


def test_a_corrupt_current_is_repaired(server, rollouts):
    registry = DrafterRegistry(server.run_dir / "registry")
    before = server.metrics()
    key = "online_opd_registry_repairs_total"
    with Traffic(server, rollouts) as traffic:
        inject_until(server, lambda: (registry.root / "CURRENT").write_text('{"version": "v00'),  # torn by hand
                     lambda m: m.get(key, 0) > before.get(key, 0), what="CURRENT repaired")
        traffic.finish()
    assert server.metrics()["online_opd_registry_errors_total"] >= 1
    assert registry.current().status == "promoted"  # the newest version made current, readable again
    assert "repaired CURRENT None ->" in log_text(server)


def test_a_checkpoint_truncated_in_a_publish_is_never_served(server, rollouts):
    registry = DrafterRegistry(server.run_dir / "registry")
    # a publisher killed mid-copy: its staging folder and reserved name stay behind, never listed
    staging = registry.versions_dir / ".v0900.0123456789ab.tmp"
    staging.mkdir()
    (staging / WEIGHTS_FILE).write_bytes(b"\0" * 100)
    (registry.reserved_dir / "v0900").mkdir()
    before = server.metrics()
    torn: list[str] = []

    def publish_torn() -> None:  # weights that lost their tail after the manifest was written, made CURRENT
        good = registry.current().version
        torn.append(registry.publish(registry.path(good), parent=good).version)
        weights = registry.path(torn[-1]) / WEIGHTS_FILE
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        atomic_write_json(registry.root / "CURRENT", {"version": torn[-1], "since": time.time(), "reason": "test"})

    refused = "online_opd_reloads_total{result=refused}"

    def torn_refused(m: dict) -> bool:  # not just any rollback: the live check may roll back a trained version
        return m.get(refused, 0) > before.get(refused, 0) and registry.get(torn[-1]).status == "bad"

    with Traffic(server, rollouts) as traffic:
        inject_until(server, publish_torn, torn_refused, what="the torn version refused and marked bad")
        # The reloader marks the version bad in the registry (rollback or mark_bad), then counts and logs
        # it: wait for the log line, after which /metrics shows the count. When the trainer promoted a
        # newer version after the injected CURRENT, the torn one is only marked bad (CURRENT moved on).
        rolled_back = f"rolled back {torn[-1]} -> "
        marked_bad = f"{torn[-1]} failed (hot reload refused"
        deadline = time.monotonic() + 30
        while not any(line in log_text(server) for line in (rolled_back, marked_bad)):
            assert time.monotonic() < deadline, server.tail(6000)
            time.sleep(0.5)
        traffic.finish()
    if rolled_back in log_text(server):
        assert server.metrics()["online_opd_rollbacks_total"] > before["online_opd_rollbacks_total"]
    assert registry.get(torn[-1]).status == "bad" and registry.current().version != torn[-1]
    assert f"online_opd_drafter_info{{version={torn[-1]}}}" not in server.metrics()
    assert all(info.version != "v0900" for info in registry.list())
    assert "drafter reload refused before the engine saw it" in log_text(server)


def test_the_trainer_killed_mid_step_restarts_and_resumes(server, rollouts):
    key = "online_opd_trainer_restarts_total{level=actor}"
    with Traffic(server, rollouts) as traffic:
        steps = wait_metrics(server, lambda m: m["online_opd_trainer_up"] == 1)["online_opd_trainer_steps_total"]
        # the trainer's counters are withheld while it does not answer (trainer_up 0), as on a loaded machine
        wait_metrics(server, lambda m: m.get("online_opd_trainer_steps_total", steps) > steps, what="training steps")
        (actor,) = descendants(server, "ray::TrainerActor")
        # Ray's processes and the actor run where the trainer process does (libiomp5's fork handler,
        # switched off for it, bound them to one core), on SCHED_IDLE (online.cpu_priority: idle)
        (driver,) = descendants(server, "serve.trainer_process")
        for proc in (driver, actor, *descendants(server, "gcs_server"), *descendants(server, "raylet")):
            assert os.sched_getaffinity(proc.pid) == os.sched_getaffinity(driver.pid), proc.name()
            assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE, proc.name()
        actor.send_signal(signal.SIGKILL)  # steps follow one another: it dies inside one
        restarted = wait_metrics(server, lambda m: m.get(key, 0) == 1 and m["online_opd_trainer_up"] == 1,
                                 timeout=RESTART_S, what="the actor restarted by Ray")
        wait_metrics(server, lambda m: m.get("online_opd_trainer_steps_total", 0) > restarted["online_opd_trainer_steps_total"],
                     what="steps after the restart")
        traffic.finish()
    assert "online trainer actor restarted by Ray" in log_text(server)
    assert descendants(server, "ray::TrainerActor")[0].pid != actor.pid


def test_the_ray_head_killed_restarts_ray_and_the_loop_goes_on(server, rollouts):
    registry = DrafterRegistry(server.run_dir / "registry")
    key = "online_opd_trainer_restarts_total{level=ray}"
    actor_restarts = server.metrics().get("online_opd_trainer_restarts_total{level=actor}", 0)
    with Traffic(server, rollouts) as traffic:
        (gcs,) = descendants(server, "gcs_server")
        old_session = os.getsid(gcs.pid)  # the trainer process's: Ray's processes live in it
        gcs.send_signal(signal.SIGKILL)
        restarted = wait_metrics(server, lambda m: m.get(key, 0) == 1 and m["online_opd_trainer_up"] == 1,
                                 timeout=RESTART_S, what="Ray and the trainer started again")
        promotions = count_promotions(registry)

        def serves_a_newer_current(m: dict) -> bool:
            current = registry.current().version
            return count_promotions(registry) > promotions and m.get(f"online_opd_drafter_info{{version={current}}}") == 1

        wait_metrics(server, serves_a_newer_current, timeout=RESTART_S,
                     what="a version trained, promoted and hot-loaded after the restart")
        traffic.finish()
    assert restarted["online_opd_trainer_restarts_total{level=actor}"] == actor_restarts  # kept across
    assert "online trainer process exited" in log_text(server)
    # the new child started off the engine worker's core (vLLM reserves one of the cores here): a child
    # importing torch on the core a busy worker held used to hang (serve/trainer_process.py cores_beside)
    assert "beside the engine's workers on" in log_text(server)
    assert len(descendants(server, "gcs_server")) == 1
    assert in_session(old_session) == [], "the lost head's processes were left running"


def in_session(sid: int) -> list[str]:
    names = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                names.append(proc.info["name"])
        except (ProcessLookupError, PermissionError):
            continue
    return names


def count_promotions(registry: DrafterRegistry) -> int:
    return sum(e["event"] == "promote" for e in registry.history())


def inject_until(server: ServerProcess, inject, condition, *, what: str, attempts: int = 3,
                 timeout: float = 30.0) -> dict:
    """Inject a fault and wait for ``condition``; again (up to ``attempts``) when the trainer's own
    promote overwrote the injected CURRENT before the reloader saw it."""
    for attempt in range(attempts):
        inject()
        try:
            return wait_metrics(server, condition, timeout=timeout, what=what)
        except AssertionError:
            if attempt == attempts - 1:
                raise
    raise AssertionError(what)
