"""The speculation policy's serving parts without an engine: the engine-core control on
hand-made scheduler outputs, the runtime schedule swap, the API-server loop against a fake
engine client, the /metrics series and `online-opd serve --speculation` argv and environment."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from online_opd.config import load_config
from online_opd.models.drafters.checkpoint import save_drafter
from online_opd.speculation.acceptance import AcceptanceCounts, estimate_acceptance
from serve.server import serve_env, vllm_argv
from tests.helpers.speculation import FakeEngineClient, fake_engine_core, feed, output, run, step
from tests.tiny import tiny_drafter
from vllm_patches import SPECULATION_ENV
from vllm_patches.endpoint import SERVE_ENV, EndpointSettings
from vllm_patches.metrics import SpeculationCollector, batch_size_bucket
from vllm_patches.speculation import SpeculationControl, SpeculationSettings, set_speculation
from vllm_patches.speculation_loop import PolicySettings, SpeculationPolicyLoop, window_rates


def test_control_times_only_steady_decode_steps_and_counts_acceptance():
    control = SpeculationControl(SpeculationSettings(explore_share=0.0), [0, 2, 2], max_k=2)
    run(control, step({"a": 9}, 2, new=True), output({"a": 1}), 0.0, 0.5)  # prefill: not timed
    run(control, step({"a": 1}, 2), output({"a": 1}), 0.5, 0.6)  # drafts K=2, verifies none: not timed
    run(control, step({"a": 3}, 2, {"a": 2}), output({"a": 3}), 0.6, 0.8)  # steady: 2 accepted
    run(control, step({"a": 3, "b": 3}, 2, {"a": 2, "b": 2}), output({"a": 1, "b": 2}), 0.8, 1.1)
    run(control, step({"a": 3, "b": 1}, 0, {"a": 2}), output({"a": 2, "b": 1}), 1.1, 1.2)  # K 2 -> 0
    run(control, step({"a": 2, "b": 3}, 2, {"a": 1, "b": 2}), output({"a": 2, "b": 1}), 1.2, 1.5)  # a: 1 of 2
    rows = {(r[0], r[1]): r[2:] for r in control.costs.to_rows()}
    assert rows.keys() == {(1, 2), (2, 2)}
    # [seconds, steps, total seconds, output tokens, mean draft tokens verified per step]
    assert rows[(1, 2)] == pytest.approx([0.2, 1, 0.2, 3, 2.0])
    assert rows[(2, 2)] == pytest.approx([0.3, 1, 0.3, 3, 4.0])
    assert (control.counters["steps"], control.counters["timed_steps"]) == (6, 2)
    # the others by whether they drafted: [steps, seconds, output tokens]
    untimed = control.status([0, 2, 2])["untimed"]
    assert untimed["drafting"] == pytest.approx([3, 0.5 + 0.1 + 0.3, 1 + 1 + 3])
    assert untimed["plain"] == pytest.approx([1, 0.1, 3])


def test_control_with_draft_trimming_times_decode_steps_with_their_verified_drafts():
    control = SpeculationControl(SpeculationSettings(explore_share=0.0, time_trimmed_steps=True), [0, 2, 2],
                                 max_k=2)
    run(control, step({"a": 9}, 2, new=True), output({"a": 1}), 0.0, 0.5)  # prefill: not timed
    run(control, step({"a": 1}, 2), output({"a": 1}), 0.5, 0.6)  # drafts K=2, verifies none (n = 0)
    run(control, step({"a": 3}, 2, {"a": 2}), output({"a": 3}), 0.6, 0.8)  # steady: 2 accepted
    run(control, step({"a": 3, "b": 3}, 2, {"a": 2, "b": 2}), output({"a": 1, "b": 2}), 0.8, 1.1)
    run(control, step({"a": 3, "b": 1}, 0, {"a": 2}), output({"a": 2, "b": 1}), 1.1, 1.2)  # K 2 -> 0
    run(control, step({"a": 2, "b": 3}, 2, {"a": 1, "b": 2}), output({"a": 2, "b": 1}), 1.2, 1.5)  # a trimmed
    rows = {(r[0], r[1]): r[2:] for r in control.costs.to_rows()}
    assert rows.keys() == {(1, 2), (2, 2)}
    # [seconds, steps, total seconds, output tokens, mean draft tokens verified per step]
    assert rows[(1, 2)] == pytest.approx([0.15, 2, 0.3, 4, 1.0])
    assert rows[(2, 2)] == pytest.approx([0.3, 2, 0.6, 6, 3.5])
    # blocks (drafted, accepted): (2, 2), (2, 0), (2, 1), (2, 1), (1, 1), (2, 0)
    assert control.acceptance.num_reaching == [6, 5]
    assert control.acceptance.num_accepted == [4, 1]
    assert (control.counters["steps"], control.counters["timed_steps"]) == (6, 4)


def test_control_step_time_starts_at_the_previous_step_end_when_steps_overlap():
    control = SpeculationControl(SpeculationSettings(explore_share=0.0), [0, 0], max_k=1)
    first, second = step({"a": 1}, 0), step({"a": 1}, 0)
    control.on_scheduled(first, 0.0)
    control.on_scheduled(second, 0.1)  # async scheduling: scheduled while the first runs
    control.on_output(first, output({"a": 1}), 0.3)
    control.on_output(second, output({"a": 1}), 0.5)
    assert control.costs.to_rows() == [[1, 0, pytest.approx(0.25), 2, pytest.approx(0.5), 2, 0.0]]


def test_exploration_share_and_k_cycle():
    control = SpeculationControl(SpeculationSettings(explore_share=0.1, explore_steps=3), [0, 0, 0], max_k=3)
    ks = []
    for i in range(200):
        lookup = control.lookup_for_step()
        ks.append(lookup[1])
        assert lookup[0] == 0 and len(set(lookup[1:])) == 1
        control.on_scheduled(step({"a": 1}, lookup[1]), float(i))
        assert control.counters["explored_steps"] <= 0.1 * control.counters["steps"] + 1e-9 or ks[-1] > 0
    # due when explored + 3 <= 0.1 (steps + 3): bursts start after 27, 57, 87, ... steps
    bursts = [i for i in range(1, 200) if ks[i] and not ks[i - 1]]
    assert bursts == [27, 57, 87, 117, 147, 177]
    assert [ks[i] for i in bursts] == [3, 1, 2, 3, 1, 2]
    assert control.counters["explored_steps"] == 18 and control.lookup_for_step() == [0, 0, 0]
    assert SpeculationControl(SpeculationSettings(explore_share=0.0), [0, 0], 2).lookup_for_step() == [0, 0]


def test_exploration_measures_plain_steps_where_the_schedule_speculates():
    """A schedule with K > 0 somewhere: the cycle also runs K = 0 bursts, so the plain step's cost is
    measured under the same load as the speculative ones (else it keeps the cost from before speculation
    switched on); a steady K = 0 burst step is timed into the (b, 0) bucket."""
    control = SpeculationControl(SpeculationSettings(explore_share=0.1, explore_steps=3), [0, 2, 2], max_k=3)
    exploring = []
    for i in range(200):
        k = control.lookup_for_step()[2]
        exploring.append(control.status(None)["exploring_k"])
        run(control, step({"a": 1 + k, "b": 1 + k}, k, {"a": k, "b": k}), output({"a": 1, "b": 1}), i, i + 0.5)
    assert [k for k, _ in itertools.groupby(exploring) if k is not None] == [3, 0, 1, 2, 3, 0]
    steps = {(row[0], row[1]): row[3] for row in control.costs.to_rows()}  # steady steps timed per (b, K)
    assert steps == {(2, 0): 6, (2, 1): 3, (2, 2): 200 - 18 + 3, (2, 3): 6}  # two K = 0 bursts among them


def test_a_new_exploration_share_is_budgeted_over_the_steps_after_it():
    control = SpeculationControl(SpeculationSettings(explore_share=0.5, explore_steps=2), [0, 0], max_k=1)

    def explored_in(num_steps: int) -> int:
        before = control.counters["explored_steps"]
        for i in range(num_steps):
            control.on_scheduled(step({"a": 1}, control.lookup_for_step()[1]), float(i))
        return control.counters["explored_steps"] - before

    assert explored_in(100) == 50  # 50% of the steps
    control.set_explore_share(0.04)
    # over the steps since the change, not all 100 + n: exploring resumes once 2 <= 0.04 (n + 2), n = 48
    assert explored_in(48) == 0 and explored_in(52) == 4
    control.set_explore_share(0.04)  # the same share: the budget keeps counting
    assert explored_in(100) == 4
    control.set_explore_share(0.0)
    assert explored_in(100) == 0 and control.status(None)["explore_share"] == 0.0


def test_set_speculation_refuses_a_bad_exploration_share():
    core = fake_engine_core([0, 0, 0])
    refused = set_speculation(core, [[1, 2, 0]], 0.9)
    assert not refused["ok"] and "explore_share 0.9 refused" in refused["error"]
    assert set_speculation(core, [[1, 2, 0]], 0.05) == {"ok": True, "lookup": [0, 0, 0], "explore_share": 0.05}
    assert core.scheduler._online_opd_speculation.explore_share == 0.05


def test_policy_loop_explores_more_until_acceptance_is_measured_live(caplog):
    core = fake_engine_core([0, 0, 0, 0, 0])
    set_speculation(core, [[1, 4, 0]])
    control = core.scheduler._online_opd_speculation
    for b in (1, 4):
        feed(control, b, 0, 0.1 + 0.02 * b, 10)
    client = FakeEngineClient(core)
    settings = PolicySettings(min_drafts=8, explore_share=0.01, explore_share_unmeasured=0.05)
    loop = SpeculationPolicyLoop(client, settings, lambda: ("v0001", None))
    with caplog.at_level("INFO", logger="online_opd.speculation"):
        state = asyncio.run(loop.update())  # no block verified yet: explore 5%
        assert state["acceptance_source"].startswith("none yet") and control.explore_share == 0.05
        assert client.calls[-1] == ("online_opd_set_speculation", [[1, 4, 0]], 0.05)
        assert loop.num_changes == 0  # the schedule itself did not change
        calls = len(client.calls)
        asyncio.run(loop.update())
        assert len(client.calls) == calls + 1  # the status only: nothing to change
        feed(control, 1, 4, 0.2, 10)  # blocks verified: acceptance measured (0 here)
        state = asyncio.run(loop.update())
        assert state["acceptance_source"].startswith("live") and control.explore_share == 0.01
    assert "speculation exploration: 5.0% of steps (until the serving version's acceptance" in caplog.text
    assert "speculation exploration: 1.0% of steps (acceptance measured live)" in caplog.text
    assert settings.explore_share_for(False) == 0.05
    assert PolicySettings(explore_share=0.1, explore_share_unmeasured=0.05).explore_share_for(False) == 0.1


def test_set_speculation_swaps_the_lookup_and_refuses_bad_schedules():
    core = fake_engine_core([0, 0, 0, 0, 0])
    before = core.scheduler.dynamic_sd_lookup
    result = set_speculation(core, [[1, 1, 4], [2, 4, 0]])
    assert result == {"ok": True, "lookup": [0, 4, 0, 0, 0], "explore_share": 0.01}
    assert core.scheduler.dynamic_sd_lookup == [0, 4, 0, 0, 0] and before == [0, 0, 0, 0, 0]
    assert set_speculation(core, [[1, 2, 9]])["lookup"] == [0, 4, 4, 4, 4]  # clamped to K_max, tail carried
    refused = set_speculation(core, [[2, 4, 1]])
    assert not refused["ok"] and "start at 1" in refused["error"]
    assert core.scheduler.dynamic_sd_lookup == [0, 4, 4, 4, 4]
    plain = SimpleNamespace(scheduler=SimpleNamespace(dynamic_sd_lookup=None, num_spec_tokens=0))
    assert set_speculation(plain, [[1, 1, 0]])["error"].startswith("this engine has no dynamic speculation")
    assert plain.scheduler._online_opd_speculation.lookup_for_step() is None  # timed only


def test_set_speculation_during_exploration_takes_effect_after_the_burst():
    core = fake_engine_core([0, 0, 0])
    set_speculation(core, [[1, 2, 0]])
    control = core.scheduler._online_opd_speculation
    control.settings = SpeculationSettings(explore_share=0.5, explore_steps=2)
    control.set_explore_share(0.5)
    for i in range(2):  # due once explored + 2 <= 0.5 (steps + 2)
        assert control.lookup_for_step() == [0, 0, 0]
        control.on_scheduled(step({"a": 1}, 0), float(i))
    assert control.lookup_for_step() == [0, 4, 4]
    core.scheduler.dynamic_sd_lookup = control.lookup_for_step()
    set_speculation(core, [[1, 1, 2], [2, 2, 0]])
    assert core.scheduler.dynamic_sd_lookup == [0, 4, 4]  # the burst keeps its K
    control.on_scheduled(step({"a": 1}, 4), 0.0)
    control.on_scheduled(step({"a": 1}, 4), 1.0)
    assert control.lookup_for_step() == [0, 2, 0]


def test_policy_loop_turns_speculation_off_where_it_does_not_pay_and_on_where_it_does():
    core = fake_engine_core([0, 4, 4, 4, 4])
    set_speculation(core, [[1, 4, 4]])
    control = core.scheduler._online_opd_speculation
    control.settings = SpeculationSettings(explore_share=0.0)
    # t(b, K) = 0.1 + 0.02 b + 0.015 b K measured at b = 1, 4 and K = 0, 4; the fresh drafter accepts nothing
    for b in (1, 4):
        feed(control, b, 0, 0.1 + 0.02 * b, 10)
        feed(control, b, 4, 0.1 + 0.02 * b + 0.06 * b, 10)
    client = FakeEngineClient(core)
    loop = SpeculationPolicyLoop(client, PolicySettings(min_drafts=8), lambda: ("v0001", None))
    state = asyncio.run(loop.update())
    assert client.calls[-1] == ("online_opd_set_speculation", [[1, 4, 0]], 0.01)  # acceptance measured: 1%
    assert core.scheduler.dynamic_sd_lookup == [0, 0, 0, 0, 0]
    assert state["acceptance_used"] == [0.0] * 4 and state["acceptance_source"].startswith("live")
    # a new version that accepts every draft: tau(4) = 5 > t(b, 4) / t(b, 0) = 1.5 (b=1), 2.33 (b=4)
    loop.serving = lambda: ("v0002", None)
    asyncio.run(loop.update())
    feed(control, 1, 4, 0.18, 10, accepted=4)
    state = asyncio.run(loop.update())
    assert state["schedule"] == [(1, 4, 4)] and core.scheduler.dynamic_sd_lookup == [0, 4, 4, 4, 4]
    assert state["acceptance_used"] == [1.0] * 4 and loop.num_changes == 2
    # measured vs predicted over the last window's steps (b=1, K=4: 5 tokens in 0.18 s each)
    assert state["measured_tokens_per_s"] == pytest.approx(5 / 0.18)
    assert state["predicted_tokens_per_s"] == pytest.approx(5 / 0.18)


def test_estimate_acceptance_sources():
    live = AcceptanceCounts()
    for _ in range(10):
        live.observe(4, 1)
    a, source = estimate_acceptance(live, {}, max_k=4, min_drafts=8)
    assert a == [1.0, 0.0, 0.0, 0.0] and source.startswith("live")
    few = AcceptanceCounts([4, 4], [2, 1])
    a, source = estimate_acceptance(few, {"metrics": {"gate": {"tau_candidate": 1.75}}}, max_k=2, min_drafts=8)
    assert a == pytest.approx([0.5, 0.25]) and "gate" in source  # 1 + a + a^2 = 1.75 at a = 0.5
    a, _ = estimate_acceptance(few, {"metrics": {"live_check": {"tau": 1.0}, "gate": {"tau_candidate": 2}}},
                               max_k=2, min_drafts=8)
    assert a == [0.0, 0.0]  # the served figure wins over the simulated one
    partial = AcceptanceCounts([20, 4], [10, 4])  # position 1 known (0.5), position 2 not: 0.5 * 0.5
    assert estimate_acceptance(partial, {}, max_k=3, min_drafts=8)[0] == pytest.approx([0.5, 0.25, 0.125])
    assert estimate_acceptance(AcceptanceCounts(), {}, max_k=2, min_drafts=8)[0] == [0.0, 0.0]


def _eval_manifest(rates: list, num_drafts: int = 500, **metrics) -> dict:
    return {"metrics": {"eval": {"tau": 2.0, "acceptance_rate_per_position": rates,
                                 "num_drafts": num_drafts, "prompts": "sharegpt"}, **metrics}}


def test_estimate_acceptance_from_the_served_eval_in_the_manifest():
    """`online-opd eval --record`'s per-position acceptance: used as measured (not as a geometric
    profile), extended geometrically past its block size, below live blocks and the gate's figure."""
    served = _eval_manifest([0.4, 0.1, 0.02, 0.001])
    a, source = estimate_acceptance(AcceptanceCounts(), served, max_k=4, min_drafts=32)
    assert a == [0.4, 0.1, 0.02, 0.001] and source == "manifest eval: 500 blocks served on sharegpt"
    assert estimate_acceptance(AcceptanceCounts(), served, max_k=2, min_drafts=32)[0] == [0.4, 0.1]
    a, _ = estimate_acceptance(AcceptanceCounts(), _eval_manifest([0.64]), max_k=3, min_drafts=32)
    assert a == pytest.approx([0.64, 0.64 * 0.64, 0.64 ** 3])  # a_{1+j} = a_1 alpha^j, alpha = a_1
    live = AcceptanceCounts([40], [10])
    assert estimate_acceptance(live, served, max_k=1, min_drafts=32) == ([0.25], "live: 40 blocks since this "
                                                                                  "version started serving")
    a, source = estimate_acceptance(AcceptanceCounts(), _eval_manifest([0.9], gate={"tau_candidate": 1.5}),
                                    max_k=1, min_drafts=32)
    assert a == pytest.approx([0.5]) and "gate" in source  # the deployment's own traffic wins
    for bad in (_eval_manifest([0.4], num_drafts=31), _eval_manifest([]), _eval_manifest([1.5]),
                _eval_manifest(["x"]), {"metrics": {"eval": "tau 2"}}, {"metrics": {"eval": {"num_drafts": 99}}}):
        a, source = estimate_acceptance(AcceptanceCounts(), bad, max_k=2, min_drafts=32)
        assert a == [0.0, 0.0] and source.startswith("none yet")


def test_starting_schedule_speculates_at_batch_size_one_from_the_recorded_eval(tmp_path, caplog):
    """The server's first schedule: a drafter whose recorded served acceptance pays at the prior
    cost ratio gets K > 0 at b = 1 (here K = 1: goodput 1.38 / 1.125 against 1.47 / 1.25 at K = 2)
    and K = 0 above it; without the record, K = 0 everywhere."""
    import json
    import logging

    from online_opd.config import load_config
    from serve.server import starting_schedule

    cfg = load_config(None, [])
    (tmp_path / "manifest.json").write_text(json.dumps(_eval_manifest([0.381, 0.092, 0.015, 0.001])))
    with caplog.at_level(logging.INFO, logger="online_opd.serve"):
        assert starting_schedule(cfg, tmp_path, 4) == [[1, 1, 1], [2, 2, 0]]
    assert "manifest eval: 500 blocks served on sharegpt" in caplog.text
    (tmp_path / "manifest.json").write_text(json.dumps({"metrics": {}}))
    assert starting_schedule(cfg, tmp_path, 4) == [[1, 2, 0]]


def test_policy_loop_waits_for_the_serving_version_before_its_first_update(tmp_path):
    """The service knows the serving drafter's checkpoint only after its first worker status: an
    update before it read no manifest ("none yet": a_k = 0) and turned the starting schedule's K = 1
    at b = 1 off for an interval (seen in the c=1 and c=8 benchmark logs). The loop waits for ``ready``."""
    (tmp_path / "manifest.json").write_text(json.dumps(_eval_manifest([0.381, 0.092, 0.015, 0.001])))
    core = fake_engine_core([0, 1, 0, 0, 0])
    set_speculation(core, [[1, 1, 1], [2, 4, 0]])
    client = FakeEngineClient(core)
    serving: dict = {}  # the service's latest status: empty until its first poll
    ready = asyncio.Event()
    loop = SpeculationPolicyLoop(client, PolicySettings(interval_s=0.05),
                                 lambda: (serving.get("version"), serving.get("path")), ready=ready)

    async def scenario():
        task = asyncio.create_task(loop.run_forever())
        await asyncio.sleep(0.2)  # four intervals: no update while the serving version is unknown
        assert client.calls == [] and loop.latest is None
        serving.update(version="v0001", path=str(tmp_path))
        ready.set()
        for _ in range(100):
            if loop.latest is not None:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert loop.latest["acceptance_source"] == "manifest eval: 500 blocks served on sharegpt"
    assert loop.latest["lookup"][1] == 1 and loop.num_changes == 0  # K = 1 at b = 1 kept: no change


def test_window_rates_compare_measured_and_predicted_over_the_same_steps():
    from online_opd.speculation.costs import CostModel, StepCosts

    before = [[1, 0, 0.1, 10, 1.0, 10]]
    after = [[1, 0, 0.1, 30, 3.0, 30], [2, 0, 0.2, 10, 2.0, 20]]
    model = CostModel(StepCosts.from_rows([[1, 0, 0.1, 30, 3, 30], [2, 0, 0.15, 10, 2, 20]]))
    measured, predicted = window_rates(before, after, model, [0.0])
    assert measured == pytest.approx((20 + 20) / (2.0 + 2.0))
    assert predicted == pytest.approx((20 * 1 + 10 * 2) / (20 * 0.1 + 10 * 0.15))
    assert window_rates(after, after, model, [0.0]) == (None, None)


def test_speculation_series():
    registry = CollectorRegistry()
    state = {"schedule": [(1, 1, 4), (2, 32, 0)], "steps": 200, "explored_steps": 4, "timed_steps": 150,
             "costs": [[1, 0, 0.1, 10, 1, 10], [2, 0, 0.2, 10, 2, 20], [3, 0, 0.4, 30, 12, 90]],
             "measured_tokens_per_s": 9.5, "predicted_tokens_per_s": 10.0, "acceptance_used": [0.5, 0.25],
             "num_changes": 3, "untimed": {"plain": [3, 0.75, 9], "drafting": [2, 0.5, 6]},
             "stored_costs": {"file": "runs/serve/step_costs.json", "used": True, "buckets": 12, "reason": ""}}
    registry.register(SpeculationCollector(lambda: state))
    text = generate_latest(registry).decode()
    assert 'online_opd_policy_stored_cost_buckets 12.0' in text
    assert 'online_opd_spec_k{batch_size_range="1-1"} 4.0' in text
    assert 'online_opd_spec_k{batch_size_range="2-32"} 0.0' in text
    assert 'online_opd_spec_step_seconds{batch_size="2-3",k="0"} 0.35' in text  # (0.2 x 10 + 0.4 x 30) / 40
    assert 'online_opd_spec_exploration_share 0.02' in text
    assert 'online_opd_spec_steps_total{kind="explored"} 4.0' in text
    assert 'online_opd_spec_untimed_seconds_total{kind="drafting"} 0.5' in text
    assert 'online_opd_policy_measured_tokens_per_second 9.5' in text
    assert 'online_opd_policy_acceptance{position="2"} 0.25' in text
    assert [batch_size_bucket(b) for b in (1, 2, 3, 4, 31, 32)] == ["1", "2-3", "2-3", "4-7", "16-31", "32-63"]


def spec_of(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


def test_serve_argv_and_env_per_speculation_mode(tmp_path):
    fresh = save_drafter(tiny_drafter(block_size=4), tmp_path / "fresh", version="v0001")
    good = save_drafter(tiny_drafter(block_size=4), tmp_path / "good", version="v0002",
                        metrics={"gate": {"tau_candidate": 3.0}})
    target = Path("/models/t")

    def argv(drafter: Path, *overrides: str) -> list[str]:
        return vllm_argv(load_config(None, list(overrides)), target, drafter, [])

    assert spec_of(argv(fresh))["num_speculative_tokens_per_batch_size"] == [[1, 2, 0]]
    # gate tau 3.0 at K=4: alpha = 0.741, tau(K) / (1 + 0.125 K) = 1, 1.55, 1.83, 1.96, 2.0 at b = 1
    assert spec_of(argv(good))["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 2, 0]]
    assert "num_speculative_tokens_per_batch_size" not in spec_of(argv(good, "serve.speculation=always"))
    # DFlash's context K/V depend on the prefix alone: a prefix-cache hit keeps its last block
    assert spec_of(argv(fresh))["disable_eagle_block_drop"] is True
    assert spec_of(argv(good, "serve.speculation=always"))["disable_eagle_block_drop"] is True
    never = argv(good, "serve.speculation=never")
    assert spec_of(never) is None and "vllm_patches.worker_ext.OnlineOPDWorkerExtension" in never

    def env(*overrides: str) -> dict[str, str]:
        return serve_env(load_config(None, ["serve.policy_interval_s=2", "serve.policy_explore_share=0.01",
                                            *overrides]), target, fresh, capture=False)

    auto = env()
    assert json.loads(auto[SPECULATION_ENV]) == {"explore_share": 0.01, "explore_steps": 3, "cost_alpha": 0.05,
                                                 "cost_relative_alpha": 0.01, "time_trimmed_steps": False}
    assert EndpointSettings.model_validate_json(auto[SERVE_ENV]).policy.interval_s == 2.0
    for mode in ("always", "never"):
        other = env(f"serve.speculation={mode}")
        assert SPECULATION_ENV not in other and EndpointSettings.model_validate_json(other[SERVE_ENV]).policy is None


# -- K = 0 DFlash steps: context K/V only ---------------------------------------------------------
def test_context_slots_by_hand():
    from vllm_patches.dflash_context import context_slots

    positions = torch.tensor([5, 6, 7, 3, 9])
    query_start_loc = torch.tensor([0, 3, 5])
    block_table = torch.tensor([[10, 11], [20, 21]])
    # request 0: blocks 1 -> 11 * 4 + (1, 2, 3); request 1: block 0 -> 20 * 4 + 3, block 2 clamped to 1 -> 21 * 4 + 1
    assert context_slots(positions, query_start_loc, block_table, 4).tolist() == [45, 46, 47, 83, 85]


def test_context_slots_equal_vllms_dflash_input_kernel():
    from vllm.utils.cpu_triton_utils import _copy_and_expand_dflash_inputs_kernel_impl as kernel

    from vllm_patches.dflash_context import context_slots

    gen = torch.Generator().manual_seed(0)
    for num_reqs, block_size, k in [(1, 16, 0), (3, 4, 0), (5, 8, 2)]:
        counts = torch.randint(1, 6, (num_reqs,), generator=gen)
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        starts = torch.randint(0, 40, (num_reqs,), generator=gen)
        positions = torch.cat([torch.arange(s, s + c) for s, c in zip(starts.tolist(), counts.tolist())])
        block_table = torch.randperm(200, generator=gen)[: num_reqs * 8].view(num_reqs, 8).to(torch.int32)
        n = int(counts.sum())
        ctx_pos, ctx_slot = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        kernel(torch.zeros(num_reqs, dtype=torch.int64), positions, torch.zeros(num_reqs * (1 + k), dtype=torch.int64),
               ctx_pos, torch.zeros(num_reqs * (1 + k), dtype=torch.int64), ctx_slot,
               torch.zeros(num_reqs * (1 + k), dtype=torch.int64), torch.zeros(num_reqs * max(k, 1), dtype=torch.int32),
               block_table, block_table.stride(0), query_start_loc, 0, 7, block_size, 1 + k, k, n)
        assert ctx_pos.tolist() == positions.tolist()
        assert context_slots(positions, query_start_loc, block_table, block_size).tolist() == ctx_slot.tolist()


class _ContextModel:
    """A DFlash stand-in with the two calls the K = 0 path makes: a real linear combine and a cache
    written at the slots (K/V per token: a function of its combined state and its position)."""

    def __init__(self, width: int = 6, num_slots: int = 64):
        gen = torch.Generator().manual_seed(0)
        self.fc = torch.randn(width, 3, generator=gen)
        self.cache = torch.zeros(num_slots, 3)
        self.calls: list[int] = []

    def combine_hidden_states(self, hidden):
        return hidden @ self.fc

    def precompute_and_store_context_kv(self, states, positions, slots):
        self.calls.append(int(positions.numel()))
        self.cache[slots] = states * (1 + positions[:, None].to(states.dtype))


def _k0_step(proposer, positions: list[int], hidden: torch.Tensor, block_table, query_start_loc: list[int]):
    from vllm_patches.dflash_context import store_context_only

    qsl = torch.tensor(query_start_loc)
    cad = SimpleNamespace(query_start_loc=qsl, query_start_loc_cpu=qsl, block_table_tensor=block_table,
                          batch_size=lambda: len(query_start_loc) - 1)
    padded = torch.cat([hidden, torch.full((1, hidden.shape[1]), float("nan"))])  # a padding row past the tokens
    drafts = store_context_only(proposer, torch.tensor(positions + [0]), padded, cad)
    assert drafts.shape == (len(query_start_loc) - 1, 0) and drafts.dtype == torch.int64


def test_k0_context_is_deferred_and_flushed_in_one_pass_equal_to_the_per_step_one():
    from vllm_patches import dflash_context

    gen = torch.Generator().manual_seed(1)
    block_table = torch.tensor([[1, 2, 3], [4, 5, 6]])
    steps = [([4, 9], torch.randn(2, 6, generator=gen)), ([5, 10], torch.randn(2, 6, generator=gen)),
             ([6], torch.randn(1, 6, generator=gen))]
    eager = SimpleNamespace(model=_ContextModel(), block_size=4)
    deferred = SimpleNamespace(model=_ContextModel(), block_size=4)
    for positions, hidden in steps:
        qsl = [0, 1, 2] if len(positions) == 2 else [0, 1]
        _k0_step(deferred, positions, hidden, block_table, qsl)
        _k0_step(eager, positions, hidden, block_table, qsl)
        dflash_context.flush(eager)  # a flush after every step: the per-step pass
    assert deferred.model.calls == [] and bool((deferred.model.cache == 0).all())  # nothing computed yet
    assert dflash_context.stats(deferred) == {"deferred_steps": 3, "flushes": 0, "flushed_tokens": 0,
                                              "pending_tokens": 5}
    assert dflash_context.flush(deferred) == 5 and deferred.model.calls == [5]  # one batched pass
    assert torch.allclose(deferred.model.cache, eager.model.cache, rtol=1e-6, atol=1e-6)
    assert bool((deferred.model.cache[[8, 9, 10, 25, 26]] != 0).all())  # slots 2*4 + (0, 1, 2), 6*4 + (1, 2)
    assert dflash_context.flush(deferred) == 0 and dflash_context.stats(deferred)["flushes"] == 1


def test_a_prefill_sized_step_flushes_the_kept_tokens_first_and_a_full_buffer_flushes():
    from vllm_patches import dflash_context

    block_table = torch.arange(40).view(1, 40)
    proposer = SimpleNamespace(model=_ContextModel(num_slots=160), block_size=4)
    _k0_step(proposer, [3], torch.ones(1, 6), block_table, [0, 1])
    n = dflash_context.DEFER_MAX_TOKENS
    _k0_step(proposer, list(range(3, 3 + n)), torch.full((n, 6), 2.0), block_table, [0, n])
    # the kept token (position 3) first, then the prefill eagerly: the prefill's value of slot 3 wins
    assert proposer.model.calls == [1, n]
    assert torch.equal(proposer.model.cache[3], 2.0 * proposer.model.fc.sum(0) * 4)
    proposer.model.calls.clear()
    for i in range(dflash_context.FLUSH_TOKENS):
        _k0_step(proposer, [100 + i % 50], torch.ones(1, 6), block_table, [0, 1])
    assert proposer.model.calls == [dflash_context.FLUSH_TOKENS]  # flushed when the buffer filled
    assert dflash_context.stats(proposer)["pending_tokens"] == 0


def test_flush_runner_drops_the_kept_tokens_when_the_pass_fails(caplog):
    from vllm_patches import dflash_context

    proposer = SimpleNamespace(model=_ContextModel(), block_size=4)
    _k0_step(proposer, [1], torch.ones(1, 6), torch.tensor([[0, 1]]), [0, 1])
    proposer.model.precompute_and_store_context_kv = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    dflash_context.flush_runner(SimpleNamespace(drafter=proposer))  # logged, not raised into vLLM
    assert dflash_context.stats(proposer)["pending_tokens"] == 0
    dflash_context.flush_runner(SimpleNamespace(drafter=None))  # an engine without a drafter: nothing
