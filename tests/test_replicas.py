"""Two `online-opd serve` replicas, one loop: a shared trace buffer and registry, one Ray cluster.

Real processes: `ray start --head`, then two servers (configs/test-online.yaml, starting from the
memorising drafter of `trained_run`) with the same `capture.buffer_dir` and `serve.registry_dir`
and `online.ray_address`. Traffic on both. Checked: no record lost (each request's record is in the
buffer once, named by the replica that served it), one trainer actor for both, the trainer's first
promotion loaded by both, and a rollback of the registry (what a replica's live check does) loaded
by both.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from online_opd.release.registry import DrafterRegistry
from online_opd.traces.buffer import BufferReader
from serve.clients import openai_client
from serve.launcher import ServerProcess
from tests.ray_cluster import ray_head
from tests.serving import ROOT, TOKEN

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "test-online.yaml"
NUM_REQUESTS = 8  # per replica: 2 of these 16 prompts hash to the held-out side, the gate's minimum


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f}s: {what}"
        time.sleep(1.0)
    return result


def send(server: ServerProcess, tag: str) -> None:
    with openai_client(f"{server.url}/v1") as client:
        model = client.models.list().data[0].id
        for i in range(NUM_REQUESTS):
            client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": f"{tag}: count to {i}."}])


def trainer_stats(server: ServerProcess) -> dict:
    try:
        return json.loads((server.run_dir / "trainer_stats.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def num_loads(server: ServerProcess, version: str) -> int:
    """Hot reloads of ``version`` the replica's engine logged (worker_ext: "drafter A -> B loaded")."""
    return server.tail(2_000_000).count(f"-> {version} loaded")


def test_two_replicas_share_one_buffer_registry_and_trainer(trained_run, tmp_path):
    shared = tmp_path / "shared"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with ray_head(env, num_cpus=2) as address:
        common = ["-o", f"bootstrap.output_dir={trained_run}", "-o", f"capture.buffer_dir={shared / 'buffer'}",
                  "-o", f"serve.registry_dir={shared / 'registry'}", "-o", f"online.ray_address={address}",
                  "-o", "online.num_cpus=1"]
        servers: list[ServerProcess] = []
        try:
            # one after the other (the first publishes the bootstrap drafter as v0001), each engine on a
            # core of its own: vLLM binds every engine's OpenMP threads to core 0 of 2 otherwise
            for core, name in enumerate(("a", "b")):
                servers.append(ServerProcess(tmp_path / name, CONFIG, *common, token=TOKEN,
                                             env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}))
                servers[-1].wait_ready()
            check_the_shared_loop(servers, shared)
        finally:
            codes = [s.stop() for s in servers]
        assert codes == [0] * len(servers), [s.tail() for s in servers]


def check_the_shared_loop(servers: list[ServerProcess], shared: Path) -> None:
    a, b = servers
    for server in servers:
        send(server, server.run_dir.name)
    def all_records():
        records = list(BufferReader(shared / "buffer").iter_records())
        return records if len(records) >= 2 * NUM_REQUESTS else None

    records = wait_for(all_records, 60, "every request's record in the shared buffer")
    assert len({r.record_id for r in records}) == len(records) == 2 * NUM_REQUESTS
    assert sorted(Counter(r.replica for r in records).values()) == [NUM_REQUESTS, NUM_REQUESTS]

    stats = wait_for(lambda: [trainer_stats(s) for s in servers] if all(
        trainer_stats(s).get("up") and len(trainer_stats(s).get("replicas") or []) == 2 for s in servers)
        else None, 300, "both replicas attached to the trainer")
    assert stats[0]["pid"] == stats[1]["pid"]  # one trainer actor for both

    registry = DrafterRegistry(shared / "registry")
    promoted = wait_for(lambda: next((e["version"] for e in registry.history()
                                      if e["event"] == "promote" and e["version"] != "v0001"), None),
                        600, "a promotion by the trainer")
    for server in servers:
        wait_for(lambda: num_loads(server, promoted) >= 1, 120, f"{server.run_dir.name} loads {promoted}")

    before = {s.run_dir.name: {v.version: num_loads(s, v.version) for v in registry.list()} for s in servers}
    back = registry.rollback("test: a replica's live check failed")  # what a replica's live check does
    for server in servers:
        seen = before[server.run_dir.name][back.version]
        wait_for(lambda: num_loads(server, back.version) > seen, 120,
                 f"{server.run_dir.name} loads the rollback target {back.version}")
    # the trainer answers both (a busy trainer can miss one stats line: up reads 0 until the next)
    wait_for(lambda: all(s.metrics().get("online_opd_trainer_up") == 1 for s in (a, b)), 60,
             "the trainer up on both replicas' /metrics")
