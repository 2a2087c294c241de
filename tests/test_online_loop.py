"""The online loop end to end: `online-opd serve` with its Ray trainer, traffic from
`online-opd loadgen`'s engine (the real openai client), and /metrics showing a
record captured, a training step, a candidate gated, a version published and
hot-loaded by the reloader (configs/test-online.yaml).
"""

from __future__ import annotations

import threading
import time

import pytest

from online_opd.registry import DrafterRegistry
from serve.launcher import ServerProcess
from serve.loadgen import LoadConfig, run_load
from tests.serving import ROOT, TOKEN

pytestmark = pytest.mark.slow
CONFIG = ROOT / "configs" / "test-online.yaml"


def test_serve_train_gate_publish_reload(tmp_path):
    # no bootstrap output at this path: the server publishes a fresh drafter as v0001
    server = ServerProcess(tmp_path / "serve", CONFIG, "-o", f"bootstrap.output_dir={tmp_path / 'none'}",
                           token=TOKEN)
    stop = threading.Event()
    summaries: list[dict] = []

    def traffic() -> None:
        while not stop.is_set():
            summaries.append(run_load(LoadConfig(
                base_url=f"{server.url}/v1", prompts="sharegpt", num_prompts=6, num_requests=12,
                concurrency=4, max_tokens=48, temperature=0.0, progress=False)))

    try:
        server.wait_ready()
        sender = threading.Thread(target=traffic)
        sender.start()
        registry = DrafterRegistry(server.run_dir / "registry")
        deadline = time.monotonic() + 900
        seen: dict[str, float] = {}
        while time.monotonic() < deadline:
            time.sleep(3)
            m = server.metrics()
            seen = {k: max(v, seen.get(k, 0.0)) for k, v in m.items()}
            if seen.get("online_opd_reloads_total{result=ok}", 0) >= 1 and \
                    seen.get("online_opd_drafter_version", 0) >= 2:
                break
        stop.set()
        sender.join(600)
        history = registry.history()
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
