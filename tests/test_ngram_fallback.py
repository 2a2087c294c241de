"""The ngram fallback without an engine: the chooser on hand-computed cases, the worker hook on a
hand-made input batch (vLLM's real prompt-lookup matcher), proposer tags in records and segments,
replay and per-version figures leaving ngram blocks out, the /metrics series and subtraction, and
`online-opd serve --ngram-fallback`'s config and environment. The real engine: test_ngram_fallback_serve.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from online_opd.config import load_config
from online_opd.speculation.hybrid import DRAFTER, NGRAM, ProposerChooser
from online_opd.traces.buffer import SEGMENT_SCHEMA, BufferReader, SegmentWriter, segment_name
from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity, pure_blocks_by_version
from online_opd.train.opd import replayable_blocks
from vllm_patches import NGRAM_FALLBACK_ENV, settings_from_env
from vllm_patches.endpoint import merge_engine_statuses
from vllm_patches.metrics import PolledCollector, drafter_totals
from vllm_patches.ngram_fallback import NgramFallback, NgramFallbackSettings

# ------------------------------------------------------------------------------------------ chooser


def test_without_a_match_the_drafter_drafts():
    chooser = ProposerChooser()
    assert chooser.choose("a", has_match=False) == DRAFTER
    assert len(chooser) == 0  # nothing kept for a request that never matched


def test_an_untried_proposer_is_tried_first_then_the_better_mean_wins():
    chooser = ProposerChooser(explore_every=100)
    assert chooser.choose("a", True) == NGRAM  # neither measured
    chooser.observe("a", NGRAM, 0)
    assert chooser.choose("a", True) == NGRAM  # the drafter is still unmeasured
    chooser.observe("a", DRAFTER, 2)
    assert chooser.choose("a", True) == DRAFTER  # 2 > 0
    chooser.observe("b", NGRAM, 4)  # another request copies
    # b starts from the global ngram mean 0: 0 + 0.3 * 4; the global one moves to 0 + 0.02 * 4
    assert chooser.mean(NGRAM, "b") == pytest.approx(1.2)
    assert chooser.mean(NGRAM) == pytest.approx(0.08)
    assert chooser.choose("b", True) == DRAFTER  # b's ngram 1.2 < the global drafter mean 2
    for _ in range(3):
        chooser.observe("b", NGRAM, 4)
    assert chooser.choose("b", True) == NGRAM  # now 3.04 >= 2
    assert chooser.choose("a", True) == DRAFTER


def test_running_means_follow_hand_computed_values():
    chooser = ProposerChooser(global_alpha=0.5, request_alpha=0.25)
    chooser.observe("a", DRAFTER, 4)  # global: 4; a: starts from None -> 4
    chooser.observe("a", DRAFTER, 0)  # global: 4 + 0.5 * (0 - 4) = 2; a: 4 + 0.25 * (0 - 4) = 3
    chooser.observe("b", DRAFTER, 1)  # b starts from the global mean 2, then 2 + 0.25 * (1 - 2); global 1.5
    assert chooser.mean(DRAFTER, "a") == pytest.approx(3.0)
    assert chooser.mean(DRAFTER, "b") == pytest.approx(1.75)
    assert chooser.mean(DRAFTER) == pytest.approx(1.5)
    assert chooser.mean(DRAFTER, "unknown") == pytest.approx(1.5)
    assert chooser.mean(NGRAM, "a") is None


def test_a_losing_match_is_still_taken_every_explore_every_decisions():
    chooser = ProposerChooser(explore_every=4)
    chooser.observe("a", NGRAM, 0)
    chooser.observe("a", DRAFTER, 3)
    picks = [chooser.choose("a", True) for _ in range(12)]
    assert picks == [DRAFTER, DRAFTER, DRAFTER, NGRAM] * 3
    always = ProposerChooser(explore_every=1)
    always.observe("a", NGRAM, 0)
    always.observe("a", DRAFTER, 3)
    assert always.choose("a", True) == NGRAM


def test_choice_is_monotone_in_the_ngram_acceptance():
    """Higher ngram acceptance never turns a request's choice from ngram to the drafter."""
    def choice(ngram_accepted: int) -> str:
        chooser = ProposerChooser(explore_every=1000)
        chooser.observe("a", DRAFTER, 2)
        chooser.observe("a", NGRAM, ngram_accepted)
        return chooser.choose("a", True)

    picks = [choice(r) for r in range(5)]
    assert picks == [DRAFTER, DRAFTER, NGRAM, NGRAM, NGRAM]


def test_finished_requests_are_forgotten_and_bad_arguments_refused():
    chooser = ProposerChooser()
    for rid in "abc":
        chooser.observe(rid, NGRAM, 1)
    chooser.keep_only({"b"})
    assert len(chooser) == 1 and chooser.mean(NGRAM, "b") is not None
    with pytest.raises(ValueError, match="unknown proposer 'eagle'"):
        chooser.observe("b", "eagle", 1)
    with pytest.raises(ValueError, match="explore_every"):
        ProposerChooser(explore_every=0)
    with pytest.raises(ValueError, match="alpha"):
        ProposerChooser(global_alpha=0.0)


# --------------------------------------------------------------------------------- worker hook


def runner(contexts: list[list[int]], req_ids: list[str], discard: list[bool] | None = None):
    """The input batch fields the hook reads: token ids before this step's samples, their counts."""
    width = 64
    token_ids = np.zeros((len(contexts), width), dtype=np.int32)
    for i, ctx in enumerate(contexts):
        token_ids[i, : len(ctx)] = ctx
    batch = SimpleNamespace(req_ids=req_ids, token_ids_cpu=token_ids,
                            num_tokens_no_spec=np.array([len(c) for c in contexts], dtype=np.int32))
    mask = SimpleNamespace(np=np.array(discard or [False] * len(contexts)))
    return SimpleNamespace(input_batch=batch, discard_request_mask=mask, max_model_len=width)


def sched(verified: dict[str, int]):
    return SimpleNamespace(scheduled_spec_decode_tokens={rid: [0] * n for rid, n in verified.items()})


def test_the_hook_puts_matches_in_and_accounts_the_next_verification():
    hook = NgramFallback(NgramFallbackSettings())
    # "a" repeats 5 6 7 8 9 10 11: after this step's accepted 5 6 the match proposes 7 8 9
    a = [1, 5, 6, 7, 8, 9, 10, 11, 2, 3]
    b = [1, 2, 3, 4]  # no repeat: the drafter's block stays
    c = [5, 6, 7, 8, 5, 6]  # a partial prefill: its sample is discarded
    r = runner([a, b, c], ["a", "b", "c"], discard=[False, False, True])
    sampled = torch.tensor([[5, 6, -1, -1], [9, -1, -1, -1], [7, -1, -1, -1]])
    drafts = torch.tensor([[40, 41, 42], [50, 51, 52], [60, 61, 62]], dtype=torch.int32)
    out = hook.on_proposed(r, sched({}), sampled, drafts)
    assert out.tolist() == [[7, 8, 9], [50, 51, 52], [60, 61, 62]]
    assert out.dtype == torch.int32 and drafts.tolist()[0] == [40, 41, 42]  # the drafter's tensor kept
    assert (hook.proposer_of("a"), hook.proposer_of("b"), hook.proposer_of("c")) == (NGRAM, DRAFTER, DRAFTER)
    assert hook.counters["matches"] == 1 and hook.counters["ngram_proposed"] == 1

    # next step: a verified 3 drafts and accepted 2 (+ bonus), b verified 3 and accepted none
    r2 = runner([a + [5, 6], b + [9]], ["a", "b"])
    sampled2 = torch.tensor([[7, 8, 30, -1], [13, -1, -1, -1]])
    hook.on_proposed(r2, sched({"a": 3, "b": 3}), sampled2, torch.zeros((2, 0), dtype=torch.int32))
    c = hook.counters
    assert (c["ngram_blocks"], c["ngram_accepted"], c["drafter_blocks"], c["drafter_accepted"]) == (1, 2, 1, 0)
    assert hook.chooser.mean(NGRAM, "a") == 2 and hook.chooser.mean(DRAFTER, "b") == 0
    assert hook.proposer_of("a") == DRAFTER  # K = 0 in that step: nothing pending
    assert hook.stats()["ngram_mean"] == 2


def test_settings_from_env_read_validate_and_name_the_variable(monkeypatch):
    monkeypatch.delenv(NGRAM_FALLBACK_ENV, raising=False)
    assert settings_from_env(NGRAM_FALLBACK_ENV, NgramFallbackSettings, "ngram fallback") is None
    monkeypatch.setenv(NGRAM_FALLBACK_ENV, '{"enabled": true, "prompt_lookup_min": 3}')
    assert settings_from_env(NGRAM_FALLBACK_ENV, NgramFallbackSettings, "ngram fallback").prompt_lookup_min == 3
    for bad in ('{"prompt_lookup_min": 5}', "{not json", '{"lookup": 2}'):
        monkeypatch.setenv(NGRAM_FALLBACK_ENV, bad)
        with pytest.raises(ValueError, match="ONLINE_OPD_NGRAM_FALLBACK is not valid ngram fallback settings JSON"):
            settings_from_env(NGRAM_FALLBACK_ENV, NgramFallbackSettings, "ngram fallback")


def test_settings_refuse_an_empty_lookup_range():
    with pytest.raises(ValidationError, match="prompt_lookup_max"):
        NgramFallbackSettings(prompt_lookup_min=4, prompt_lookup_max=2)


# ---------------------------------------------------------------------------- records and replay


def record(blocks) -> SequenceRecord:
    # prompt 1 2 3 | output 10 11 12 20 21 22 23
    return SequenceRecord(record_id="r", model_id="m", drafter_version="v0", temperature=0.0, top_p=1.0,
                          top_k=0, tokens=(1, 2, 3, 10, 11, 12, 20, 21, 22, 23), prompt_len=3,
                          blocks=tuple(blocks), events=())


DRAFTED = BlockRecord(3, (11, 12, 99), 2)
COPIED = BlockRecord(6, (21, 22, 23), 3, proposer=NGRAM)


def test_proposer_round_trips_defaults_to_the_drafter_and_is_validated():
    rec = record([DRAFTED, COPIED])
    assert check_fidelity(rec) == []  # an ngram block keeps the chain and the contract
    assert SequenceRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    old = rec.to_dict()
    del old["blocks"][1]["proposer"]
    assert SequenceRecord.from_dict(old).blocks[1].proposer == DRAFTER
    old["blocks"][1]["proposer"] = "eagle"
    with pytest.raises(ValueError, match=r"blocks\[1\].proposer must be one of"):
        SequenceRecord.from_dict(old)


def test_replay_and_per_version_figures_leave_ngram_blocks_out():
    rec = record([DRAFTED, COPIED])
    assert replayable_blocks(rec, block_size=4) == (DRAFTED,)
    assert pure_blocks_by_version(rec) == {"v0": [DRAFTED]}


def test_segments_keep_the_proposer_and_older_ones_read_as_drafter(tmp_path):
    rec = record([DRAFTED, COPIED])
    SegmentWriter(tmp_path / "new", writer_id="w").write([rec])
    assert list(BufferReader(tmp_path / "new").iter_records()) == [rec]
    # a segment written before the field existed
    old_block = pa.struct([f for f in SEGMENT_SCHEMA.field("blocks").type.value_type if f.name != "proposer"])
    schema = pa.schema([pa.field("blocks", pa.list_(old_block)) if f.name == "blocks" else f for f in SEGMENT_SCHEMA])
    row = rec.to_dict()
    row["blocks"] = [{k: v for k, v in b.items() if k != "proposer"} for b in row["blocks"]]
    row["events"] = json.dumps(row["events"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([row], schema=schema), sink)
    data = sink.getvalue().to_pybytes()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / segment_name(1, "old", 0, hashlib.sha256(data).hexdigest())).write_bytes(data)
    (back,) = BufferReader(tmp_path / "old").iter_records()
    assert back == dataclasses.replace(rec, blocks=(DRAFTED, dataclasses.replace(COPIED, proposer=DRAFTER)))


# ------------------------------------------------------------------------------------- metrics


FALLBACK = {"drafter_blocks": 10, "drafter_accepted": 1, "ngram_blocks": 30, "ngram_accepted": 70,
            "ngram_proposed": 31, "matches": 40, "errors": 0}


def test_live_acceptance_takes_the_ngram_blocks_out_of_vllms_counters():
    assert drafter_totals((40.0, 71.0), {"ngram_fallback": FALLBACK}) == (10.0, 1.0)
    assert drafter_totals((40.0, 71.0), {"ngram_fallback": None}) == (40.0, 71.0)
    assert drafter_totals((40.0, 71.0), None) == (40.0, 71.0)
    assert drafter_totals((29.0, 60.0), {"ngram_fallback": FALLBACK}) == (0.0, 0.0)  # skew: never negative


def test_engines_sum_their_counts_and_metrics_show_them_per_proposer():
    merged = merge_engine_statuses([{"version": "v1", "ngram_fallback": FALLBACK},
                                    {"version": "v1", "ngram_fallback": FALLBACK}])
    assert merged["ngram_fallback"]["ngram_blocks"] == 60 and merged["ngram_fallback"]["matches"] == 80
    registry = CollectorRegistry()
    registry.register(PolledCollector(lambda: merged))
    text = generate_latest(registry).decode()
    assert 'online_opd_ngram_fallback_blocks_total{proposer="ngram"} 60.0' in text
    assert 'online_opd_ngram_fallback_accepted_tokens_total{proposer="drafter"} 2.0' in text
    assert "online_opd_ngram_fallback_matches_total 80.0" in text
    registry = CollectorRegistry()
    registry.register(PolledCollector(lambda: {"version": "v1"}))
    assert "ngram_fallback" not in generate_latest(registry).decode()  # off: no series


# -------------------------------------------------------------------------------------- serving


def test_serve_env_sets_the_fallback_only_where_something_is_drafted(tmp_path):
    from serve.server import serve_env

    on = ["serve.ngram_fallback.enabled=true", "serve.ngram_fallback.prompt_lookup_min=3"]
    env = serve_env(load_config(None, on), Path("/models/t"), tmp_path, capture=False)
    settings = NgramFallbackSettings.model_validate(json.loads(env[NGRAM_FALLBACK_ENV]))
    assert (settings.prompt_lookup_min, settings.prompt_lookup_max, settings.explore_every) == (3, 4, 16)
    assert NGRAM_FALLBACK_ENV not in serve_env(load_config(None, []), Path("/models/t"), tmp_path, capture=False)
    never = serve_env(load_config(None, on + ["serve.speculation=never"]), Path("/models/t"), tmp_path,
                      capture=False)
    assert NGRAM_FALLBACK_ENV not in never
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        load_config(None, ["serve.ngram_fallback.prompt_lookup_min=5"])
