"""Step costs kept across restarts (online_opd/speculation/cost_store.py, costs.with_prior), the policy
loop that loads and saves them (vllm_patches/speculation_loop.py, against a fake engine client around
the real engine-core control) and the server's starting schedule and settings (serve/server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from online_opd.config import load_config
from online_opd.models.drafters.checkpoint import save_drafter
from online_opd.speculation import cost_store
from online_opd.speculation.costs import CostModel, StepCosts, with_prior
from serve.server import cost_setup, serve_env, starting_schedule, vllm_argv
from tests.helpers.speculation import FakeEngineClient, fake_engine_core, feed
from tests.tiny import tiny_drafter
from vllm_patches.endpoint import SERVE_ENV, EndpointSettings
from vllm_patches.speculation import SpeculationSettings, set_speculation
from vllm_patches.speculation_loop import PolicySettings, SpeculationPolicyLoop

SETUP = {"machine": "cpu x, 2 cores", "dtype": "float32", "drafter": {"layers": 1}, "max_k": 4}


def costs_of(rows: dict[tuple[int, int], tuple[float, int]]) -> StepCosts:
    """A table with ``(b, K): (seconds, steps)`` buckets that verified whole blocks."""
    costs = StepCosts()
    for (b, k), (seconds, n) in rows.items():
        for _ in range(n):
            costs.observe(b, k, seconds, b * (1 + k))
    return costs


def test_with_prior_counts_a_stored_bucket_as_at_most_its_cap():
    live = costs_of({(1, 0): (0.10, 4), (4, 0): (0.20, 30)})
    stored = costs_of({(1, 0): (0.06, 100), (4, 4): (0.40, 5), (8, 1): (0.30, 50)})
    merged = with_prior(live, stored, max_prior_steps=16)
    b10 = merged.buckets[(1, 0)]
    assert b10.seconds == pytest.approx((4 * 0.10 + 16 * 0.06) / 20) and b10.num_steps == 20
    assert b10.total_seconds == pytest.approx(0.4) and b10.total_tokens == 4  # the live totals
    assert merged.buckets[(4, 0)].seconds == pytest.approx(0.20) and merged.buckets[(4, 0)].num_steps == 30
    assert merged.buckets[(4, 4)].num_steps == 5 and merged.buckets[(4, 4)].total_seconds == 0.0
    assert merged.buckets[(8, 1)].seconds == pytest.approx(0.30) and merged.buckets[(8, 1)].num_steps == 16
    assert merged.buckets[(8, 1)].drafted == pytest.approx(8.0)
    # a cap of 0 uses the live table alone; live steps take over as they accumulate
    assert set(with_prior(live, stored, 0).buckets) == set(live.buckets)
    long_live = costs_of({(1, 0): (0.10, 300)})
    assert with_prior(long_live, stored, 16).buckets[(1, 0)].seconds == pytest.approx(
        (300 * 0.10 + 16 * 0.06) / 316)
    with pytest.raises(ValueError, match="max_prior_steps"):
        with_prior(live, stored, -1)


def test_store_round_trip_per_setup_and_the_fields_that_differ(tmp_path):
    path = tmp_path / "state" / "step_costs.json"
    assert cost_store.load(path, SETUP).costs is None
    assert "no step costs stored" in cost_store.load(path, SETUP).reason
    table = costs_of({(1, 0): (0.05, 20), (8, 1): (0.045, 40)})
    cost_store.save(path, SETUP, table)
    found = cost_store.load(path, SETUP)
    assert found.costs is not None and found.costs.to_rows() == table.to_rows()
    assert "2 (b, K) buckets" in found.reason and found.saved_at is not None
    other = {**SETUP, "dtype": "bfloat16", "drafter": {"layers": 2}}
    missing = cost_store.load(path, other)
    assert missing.costs is None and "the closest differs in drafter, dtype" in missing.reason
    # another setup's table is kept beside this one; saving the same setup replaces its table
    cost_store.save(path, other, costs_of({(1, 0): (0.03, 10)}))
    cost_store.save(path, SETUP, costs_of({(1, 0): (0.07, 10)}))
    tables = json.loads(path.read_text())["tables"]
    assert [t["setup"]["dtype"] for t in tables] == ["float32", "bfloat16"]
    assert cost_store.load(path, SETUP).costs.buckets[(1, 0)].seconds == pytest.approx(0.07)
    assert cost_store.load(path, other).costs.buckets[(1, 0)].seconds == pytest.approx(0.03)
    # at most max_tables setups: the oldest goes
    for i in range(3):
        cost_store.save(path, {**SETUP, "max_k": i}, table, max_tables=3)
    assert [t["setup"]["max_k"] for t in json.loads(path.read_text())["tables"]] == [2, 1, 0]
    assert cost_store.differences({"a": 1, "b": None}, {"a": 1}) == ["b"]


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b'{"format": 99, "tables": []}',
                                     b'{"format": 1, "tables": [{"setup": {}, "costs": [[1, 0]]}]}'])
def test_an_unreadable_cost_file_is_moved_aside_and_replaced(tmp_path, content):
    path = tmp_path / "step_costs.json"
    path.write_bytes(content)
    found = cost_store.load(path, SETUP)
    assert found.costs is None and "is unreadable" in found.reason and "moved to step_costs.json.corrupt-" \
        in found.reason
    aside = list(tmp_path.glob("step_costs.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content  # kept for a look, not lost
    path.write_bytes(content)  # save over a corrupt file: moved aside too, then written
    cost_store.save(path, SETUP, costs_of({(1, 0): (0.05, 20)}))
    assert cost_store.load(path, SETUP).costs is not None


def _engine_with_plain_steps():
    core = fake_engine_core([0, 0, 0, 0, 0, 0, 0, 0, 0])
    set_speculation(core, [[1, 8, 0]])
    control = core.scheduler._online_opd_speculation
    control.settings = SpeculationSettings(explore_share=0.0)
    return core, control


def test_policy_loop_starts_from_the_stored_costs_of_its_setup_and_saves_its_own(tmp_path, caplog):
    """A fresh engine has timed plain steps only: with an empty table the policy is conservative (K = 0
    above batch size 1). With the costs an earlier server stored for this setup (a K = 1 step at b = 8
    costs 1.2 plain steps) and a drafter accepting 60% at position 1 (tau(1) = 1.6), it speculates at
    b = 8 from its first update; it saves the merged table, which a later server reads."""
    path = tmp_path / "step_costs.json"
    stored = costs_of({(b, k): (0.03 + 0.005 * b + 0.002 * b * k, 200) for b in (1, 2, 4, 8) for k in (0, 1, 2)})
    cost_store.save(path, SETUP, stored)
    manifest = tmp_path / "v0001"
    manifest.mkdir()
    (manifest / "manifest.json").write_text(json.dumps({"metrics": {"eval": {
        "tau": 1.6, "acceptance_rate_per_position": [0.6, 0.2, 0.05, 0.01], "num_drafts": 500,
        "prompts": "sharegpt"}}}))

    def loop_for(setup: dict, core) -> SpeculationPolicyLoop:
        settings = PolicySettings(min_drafts=8, explore_share=0.0, explore_share_unmeasured=0.0,
                                  costs_file=str(path), costs_setup=setup)
        return SpeculationPolicyLoop(FakeEngineClient(core), settings, lambda: ("v0001", str(manifest)))

    core, control = _engine_with_plain_steps()
    for b in (1, 8):
        feed(control, b, 0, 0.03 + 0.005 * b, 10)
    with caplog.at_level(logging.INFO, logger="online_opd.speculation"):
        state = asyncio.run(loop_for(SETUP, core).update())
    assert "speculation step costs: 12 (b, K) buckets from" in caplog.text
    assert state["stored_costs"]["used"] and state["stored_costs"]["buckets"] == 12
    assert state["schedule"] == [(1, 3, 2), (4, 8, 1)]  # tau(1) 1.6 against a break-even 1.16 at b = 4
    assert core.scheduler.dynamic_sd_lookup == [0, 2, 2, 2, 1, 1, 1, 1, 1]
    # the same engine state without a stored table for this setup: conservative, K = 0 above b = 1
    other_core, other_control = _engine_with_plain_steps()
    for b in (1, 8):
        feed(other_control, b, 0, 0.03 + 0.005 * b, 10)
    with caplog.at_level(logging.INFO, logger="online_opd.speculation"):
        cold = asyncio.run(loop_for({**SETUP, "dtype": "bfloat16"}, other_core).update())
    assert "starting from an empty table (the 1 table(s) in" in caplog.text
    assert other_core.scheduler.dynamic_sd_lookup[2:] == [0] * 7 and not cold["stored_costs"]["used"]
    # the first loop's table was saved, merged: live (1, 0) steps beside the stored ones
    saved = cost_store.load(path, SETUP).costs
    assert saved.buckets[(1, 0)].num_steps == 26  # 10 live steps and the stored bucket's 16
    assert saved.buckets[(1, 0)].seconds == pytest.approx(0.035)  # live and stored agree here
    assert saved.buckets[(8, 1)].seconds == pytest.approx(0.03 + 0.04 + 0.016)
    assert cost_store.load(path, {**SETUP, "dtype": "bfloat16"}).costs.buckets.keys() == {(1, 0), (8, 0)}


def test_policy_loop_saves_only_after_new_timed_steps_and_survives_an_unwritable_file(tmp_path, caplog):
    core, control = _engine_with_plain_steps()
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the costs' folder should be")
    settings = PolicySettings(costs_file=str(blocked / "step_costs.json"), costs_setup=SETUP, costs_save_s=1e-9)
    loop = SpeculationPolicyLoop(FakeEngineClient(core), settings, lambda: ("v0001", None))
    asyncio.run(loop.update())  # nothing timed yet: nothing to save
    assert loop._saved[1] == -1
    feed(control, 1, 0, 0.05, 10)
    with caplog.at_level(logging.WARNING, logger="online_opd.speculation"):
        state = asyncio.run(loop.update())
    assert "speculation step costs not saved to" in caplog.text and state["schedule"]  # still deciding
    path = tmp_path / "ok" / "step_costs.json"
    loop.settings = settings.model_copy(update={"costs_file": str(path)})
    asyncio.run(loop.update())  # no step timed since the failed attempt: waits for new ones
    assert not path.exists()
    feed(control, 1, 0, 0.05, 5)
    asyncio.run(loop.update())
    assert cost_store.load(path, SETUP).costs.buckets[(1, 0)].num_steps == 15


def test_a_stopping_server_stores_the_steps_timed_since_the_last_save(tmp_path, caplog):
    """vLLM's SIGTERM handling stops the engine without cancelling the policy task: the engine client's
    shutdown (endpoint.py) calls ``save_before_shutdown``, which reads the engine's table once more."""
    core, control = _engine_with_plain_steps()
    path = tmp_path / "step_costs.json"
    client = FakeEngineClient(core)
    loop = SpeculationPolicyLoop(client, PolicySettings(costs_file=str(path), costs_setup=SETUP),
                                 lambda: ("v0001", None))
    feed(control, 1, 0, 0.05, 10)
    asyncio.run(loop.update())  # the first update with timed steps saves
    feed(control, 1, 0, 0.05, 5)
    asyncio.run(loop.update())  # within the minute (costs_save_s = 60): not saved
    assert cost_store.load(path, SETUP).costs.buckets[(1, 0)].num_steps == 10
    feed(control, 1, 0, 0.05, 7)
    asyncio.run(loop.save_before_shutdown(5.0))
    assert cost_store.load(path, SETUP).costs.buckets[(1, 0)].num_steps == 22
    # an engine that no longer answers: the table the last update read is stored
    fresh = tmp_path / "other.json"
    loop = SpeculationPolicyLoop(client, PolicySettings(costs_file=str(fresh), costs_setup=SETUP,
                                                        costs_save_s=3600.0), lambda: ("v0001", None))
    loop._saved = (float("inf"), -1)  # no periodic save in this test
    asyncio.run(loop.update())
    assert not fresh.exists()

    async def gone(*args):
        raise RuntimeError("engine core is dead")

    client.call_utility_async = gone
    with caplog.at_level(logging.INFO, logger="online_opd.speculation"):
        asyncio.run(loop.save_before_shutdown(1.0))
    assert "the engine did not answer before shutdown" in caplog.text
    assert cost_store.load(fresh, SETUP).costs.buckets[(1, 0)].num_steps == 22


def test_starting_schedule_and_settings_from_the_stored_costs(tmp_path, caplog):
    cfg = load_config(None, [f"serve.run_dir={tmp_path / 'serve'}"])
    drafter = save_drafter(tiny_drafter(block_size=4), tmp_path / "d", version="v0001",
                           metrics={"gate": {"tau_candidate": 2.0}})
    setup = cost_setup(cfg, Path("/models/t"), drafter, ["--max-num-seqs", "16"], capture=True)
    assert setup["max_k"] == 4 and setup["drafter"]["block_size"] == 4
    assert setup["machine"].endswith(" cores") or "x " in setup["machine"]  # a CPU, or GPUs by name
    assert setup["engine"]["passthrough"] == ["--max-num-seqs", "16"] and setup["capture"] is not None
    assert json.loads(json.dumps(setup)) == setup  # compared with what the file gives back
    assert cost_setup(cfg, Path("/models/t"), drafter, [], capture=False)["capture"] is None
    with caplog.at_level(logging.INFO, logger="online_opd.serve"):
        # conservative: gate tau 2.0 (alpha 0.52) at the prior ratio 1 + 0.125 K: K = 2 at b = 1 alone
        assert starting_schedule(cfg, drafter, 4, setup) == [[1, 1, 2], [2, 2, 0]]
    assert "no stored step costs used (no step costs stored in" in caplog.text
    # tau 2.0 at K = 4 (alpha 0.52): K = 2 pays at every batch size when a K-token step costs 1 + 0.1 K
    stored = costs_of({(b, k): ((0.03 + 0.005 * b) * (1 + 0.1 * k), 50) for b in (1, 4, 8) for k in range(5)})
    cost_store.save(cfg.serve.costs_file, setup, stored)
    with caplog.at_level(logging.INFO, logger="online_opd.serve"):
        schedule = starting_schedule(cfg, drafter, 4, setup)
    # tau(K) / (1 + 0.1 K) = 1.38, 1.49, 1.48, 1.43 for K = 1..4: K = 2, through the largest b stored + 1
    assert "from the stored step costs" in caplog.text and schedule == [[1, 9, 2]]
    spec = json.loads(vllm_argv(cfg, Path("/models/t"), drafter, [], setup)[
        vllm_argv(cfg, Path("/models/t"), drafter, [], setup).index("--speculative-config") + 1])
    assert spec["num_speculative_tokens_per_batch_size"] == schedule
    policy = EndpointSettings.model_validate_json(
        serve_env(cfg, Path("/models/t"), drafter, capture=False, setup=setup)[SERVE_ENV]).policy
    assert policy.costs_file == str((tmp_path / "serve" / "step_costs.json").resolve())
    assert policy.costs_setup == setup and policy.stored_cost_steps == 16
    # off: no file, no setup; the starting schedule ignores what is stored
    off = load_config(None, [f"serve.run_dir={tmp_path / 'serve'}", "serve.policy_remember_costs=false"])
    assert starting_schedule(off, drafter, 4, setup) == [[1, 1, 2], [2, 2, 0]]
    assert EndpointSettings.model_validate_json(
        serve_env(off, Path("/models/t"), drafter, capture=False)[SERVE_ENV]).policy.costs_file is None
    model = CostModel(with_prior(StepCosts(), stored, 16))
    assert model.knows_speculation and model.seconds(8, 2) == pytest.approx(0.07 * 1.2, rel=1e-6)
