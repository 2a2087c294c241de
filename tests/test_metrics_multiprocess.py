"""online-opd's figures on /metrics when vLLM runs several API servers (prometheus multiprocess mode).

With ``--api-server-count N`` every /metrics answer is read from the metric files
of all processes, never from a process's collectors, so API server 0 mirrors its
collectors into multiprocess metrics (``vllm_patches.metrics_multiprocess.MultiprocessMirror``).
The fast tests run the mirror in a child process with ``PROMETHEUS_MULTIPROC_DIR``
set (prometheus-client chooses its value store at import) and compare what
multiprocess /metrics shows with what the same collectors show in one process.
The slow test serves with ``--data-parallel-size 2`` (two engines, two API servers) on the real engine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from online_opd.release.registry import DrafterRegistry
from online_opd.traces.buffer import BufferReader
from serve.clients import openai_client
from serve.launcher import ServerProcess
from tests.serving import ROOT, TOKEN

CHILD = r"""
import json, sys
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from serve.scrape import parse_metrics
from vllm_patches.metrics import PolledCollector, ServedAcceptance, SpeculationCollector, TrainerCollector
from vllm_patches.metrics_multiprocess import MultiprocessMirror, is_multiprocess

assert is_multiprocess()
data = {}
served = ServedAcceptance()

class Served:
    def collect(self):
        yield served.collect_family()

collectors = [PolledCollector(lambda: data["status"]), TrainerCollector(lambda: data["trainer"]), Served(),
              SpeculationCollector(lambda: data["speculation"])]
mirror = MultiprocessMirror(collectors)
single = CollectorRegistry()
for c in collectors:
    single.register(c)
shared = CollectorRegistry()
multiprocess.MultiProcessCollector(shared)
out = []
for round_ in json.loads(sys.argv[1]):
    data.update(round_["data"])
    for version, drafts, accepted in round_["served"]:
        served.update(version, drafts, accepted)
    mirror.update()
    out.append({"mp": parse_metrics(generate_latest(shared).decode()),
                "single": parse_metrics(generate_latest(single).decode())})
print(json.dumps(out))
"""


def status(version: str, captured: int) -> dict:
    return {"version": version, "path": f"/r/{version}", "pinned_current": None,
            "capture": {"captured": captured, "dropped": 1, "blocks": 10 * captured,
                        "writer": {"buffer_bytes": 4096 * captured, "buffer_segments": captured, "held": 0}}}


TRAINER = {"up": True, "restarts": {"actor": 0, "ray": 1}, "steps": 7, "replayed_tokens": 900, "loss": 1.5,
           "loss_accepted": 1.0, "loss_rejected": 0.5, "train_pool": 40, "held_out_pool": 8,
           "last_gate": {"tau_candidate": 1.4, "tau_serving": 1.2}}
SPECULATION = {"schedule": [[1, 4, 3], [5, 32, 0]], "costs": [[1, 0, 0.02, 10, 0], [1, 3, 0.03, 30, 0]],
               "steps": 100, "explored_steps": 5, "timed_steps": 60, "predicted_tokens_per_s": 50.0,
               "measured_tokens_per_s": 48.0, "acceptance_used": [0.5, 0.25, 0.1], "num_changes": 2}

ROUNDS = [
    {"data": {"status": status("v0001", 5), "trainer": TRAINER, "speculation": SPECULATION},
     "served": [["v0001", 0, 0], ["v0001", 100, 50]]},
    {"data": {"status": status("v0001", 8), "trainer": {**TRAINER, "steps": 9, "loss": 1.25}},
     "served": [["v0001", 300, 100]]},
    # the engine restarted its capture counters (8 -> 2), v0002 serves, the trainer is down,
    # and the policy's schedule changed its batch-size ranges
    {"data": {"status": status("v0002", 2), "trainer": {"up": False, "restarts": {"actor": 0, "ray": 2}},
              "speculation": {**SPECULATION, "schedule": [[1, 2, 4], [3, 32, 0]]}},
     "served": [["v0002", 400, 200]]},
]


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> list[dict]:
    mp_dir = tmp_path_factory.mktemp("prometheus")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(ROUNDS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_the_mirror_shows_what_the_collectors_show(rounds):
    for r in rounds[:2]:
        assert r["mp"] == r["single"]
    assert rounds[0]["mp"]["online_opd_records_captured_total"] == 5
    assert rounds[1]["mp"]["online_opd_records_captured_total"] == 8
    assert rounds[1]["mp"]["online_opd_trainer_steps_total"] == 9
    assert rounds[1]["mp"]["online_opd_trainer_loss{part=total}"] == 1.25
    assert rounds[1]["mp"]["online_opd_served_acceptance_length{version=v0001}"] == pytest.approx(1 + 100 / 300)
    assert rounds[0]["mp"]["online_opd_spec_k{batch_size_range=5-32}"] == 0


def test_a_counter_that_went_down_counts_as_a_reset(rounds):
    assert rounds[2]["single"]["online_opd_records_captured_total"] == 2
    assert rounds[2]["mp"]["online_opd_records_captured_total"] == 8 + 2  # still monotonic for rate()
    assert rounds[2]["mp"]["online_opd_trainer_restarts_total{level=ray}"] == 2


def test_a_gauge_no_longer_yielded_becomes_nan(rounds):
    mp, single = rounds[2]["mp"], rounds[2]["single"]
    assert mp["online_opd_drafter_info{version=v0002}"] == 1
    assert math.isnan(mp["online_opd_drafter_info{version=v0001}"])
    assert "online_opd_drafter_info{version=v0001}" not in single
    assert mp["online_opd_trainer_up"] == single["online_opd_trainer_up"] == 0
    assert math.isnan(mp["online_opd_trainer_loss{part=total}"])
    assert math.isnan(mp["online_opd_spec_k{batch_size_range=1-4}"])
    assert mp["online_opd_spec_k{batch_size_range=1-2}"] == 4
    for key, value in single.items():  # every gauge the collectors yield now is shown as they show it
        if not key.endswith("_total"):
            assert mp[key] == pytest.approx(value), key


@pytest.mark.slow
def test_two_api_servers_share_metrics_one_reloader_and_the_pin(trained_run, tmp_path):
    """`online-opd serve --data-parallel-size 2` (two engines, each with its capture, and one API
    server per rank), with the trainer (configs/test-online.yaml): every request is captured once;
    /metrics, whichever process answers, shows the engines' summed and the trainer's online_opd_*
    figures; API server 0 alone runs the loops; an admin reload reaches every engine and its pin is
    seen through both API servers.

    `--api-server-count 2` with one engine takes the same paths (two API servers in multiprocess
    mode, API server 0 polling, an admin call answered by either): data parallelism adds the second
    engine, so it alone is served here (CI time; the fast tests above cover the mirror itself)."""
    server = ServerProcess(tmp_path / "serve", ROOT / "configs" / "test-online.yaml", "--data-parallel-size", "2",
                           "-o", f"bootstrap.output_dir={trained_run}", "-o", "gate.every_steps=1000000",
                           token=TOKEN)  # no promotion moves CURRENT (the pin is checked against it)
    try:
        server.wait_ready()
        client = openai_client(f"{server.url}/v1")
        model = client.models.list().data[0].id
        num_requests = 6
        for i in range(num_requests):  # a new connection each: the kernel spreads them over both processes
            with openai_client(f"{server.url}/v1") as one:
                one.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                            messages=[{"role": "user", "content": f"Count to {i}."}])
        scrapes = wait_scrapes(server, lambda m: m.get("online_opd_records_captured_total", 0) >= num_requests
                               and m.get("online_opd_trainer_up") == 1, timeout=300)
        deadline = time.monotonic() + 30  # the writers flush every 0.5 s
        while len(records := list(BufferReader(server.buffer).iter_records())) < num_requests:
            assert time.monotonic() < deadline, len(records)
            time.sleep(0.5)
        assert len(records) == len({r.record_id for r in records}) == num_requests
        for m in scrapes:
            assert m["online_opd_records_captured_total"] == num_requests
            assert m["vllm:spec_decode_num_drafts_total"] > 0
            assert m["online_opd_drafter_version"] >= 1
            assert m["online_opd_buffer_segments"] >= 1
            assert m["online_opd_trainer_restarts_total{level=ray}"] == 0
        log = server.tail(400_000)
        assert log.count("API server 0 of 2 polls the engine") == 1, log[-3000:]
        assert log.count("API server 1 of 2: admin routes only") == 1, log[-3000:]
        current = DrafterRegistry(server.run_dir / "registry").current().version
        reply = server.admin("POST", "/reload", json={"path": str(trained_run / "drafter")})
        assert reply.status_code == 200, reply.text
        for _ in range(6):  # either process answers; the pin is the engine's (every engine's)
            status = server.admin("GET", "/status").json()
            assert status["pinned_current"] == current and "versions" not in status, status
    finally:
        assert server.stop() == 0, server.tail()


def wait_scrapes(server: ServerProcess, condition, timeout: float) -> list[dict]:
    """Four scrapes in a row (each answered by either API server) that all meet ``condition``."""
    deadline = time.monotonic() + timeout
    while True:
        scrapes = [server.metrics() for _ in range(4)]
        if all(condition(m) for m in scrapes):
            return scrapes
        assert time.monotonic() < deadline, (scrapes[-1], server.tail())
        time.sleep(2)


def test_engine_statuses_of_data_parallel_ranks_merge():
    """Two engines (--data-parallel-size 2), each with its own capture and writer: counters add up,
    the shared buffer's figures take the freshest tally, and disagreeing versions are listed."""
    from vllm_patches.endpoint import merge_engine_statuses

    def engine(version: str, captured: int, blocks: int, written: int, buffer_bytes: int, segments: int) -> dict:
        return {"version": version, "path": f"/r/{version}", "pinned_current": None,
                "capture": {"captured": captured, "dropped": 1, "blocks": blocks, "in_flight": 2,
                            "writer": {"written_records": written, "write_errors": 0, "held": 0,
                                       "buffer_bytes": buffer_bytes, "buffer_segments": segments}}}

    merged = merge_engine_statuses([engine("v0003", 5, 40, 4, 9000, 3), engine("v0003", 7, 30, 6, 12000, 5)])
    assert merged["version"] == "v0003" and "versions" not in merged
    assert merged["capture"]["captured"] == 12 and merged["capture"]["blocks"] == 70
    assert merged["capture"]["dropped"] == 2 and merged["capture"]["in_flight"] == 4
    assert merged["capture"]["writer"] == {"written_records": 10, "write_errors": 0, "held": 0,
                                           "buffer_bytes": 12000, "buffer_segments": 5}
    split = merge_engine_statuses([engine("v0003", 1, 1, 1, 1, 1), engine("v0002", 1, 1, 1, 1, 1)])
    assert split["version"] == "v0003" and split["versions"] == ["v0003", "v0002"]
    assert merge_engine_statuses([]) is None
    plain = {"version": "v0001", "path": None, "capture": None}  # capture off: engine 0's status as is
    assert merge_engine_statuses([plain]) == plain
