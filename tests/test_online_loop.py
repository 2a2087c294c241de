"""The online loop end to end: `online-opd serve` with its Ray trainer, traffic from
`online-opd loadgen`'s engine (the real openai client), and /metrics showing a
record captured, a training step, a candidate gated, a version published and
hot-loaded by the reloader (configs/test-online.yaml).
"""

from __future__ import annotations

import threading
import time

import pytest

from online_opd.release.registry import DrafterRegistry
from serve.launcher import ServerProcess
from serve.loadgen import LoadConfig, run_load
from tests.serving import ROOT, TOKEN, random_drafter

pytestmark = pytest.mark.slow
CONFIG = ROOT / "configs" / "test-online.yaml"


def _traffic(server: ServerProcess, stop: threading.Event, summaries: list[dict], num_requests: int,
             concurrency: int, max_tokens: int) -> None:
    """Greedy ShareGPT traffic in rounds of `num_requests` until `stop`; each round's summary appended."""
    while not stop.is_set():
        summaries.append(run_load(LoadConfig(
            base_url=f"{server.url}/v1", prompts="sharegpt", num_prompts=6, num_requests=num_requests,
            concurrency=concurrency, max_tokens=max_tokens, temperature=0.0, progress=False)))


def test_serve_train_gate_publish_reload(tmp_path):
    # no bootstrap output at this path: the server publishes a fresh drafter as v0001
    server = ServerProcess(tmp_path / "serve", CONFIG, "-o", f"bootstrap.output_dir={tmp_path / 'none'}",
                           token=TOKEN)
    stop = threading.Event()
    summaries: list[dict] = []
    try:
        server.wait_ready()
        sender = threading.Thread(target=_traffic, args=(server, stop, summaries, 12, 4, 48))
        sender.start()
        registry = DrafterRegistry(server.run_dir / "registry")
        deadline = time.monotonic() + 900
        seen: dict[str, float] = {}
        loads: list[float] = []  # the trainer's view of the engine's load under traffic
        while time.monotonic() < deadline:
            time.sleep(3)
            m = server.metrics()
            seen = {k: max(v, seen.get(k, 0.0)) for k, v in m.items()}
            if "online_opd_trainer_engines_idle" in m:
                loads.append(m["online_opd_trainer_engines_idle"])
            # the reload is seen within a poll of the promotion; the trainer's gate figures (its stats
            # line, every second) and the promoted version's served acceptance can come a scrape later
            if seen.get("online_opd_reloads_total{result=ok}", 0) >= 1 and \
                    seen.get("online_opd_drafter_version", 0) >= 2 and \
                    seen.get("online_opd_gate_promotions_total", 0) >= 1 and \
                    sum(k.startswith("online_opd_served_acceptance_length{") for k in seen) >= 2:
                break
        stop.set()
        sender.join(600)
        history = registry.history()
        # no traffic now: the trainer process reads the engine idle from /metrics (online.idle_after_s 2)
        idle_deadline = time.monotonic() + 60
        while server.metrics().get("online_opd_trainer_engines_idle") != 1.0 and time.monotonic() < idle_deadline:
            time.sleep(1)
        is_idle_after = server.metrics().get("online_opd_trainer_engines_idle") == 1.0
    finally:
        stop.set()
        code = server.stop()
    log = server.tail(20000)
    assert code in (0, -15), log
    assert seen.get("online_opd_records_captured_total", 0) > 0, log
    assert seen.get("online_opd_trainer_steps_total", 0) > 0, log
    assert seen.get("online_opd_trainer_up", 0) == 1.0
    assert seen.get("online_opd_gate_runs_total", 0) >= 1, log
    assert seen.get("online_opd_gate_promotions_total", 0) >= 1, log
    assert seen.get("online_opd_reloads_total{result=ok}", 0) >= 1, log
    assert seen.get("online_opd_drafter_version", 0) >= 2, log  # v0002 or later was served
    served = [k for k in seen if k.startswith("online_opd_served_acceptance_length{")]
    assert len(served) >= 2, served  # live acceptance of v0001 and of a promoted version
    events = [e["event"] for e in history]
    assert "publish" in events and events.count("promote") >= 2, history  # v0001, then a gated candidate
    assert all(s["requests_failed"] == 0 for s in summaries), summaries
    assert loads and 0.0 in loads, loads  # read busy while requests ran
    assert is_idle_after, log


def test_live_check_rolls_back_a_worse_drafter(trained_run, tmp_path):
    """The reloader loads a promoted random drafter, sees live acceptance fall and rolls back."""

    from tests.serving import CONFIG as SERVE_CONFIG

    server = ServerProcess(tmp_path / "serve", SERVE_CONFIG, "--no-train", "-o", f"bootstrap.output_dir={trained_run}",
                           "-o", "serve.live_check_drafts=60", "-o", "serve.live_check_min_windows=8",
                           "-o", "serve.rollback_tolerance=0.2", token=TOKEN)
    stop = threading.Event()
    summaries: list[dict] = []

    def traffic() -> None:
        while not stop.is_set():  # the memorised prompts (configs/test-serve.yaml's data section)
            summaries.append(run_load(LoadConfig(
                base_url=f"{server.url}/v1", prompts="sharegpt", num_prompts=6, num_requests=8,
                concurrency=4, max_tokens=48, temperature=0.0, progress=False)))

    try:
        server.wait_ready()
        registry = DrafterRegistry(server.run_dir / "registry")
        assert registry.current().version == "v0001"
        sender = threading.Thread(target=traffic)
        sender.start()
        time.sleep(15)  # the trained version's live acceptance: the baseline
        bad = registry.publish(random_drafter(trained_run), parent="v0001")  # worse than v0001
        registry.promote(bad.version, reason="test: a worse drafter")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and registry.current().version != "v0001":
            time.sleep(2)
        time.sleep(6)  # the reloader loads v0001 again
        metrics = server.metrics()
        stop.set()
        sender.join(600)
    finally:
        stop.set()
        code = server.stop()
    assert code in (0, -15), server.tail()
    assert registry.current().version == "v0001", registry.history()
    assert registry.get(bad.version).status == "bad"
    check = registry.get(bad.version).metrics["live_check"]
    assert check["result"] == "rolled_back" and check["tau"] < check["baseline_tau"], check
    assert metrics["online_opd_rollbacks_total"] == 1
    assert metrics["online_opd_reloads_total{result=ok}"] >= 2  # to the bad version and back
    assert metrics['online_opd_drafter_info{version=v0001}'] == 1.0
    assert all(s["requests_failed"] == 0 for s in summaries), summaries


def _ray_heads(server: ServerProcess) -> list[int]:
    """Pids of the Ray heads (gcs_server) the server's trainer process started."""
    import psutil

    heads = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if proc.name() == "gcs_server":
                heads.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return heads


def _until(condition, timeout: float, what: str, server: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s\n{server.tail(6000)}"
        time.sleep(1)


def test_a_hibernating_trainer_runs_ray_only_around_the_engine_s_idle_time(tmp_path):
    """`online.hibernate_after_s` with duty 0: Ray and the trainer actor start once the real engine has been
    idle for idle_after_s, stop (state saved) after it has served for hibernate_after_s, and start again,
    resuming from the saved state, when it is idle again; /metrics keeps the trainer's figures meanwhile."""
    server = ServerProcess(tmp_path / "serve", CONFIG, "-o", f"bootstrap.output_dir={tmp_path / 'none'}",
                           "-o", "online.duty_cycle=0", "-o", "online.hibernate_after_s=4",
                           "-o", "online.idle_after_s=2", token=TOKEN)
    stop = threading.Event()
    summaries: list[dict] = []
    sender = threading.Thread(target=_traffic, args=(server, stop, summaries, 4, 2, 32))
    try:
        server.wait_ready()
        # no traffic yet: the engine reads idle, so Ray comes up (the buffer is empty: nothing to train on)
        _until(lambda: _ray_heads(server), 120, "Ray started while the engine is idle", server)
        sender.start()
        # under traffic the trainer stops its actor and Ray after hibernate_after_s, then reports hibernating
        _until(lambda: not _ray_heads(server) and summaries and server.metrics().get("online_opd_trainer_up"),
               180, "Ray stopped under traffic", server)
        hibernating = server.metrics()
        time.sleep(10)  # Ray stays down while the traffic goes on
        assert not _ray_heads(server), server.tail(6000)
        stop.set()
        sender.join(300)
        # idle again: Ray and the actor come back, resume from the saved state and train on the records
        _until(lambda: _ray_heads(server), 120, "Ray started again once idle", server)
        _until(lambda: server.metrics().get("online_opd_trainer_steps_total", 0) >= 1, 300,
               "a training step after the restart", server)
        trained = server.metrics()
    finally:
        stop.set()
        if sender.is_alive():
            sender.join(300)
        code = server.stop()
    log = server.tail(40000)
    assert code in (0, -15), log
    assert all(s["requests_failed"] == 0 for s in summaries), summaries
    assert hibernating["online_opd_trainer_engines_idle"] == 0.0, hibernating
    assert hibernating.get("online_opd_trainer_restarts_total{level=actor}", 0) == 0  # on purpose: no restart
    assert trained.get("online_opd_trainer_restarts_total{level=actor}", 0) == 0
    assert trained.get("online_opd_trainer_restarts_total{level=ray}", 0) == 0
    assert trained["online_opd_trainer_records_seen_total"] > 0, log
    assert "online trainer stopped (state saved) and Ray shut down" in log, log
