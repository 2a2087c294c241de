"""Draft trimming without an engine: the calibration and the keep rule on hand-computed cases, the
outlook, the threshold from step costs, the policy's choice with trimming, the worker hook on a
hand-made batch (confidences from real logits), trimmed blocks in records and segments (kept out of
replay and per-version figures), the policy loop handing thresholds to the worker, and the config and
environment of `online-opd serve --draft-trim`. The real engine: test_draft_trim_serve.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online_opd.config import ConfigError, load_config
from online_opd.speculation.costs import CostModel, StepCosts
from online_opd.speculation.policy import decide
from online_opd.speculation.trim import (
    OUTLOOK_GRID,
    ConfidenceCalibration,
    TrimOutlook,
    confidence_bins,
    outlook_at,
    trim_threshold,
)
from online_opd.traces.buffer import BufferReader, SegmentWriter
from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity, pure_blocks_by_version
from online_opd.train.opd import replayable_blocks
from vllm_patches import DRAFT_TRIM_ENV
from vllm_patches.draft_trim import DraftTrim, DraftTrimSettings, draft_confidence

# ------------------------------------------------------------------------------ calibration and rule


def test_calibration_starts_at_the_bins_own_confidence_and_learns_conditional_acceptance():
    cal = ConfidenceCalibration(max_k=2, prior=4.0)
    assert cal.rates()[0, 9] == pytest.approx(0.95) and cal.rates()[1, 0] == pytest.approx(0.05)
    for _ in range(6):  # position 1 at confidence 0.93 accepted, position 2 at 0.41 rejected
        cal.observe([0.93, 0.41], num_accepted=1)
    cal.observe([0.93, 0.41], num_accepted=0)  # position 1 rejected: position 2 not reached
    # bin 9 of position 1: (6 hits + 4 x 0.95) / (7 + 4); bin 4 of position 2: (0 + 4 x 0.45) / (6 + 4)
    assert cal.rates()[0, 9] == pytest.approx((6 + 3.8) / 11)
    assert cal.rates()[1, 4] == pytest.approx(1.8 / 10)
    assert cal.seen[1].sum() == 6
    survival = cal.survival(np.array([[0.93, 0.41]]))
    assert survival[0].tolist() == pytest.approx([9.8 / 11, 9.8 / 11 * 0.18])
    cal.reset()
    assert cal.seen.sum() == 0 and cal.rates()[0, 9] == pytest.approx(0.95)


def test_keep_lengths_are_the_leading_positions_above_the_threshold():
    cal = ConfidenceCalibration(max_k=4)
    conf = np.array([[0.95, 0.95, 0.95, 0.95],  # survival 0.95, 0.9025, 0.857, 0.815
                     [0.95, 0.15, 0.95, 0.95],  # 0.95, 0.1425, 0.135, 0.129: cut after the second
                     [0.05, 0.99, 0.99, 0.99]])  # 0.05 first: nothing kept at 0.14
    assert cal.keep_lengths(conf, 0.14).tolist() == [4, 2, 0]
    assert cal.keep_lengths(conf, 0.1).tolist() == [4, 4, 0]
    assert cal.keep_lengths(conf, 0.86).tolist() == [2, 1, 0]
    assert cal.keep_lengths(conf, np.array([0.0, 0.5, 0.001])).tolist() == [4, 1, 4]
    assert cal.keep_lengths(conf, 1.0).tolist() == [0, 0, 0]
    assert confidence_bins(np.array([0.0, 0.099, 0.1, 1.0])).tolist() == [0, 0, 1, 9]


def test_outlook_predicts_drafted_and_accepted_tokens_at_a_threshold():
    cal, outlook = ConfidenceCalibration(max_k=2), TrimOutlook(capacity=2)
    assert outlook.expected(cal, 0.5) is None and outlook.summary(cal) == []
    outlook.add(np.array([[0.05, 0.05]]))  # dropped below: capacity 2
    outlook.add(np.array([[0.95, 0.95], [0.75, 0.15]]))  # survival 0.95, 0.9025 | 0.75, 0.1125
    assert len(outlook.blocks) == 2
    drafted, accepted = outlook.expected(cal, 0.5)
    assert drafted == pytest.approx((2 + 1) / 2) and accepted == pytest.approx((0.95 + 0.9025 + 0.75) / 2)
    rows = outlook.summary(cal)
    assert [r[0] for r in rows] == list(OUTLOOK_GRID)
    assert outlook_at(rows, 0.5) == pytest.approx((1.5, 1.30125), abs=1e-4)
    assert outlook_at(rows, 0.52)[0] == 1.5  # the grid row at or above: 0.55
    assert outlook_at(rows, 0.99)[0] == 0.0  # above the grid: its last row (0.95)
    assert outlook_at([], 0.5) is None


def test_threshold_is_the_marginal_cost_of_a_verified_token_in_plain_tokens():
    # t(b, 0) = 0.1, t(b, 4) = 0.18: 0.08 s for 4 more tokens per request = 0.2 of a plain token each
    assert trim_threshold(0.1, 0.18, 4) == pytest.approx(0.2)
    assert trim_threshold(0.1, 0.09, 4) == 0.0
    assert trim_threshold(None, 0.18, 4) is None and trim_threshold(0.1, 0.18, 0) is None


def costs_model() -> CostModel:
    """t(b, K, n) = 0.1 + 0.02 b + 0.005 b K + 0.01 n at b = 1, 2, 4, K = 0 and 4: whole blocks at b = 2,
    blocks trimmed to one token at b = 1 and 4 (n = b)."""
    costs = StepCosts()
    for b, n in ((1, 1), (2, 8), (4, 4)):
        for _ in range(10):
            costs.observe(b, 0, 0.1 + 0.02 * b)
            costs.observe(b, 4, 0.1 + 0.02 * b + 0.005 * b * 4 + 0.01 * n, num_drafted=n)
    return CostModel(costs)


def test_policy_with_trimming_weighs_trimmed_blocks_against_plain_steps():
    model = costs_model()
    assert model.describe() == pytest.approx({"1": 0.1, "b": 0.02, "k": 0.0, "bk": 0.005, "n": 0.01}, abs=1e-9)
    # r_b = (t(b, 4) - t(b, 0)) / (4 t(b, 0)) with whole blocks (0.06 b): r_1 = 0.125 -> grid row 0.15,
    # r_4 = 0.24 / 0.72 = 0.333 -> row 0.35
    rows = [[r, 2.0, 1.0] if r <= 0.15 else [r, 0.5, 0.1] for r in OUTLOOK_GRID]
    decision = decide(model, [0.0] * 4, max_k=4, max_batch_size=4, trim_outlook=rows)
    # b = 1: 1 x 2 / (0.12 + 0.02 + 0.01 x 2) = 12.5 tokens/s against 1 / 0.12 = 8.3: K = 4, trimmed
    # b = 4: 4 x 1.1 / (0.18 + 0.08 + 0.01 x 2) = 15.7 against 4 / 0.18 = 22.2: no speculation
    assert decision.lookup[1] == 4 and decision.lookup[4] == 0
    assert decision.predicted_goodput[1] == pytest.approx(2 / 0.16)
    assert decision.thresholds[1] == pytest.approx(0.125) and decision.thresholds[4] == pytest.approx(1 / 3)
    assert decision.thresholds[0] == 0.0
    close = [[r, 0.5, 1.3] for r in OUTLOOK_GRID]  # 4 x 2.3 / 0.28 = 32.9 vs 22.2: a clear win
    assert decide(model, [0.0] * 4, max_k=4, max_batch_size=4, trim_outlook=close).lookup[4] == 4
    even = [[r, 0.5, 0.6] for r in OUTLOOK_GRID]  # 4 x 1.6 / 0.28 = 22.86: 2.9% above plain's 22.2
    assert decide(model, [0.0] * 4, max_k=4, max_batch_size=4, trim_outlook=even, margin=0.05).lookup[4] == 0
    assert decide(model, [0.0] * 4, max_k=4, max_batch_size=4, trim_outlook=even, margin=0.05,
                  current=[0, 4, 4, 4, 4]).lookup[4] == 4
    # ... but not below plain: 4 x 1.55 / 0.28 = 22.14, 0.3% under plain's 22.2, stops at once
    under = [[r, 0.5, 0.55] for r in OUTLOOK_GRID]
    assert decide(model, [0.0] * 4, max_k=4, max_batch_size=4, trim_outlook=under, margin=0.05,
                  current=[0, 4, 4, 4, 4]).lookup[4] == 0
    # without trimming nothing changes: acceptance 0 never pays, and no thresholds are sent
    untrimmed = decide(model, [0.0] * 4, max_k=4, max_batch_size=4)
    assert untrimmed.lookup == [0, 0, 0, 0, 0] and untrimmed.thresholds is None


def test_without_trimmed_steps_measured_a_trimmed_step_is_priced_as_a_whole_one():
    costs = StepCosts()
    for b in (1, 4):
        for _ in range(10):
            costs.observe(b, 0, 0.1 + 0.02 * b)
            costs.observe(b, 4, 0.1 + 0.02 * b + 0.015 * b * 4)
    model = CostModel(costs)
    assert model.terms == ("1", "b", "k", "bk")  # n = b K everywhere: c4 cannot be told from c3
    assert model.seconds(4, 4, drafted=1) == pytest.approx(model.seconds(4, 4)) == pytest.approx(0.42)
    rows = [[r, 0.5, 1.3] for r in OUTLOOK_GRID]  # would pay at 0.28 s (above), not at 0.42 s
    assert decide(model, [0.0] * 4, max_k=4, max_batch_size=4, trim_outlook=rows).lookup[4] == 0


def test_policy_with_trimming_but_no_blocks_yet_decides_as_without_and_does_not_trim_unknown_costs():
    decision = decide(costs_model(), [0.9, 0.8, 0.7, 0.6], max_k=4, max_batch_size=2, trim_outlook=[])
    assert decision.lookup[1] == 4  # the acceptance profile decides while the outlook is empty
    assert decision.thresholds[1] == pytest.approx(0.125)
    conservative = decide(None, [0.0] * 4, max_k=4, max_batch_size=3, trim_outlook=[])
    assert conservative.thresholds == [0.0, pytest.approx(0.125), 0.0, 0.0]  # b = 1: the prior's cost


def test_cost_model_separates_drafting_from_verifying_once_trimmed_steps_are_measured():
    costs = StepCosts()
    # t = 0.1 + 0.02 b + 0.003 K + 0.004 b K (drafting) + 0.015 n (verifying); trimmed at b = 1 and 4
    for b, n in ((1, 1), (2, 8), (4, 4)):
        for _ in range(10):
            costs.observe(b, 0, 0.1 + 0.02 * b)
            costs.observe(b, 4, 0.1 + 0.02 * b + 0.003 * 4 + 0.004 * 4 * b + 0.015 * n, num_drafted=n)
    model = CostModel(costs, prior_steps=0)
    assert model.describe() == pytest.approx({"1": 0.1, "b": 0.02, "k": 0.003, "bk": 0.004, "n": 0.015}, abs=1e-6)
    assert model.seconds(4, 4, drafted=2) == pytest.approx(0.18 + 0.012 + 0.064 + 0.03)
    assert model.seconds(4, 4) == pytest.approx(0.18 + 0.012 + 0.064 + 0.24)  # whole blocks: n = b K
    row = costs.to_rows()[-1]
    assert row[:2] == [4, 4] and row[6] == pytest.approx(4.0)
    assert StepCosts.from_rows([[2, 3, 0.5, 9, 4.5, 30]]).buckets[(2, 3)].drafted == 6.0  # six columns: b K


# -------------------------------------------------------------------------------------- worker hook


def test_draft_confidence_is_the_top_probability_over_the_draft_logits():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    top = torch.softmax(logits.float(), -1).max(-1).values
    assert draft_confidence(logits).dtype == torch.float32
    assert draft_confidence(logits).tolist() == pytest.approx(top.tolist())
    assert draft_confidence(logits).tolist() == pytest.approx([0.6652, 1 / 3], abs=1e-4)


def fake_runner(req_ids: list[str], confidence: torch.Tensor, k: int = 3):
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=req_ids),
                           drafter=SimpleNamespace(_online_opd_draft_confidence=confidence.reshape(-1)),
                           speculative_config=SimpleNamespace(num_speculative_tokens=k))


def test_worker_trims_blocks_per_request_and_learns_from_their_verification(monkeypatch):
    monkeypatch.setattr("vllm_patches.draft_trim._ngram_fallback", lambda: None)
    trim = DraftTrim(DraftTrimSettings(enabled=True, prior=4.0))
    drafts = torch.tensor([[11, 12, 13], [21, 22, 23]])
    conf = torch.tensor([[0.95, 0.95, 0.35], [0.25, 0.95, 0.95]])
    nothing = SimpleNamespace(scheduled_spec_decode_tokens={})
    # no thresholds yet: nothing trimmed, but the outlook and calibration start
    out = trim.on_proposed(fake_runner(["a", "b"], conf), nothing, [[5], [6]], drafts)
    assert out is drafts and len(trim.outlook.blocks) == 2
    trim.set_thresholds([0.0, 0.3, 0.3])
    # a: survival 0.95, 0.9025, 0.316 > 0.3: whole; b: 0.25 first: nothing kept
    out = trim.on_proposed(fake_runner(["a", "b"], conf), nothing, [[5], [6]], drafts)
    assert out == [[11, 12, 13], []]
    assert trim.drafted_width("a") == 3 and trim.drafted_width("b") == 3
    assert trim.counters["trimmed_blocks"] == 1 and trim.counters["kept_tokens"] == 3 + 3 + 3
    # the next step verifies a's block: 2 of its 3 accepted (sampled: 2 drafts + the bonus, -1 padded)
    verify = SimpleNamespace(scheduled_spec_decode_tokens={"a": [11, 12, 13]})
    trim.set_thresholds([0.0, 0.9, 0.9])
    out = trim.on_proposed(fake_runner(["a", "b"], conf), verify, torch.tensor([[11, 12, 7, -1], [8, -1, -1, -1]]),
                           drafts)
    assert trim.counters["verified_blocks"] == 1 and trim.counters["accepted_tokens"] == 2
    assert trim.calibration.seen[:, 9].tolist() == [1, 1, 0] and trim.calibration.hits[:, 9].tolist() == [1, 1, 0]
    assert trim.calibration.seen[2, 3] == 1 and trim.calibration.hits[2, 3] == 0
    # at 0.9: a's positions 1-2 now (1 + 4 x 0.95) / 5 = 0.96 each (survival 0.9216), position 3
    # (0 + 4 x 0.35) / 5 = 0.28: a keeps two; b nothing
    assert out == [[11, 12], []]
    stats = trim.stats()
    assert stats["thresholds"] == [0.0, 0.9, 0.9] and len(stats["outlook"]) == len(OUTLOOK_GRID)
    assert "outlook" not in trim.stats(with_outlook=False)  # the engine status's polls skip it
    with pytest.raises(ValueError, match="thresholds must be in"):
        trim.set_thresholds([0.0, 1.5])
    # K = 0 (no drafts): nothing pending, no widths; a reload resets the calibration
    assert trim.on_proposed(fake_runner(["a"], torch.zeros(0)), nothing, [[5]], torch.zeros(1, 0)).shape == (1, 0)
    assert trim.drafted_width("a") is None
    trim.reset()
    assert trim.calibration.seen.sum() == 0 and not trim.outlook.blocks


def test_worker_keeps_ngram_blocks_whole(monkeypatch):
    fallback = SimpleNamespace(proposer_of=lambda rid: "ngram" if rid == "b" else "drafter")
    monkeypatch.setattr("vllm_patches.draft_trim._ngram_fallback", lambda: fallback)
    trim = DraftTrim(DraftTrimSettings(enabled=True))
    trim.set_thresholds([0.0, 0.5, 0.5])
    conf = torch.full((2, 2), 0.05)
    out = trim.on_proposed(fake_runner(["a", "b"], conf, k=2), SimpleNamespace(scheduled_spec_decode_tokens={}),
                           [[5], [6]], torch.tensor([[1, 2], [3, 4]]))
    assert out == [[], [3, 4]] and trim.drafted_width("b") is None and trim.drafted_width("a") == 2


# ---------------------------------------------------------------------------------------- records


def trimmed_record() -> SequenceRecord:
    tokens = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    blocks = (BlockRecord(2, (4, 5, 6, 7), 4),  # whole
              BlockRecord(7, (9,), 1, num_drafted=4))  # trimmed to one token, accepted
    return SequenceRecord("r", "m", "v1", 0.0, 1.0, 0, tokens, 3, blocks)


def test_trimmed_blocks_round_trip_pass_fidelity_and_stay_out_of_replay_and_version_figures(tmp_path):
    rec = trimmed_record()
    check_fidelity(rec)
    assert SequenceRecord.from_dict(rec.to_dict()) == rec
    assert rec.blocks[1].drafted_width == 4 and rec.blocks[0].drafted_width == 4
    assert [b.anchor for b in replayable_blocks(rec, 4)] == [2]
    assert [b.anchor for b in pure_blocks_by_version(rec)["v1"]] == [2]
    writer = SegmentWriter(tmp_path, writer_id="t")
    writer.write([rec])
    assert list(BufferReader(tmp_path).iter_records()) == [rec]
    for bad in (1, 0, True, "4"):
        data = rec.to_dict()
        data["blocks"][1]["num_drafted"] = bad
        with pytest.raises(ValueError, match="num_drafted"):
            SequenceRecord.from_dict(data)


# ------------------------------------------------------------------------------- policy loop, config


def test_policy_loop_sends_the_thresholds_to_the_worker():
    from tests.helpers.speculation import FakeEngineClient, fake_engine_core, feed
    from vllm_patches.speculation import set_speculation
    from vllm_patches.speculation_loop import PolicySettings, SpeculationPolicyLoop

    core = fake_engine_core([0, 0, 0, 0, 0])
    set_speculation(core, [[1, 4, 0]])
    control = core.scheduler._online_opd_speculation
    for b in (1, 4):
        feed(control, b, 0, 0.1 + 0.02 * b, 10)
        feed(control, b, 4, 0.1 + 0.02 * b + 0.06 * b, 10)
    trim = DraftTrim(DraftTrimSettings(enabled=True))
    client = FakeEngineClient(core, trim=trim)
    loop = SpeculationPolicyLoop(client, PolicySettings(min_drafts=8, draft_trim=True), lambda: ("v0001", None))
    state = asyncio.run(loop.update())
    assert trim.thresholds[1] == pytest.approx(0.06 / (4 * 0.12)) and len(trim.thresholds) == 5
    assert state["draft_trim"]["thresholds"] == trim.thresholds
    assert client.rpc_calls[0] == ("online_opd_trim", None) and client.rpc_calls[1][1] == trim.thresholds
    asyncio.run(loop.update())  # the same thresholds: read only
    assert client.rpc_calls[2:] == [("online_opd_trim", None)]
    off = FakeEngineClient(core)  # trimming off: no worker RPC at all
    assert asyncio.run(SpeculationPolicyLoop(off, PolicySettings(), lambda: ("v", None)).update())["draft_trim"] is None
    assert off.rpc_calls == []
    missing = FakeEngineClient(core)  # on in the config but not installed in the worker: it answers None
    loop = SpeculationPolicyLoop(missing, PolicySettings(draft_trim=True), lambda: ("v", None))
    assert asyncio.run(loop.update())["draft_trim"] is None and missing.rpc_calls == [("online_opd_trim", None)]


def test_policy_loop_stops_when_the_engine_core_is_gone(caplog):
    """At shutdown (or after an engine crash) the utility call raises vLLM's EngineDeadError: the loop ends
    with one info line instead of logging a traceback and retrying."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from tests.helpers.speculation import FakeEngineClient, fake_engine_core
    from vllm_patches.speculation_loop import PolicySettings, SpeculationPolicyLoop

    class DeadClient(FakeEngineClient):
        async def call_utility_async(self, method: str, *args):
            self.calls.append((method, *args))
            raise EngineDeadError()

    client = DeadClient(fake_engine_core([0, 0]))
    loop = SpeculationPolicyLoop(client, PolicySettings(), lambda: ("v0001", None))
    with caplog.at_level(logging.INFO, logger="online_opd.speculation"):
        asyncio.run(asyncio.wait_for(loop.run_forever(), timeout=10))
    assert len(client.calls) == 1
    ours = [r for r in caplog.records if r.name == "online_opd.speculation"]  # not vLLM's import warnings
    assert [r.levelname for r in ours] == ["INFO"] and "engine core is gone" in ours[0].getMessage()


def test_config_and_environment(tmp_path):
    from serve.server import serve_env

    on = ["serve.draft_trim.enabled=true", "serve.draft_trim.prior=2"]
    env = serve_env(load_config(None, on), Path("/models/t"), tmp_path, capture=False)
    settings = DraftTrimSettings.model_validate_json(env[DRAFT_TRIM_ENV])
    assert settings.enabled and settings.prior == 2.0 and settings.outlook_blocks == 1024
    assert DRAFT_TRIM_ENV not in serve_env(load_config(None, []), Path("/models/t"), tmp_path, capture=False)
    # the auto policy sets thresholds; with always only a fixed one trims, with never nothing is drafted
    for mode in ("always", "never"):
        cfg = load_config(None, on + [f"serve.speculation={mode}"])
        assert DRAFT_TRIM_ENV not in serve_env(cfg, Path("/models/t"), tmp_path, capture=False)
    fixed = load_config(None, on + ["serve.speculation=always", "serve.draft_trim.threshold=0.5"])
    assert DraftTrimSettings.model_validate_json(
        serve_env(fixed, Path("/models/t"), tmp_path, capture=False)[DRAFT_TRIM_ENV]).threshold == 0.5
    trim = DraftTrim(DraftTrimSettings(enabled=True, threshold=0.5))
    trim.set_thresholds([0.0, 0.1, 0.2])  # the policy's are ignored where the config fixes one
    assert trim.threshold_for(1) == trim.threshold_for(32) == 0.5
    with pytest.raises(ConfigError, match="serve.draft_trim.prior"):
        load_config(None, ["serve.draft_trim.prior=0"])


def test_metrics_show_the_trimming_counters_and_thresholds():
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_patches.metrics import PolledCollector

    trim = {"blocks": 10, "trimmed_blocks": 4, "verified_blocks": 9, "drafted_tokens": 40, "kept_tokens": 28,
            "accepted_tokens": 12, "errors": 0, "thresholds": [0.0, 0.05, 0.3]}
    registry = CollectorRegistry()
    registry.register(PolledCollector(lambda: {"version": "v1", "draft_trim": trim}))
    text = generate_latest(registry).decode()
    assert 'online_opd_draft_trim_blocks_total{kind="trimmed"} 4.0' in text
    assert 'online_opd_draft_trim_tokens_total{kind="kept"} 28.0' in text
    assert 'online_opd_draft_trim_threshold{batch_size="2"} 0.3' in text
    registry = CollectorRegistry()
    registry.register(PolledCollector(lambda: {"version": "v1", "draft_trim": None}))
    assert "draft_trim" not in generate_latest(registry).decode()  # off: no series


def test_the_engine_core_times_trimmed_steps_only_with_trimming_on(tmp_path):
    import json

    from serve.server import serve_env
    from vllm_patches import SPECULATION_ENV

    on = serve_env(load_config(None, ["serve.draft_trim.enabled=true"]), Path("/models/t"), tmp_path, capture=False)
    off = serve_env(load_config(None, []), Path("/models/t"), tmp_path, capture=False)
    assert json.loads(on[SPECULATION_ENV])["time_trimmed_steps"] is True
    assert json.loads(off[SPECULATION_ENV])["time_trimmed_steps"] is False
