"""A graceful stop writes every captured record. SIGTERM to the serve process alone: vLLM kills the
engine core and the workers outright, so the API server first asks the workers to write what their
buffer writers hold (vllm_patches/endpoint.py ``_flush_before_shutdown``); SIGTERM to the process group
(``ServerProcess.stop``): a stopping worker closes its writer before vLLM ends the process with
``os._exit`` (vllm_patches/capture.py ``_close_on_worker_shutdown``). Before them, the records of the
last ``capture.flush_interval_s`` were lost (2-14 of 204 per server in benchmarks/capture_overhead.py;
all 4 here). The same stop stores the speculation policy's step costs with the steps timed since its last
periodic save (``SpeculationPolicyLoop.save_before_shutdown``): before, vLLM's signal handling left the
policy task running and those steps were lost (one bucket of 70 steps stored, 864 timed, in a `make run`)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from online_opd.traces.buffer import BufferReader
from tests.serving import complete_ids, running

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signalled", ["process_group", "serve_process"])
def test_a_stopped_server_has_written_every_record(trained_run, rollouts, tmp_path, signalled):
    # the writer would flush only after an hour or 100,000 records: only the shutdown writes them
    with running(tmp_path / "serve", "--drafter", str(trained_run / "drafter"), "--no-train",
                 "-o", "capture.flush_interval_s=3600", "-o", "capture.flush_records=100000",
                 "--speculation", "auto", "-o", "serve.policy_interval_s=1") as server:
        outputs = [complete_ids(server, prompt, 8) for prompt, _ in rollouts[:4]]
        reader = BufferReader(server.buffer)
        assert not reader.exists() or not list(reader.iter_records())  # nothing written yet
        if signalled == "serve_process":
            costs = server.run_dir / "step_costs.json"
            deadline = time.monotonic() + 60  # saved at the first update with timed steps, then every minute
            while not costs.exists():
                assert time.monotonic() < deadline, server.tail()
                time.sleep(0.5)
            first = _stored_steps(costs)
            outputs += [complete_ids(server, prompt, 8) for prompt, _ in rollouts[4:6]]
            os.kill(server.proc.pid, signal.SIGTERM)  # well within the minute before the next periodic save
            assert server.proc.wait(150) == 0, server.tail()
            assert "online-opd: captured records written before shutdown" in server.tail(1_000_000)
            assert _stored_steps(costs) > first, server.tail()
    records = list(BufferReader(server.buffer).iter_records())
    assert sorted(len(r.tokens) - r.prompt_len for r in records) == sorted(len(o) for o in outputs)
    assert {tuple(r.tokens[:r.prompt_len]) for r in records} == {tuple(p) for p, _ in rollouts[:len(outputs)]}


def _stored_steps(path) -> int:
    (table,) = json.loads(path.read_text())["tables"]
    return sum(int(row[3]) for row in table["costs"])
