"""Tests for online_opd.traces.records: round trip, validation, capture fidelity."""

import dataclasses
import json

import pytest

from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity, pure_blocks_by_version


def _record(blocks, tokens=(1, 2, 3, 10, 11, 12, 20, 21, 22, 23), temperature=0.0, events=()):
    return SequenceRecord(
        record_id="r1", model_id="m", drafter_version="v0", temperature=temperature,
        top_p=1.0, top_k=0, tokens=tuple(tokens), prompt_len=3, blocks=tuple(blocks), events=tuple(events),
    )


# tokens: prompt 1 2 3 | output 10 (bonus, index 3) 11 12 20 21 22 23
GOOD = [
    BlockRecord(anchor=3, draft_tokens=(11, 12, 99), num_accepted=2),  # 20 corrects 99
    BlockRecord(anchor=6, draft_tokens=(21, 22, 23), num_accepted=3),  # all accepted, bonus cut off
]


def test_round_trip_through_json():
    rec = _record(GOOD, events=[{"anchor_before": 6, "kind": "end"}])
    back = SequenceRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert back == rec
    assert isinstance(back.blocks[0].draft_tokens, tuple)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("temperature", "hot", "record.temperature"),
        ("top_k", 1.5, "record.top_k"),
        ("tokens", [1, -2], "record.tokens"),
        ("prompt_len", True, "record.prompt_len"),
        ("record_id", 7, "record.record_id"),
        ("blocks", [{"anchor": 3, "draft_tokens": [1], "num_accepted": "x"}], r"blocks\[0\].num_accepted"),
        ("events", [{"kind": "end"}], r"events\[0\]"),
        ("blocks", [{"anchor": 3, "draft_tokens": [1], "num_accepted": 0, "drafter_version": 2}],
         r"blocks\[0\].drafter_version"),
        ("blocks", [{"anchor": 3, "draft_tokens": [1], "num_accepted": 0, "is_context_pure": 1}],
         r"blocks\[0\].is_context_pure"),
    ],
)
def test_from_dict_names_the_bad_field(field, value, match):
    data = _record(GOOD).to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=match):
        SequenceRecord.from_dict(data)


def test_block_version_and_purity_round_trip_and_default_when_missing():
    blocks = [GOOD[0], BlockRecord(6, (21, 22, 23), 3, drafter_version="v1", is_context_pure=False)]
    rec = _record(blocks)
    assert SequenceRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    old = rec.to_dict()
    for block in old["blocks"]:  # as written before the fields existed
        del block["drafter_version"], block["is_context_pure"]
    back = SequenceRecord.from_dict(old)
    assert [(b.drafter_version, b.is_context_pure) for b in back.blocks] == [(None, True), (None, True)]


def test_pure_blocks_by_version():
    v1_mixed = BlockRecord(6, (21, 22, 23), 3, drafter_version="v1", is_context_pure=False)
    v1 = BlockRecord(8, (22, 23, 5), 1, drafter_version="v1")
    rec = _record([GOOD[0], v1_mixed, v1])  # GOOD[0] has no version of its own: the record's v0
    assert pure_blocks_by_version(rec) == {"v0": [GOOD[0]], "v1": [v1]}


def test_from_dict_missing_field():
    data = _record(GOOD).to_dict()
    del data["model_id"]
    with pytest.raises(ValueError, match="record.model_id is missing"):
        SequenceRecord.from_dict(data)


def test_good_record_passes():
    assert check_fidelity(_record(GOOD)) == []


def test_accepted_tokens_must_match():
    bad = [BlockRecord(3, (11, 13, 99), 2), GOOD[1]]
    assert any("accepted tokens" in e for e in check_fidelity(_record(bad)))


def test_greedy_correction_must_differ_only_at_temperature_zero():
    bad = [BlockRecord(3, (11, 12, 20), 2), GOOD[1]]  # the rejected draft equals the emitted token
    assert any("greedy" in e for e in check_fidelity(_record(bad)))
    assert check_fidelity(_record(bad, temperature=0.7)) == []


def test_chain_and_events():
    gap = [GOOD[0], BlockRecord(7, (22, 23, 5), 2)]  # anchor 7 != 3 + 2 + 1
    assert any("previous anchor + r + 1" in e for e in check_fidelity(_record(gap)))
    assert check_fidelity(_record(gap, events=[{"anchor_before": 3, "kind": "preemption"}])) == []
    back = [GOOD[1], GOOD[0]]
    assert any("does not exceed" in e for e in check_fidelity(_record(back)))


def test_anchor_and_num_accepted_ranges():
    assert any("outside" in e for e in check_fidelity(_record([BlockRecord(1, (2, 3, 10), 0)])))
    assert any("outside" in e for e in check_fidelity(_record([BlockRecord(10, (1, 2, 3), 0)])))
    assert any("num_accepted" in e for e in check_fidelity(_record([BlockRecord(3, (11, 12), 3)])))
    # anchor = prompt_len - 1 is allowed
    assert check_fidelity(_record([BlockRecord(2, (10, 11, 5), 2)])) == []


# K changed per step: tokens 1 2 3 | 10 11 12 20 21 22 23 30 31 32 (indices 0..12). A 2-block at anchor 3
# accepts 11 (12 corrects 99); two plain steps add 20 and 21; a 1-block at anchor 7 accepts 22; the target
# adds 23; a 4-block at anchor 9 accepts 30 31 32 and the request ends there.
MIXED_TOKENS = (1, 2, 3, 10, 11, 12, 20, 21, 22, 23, 30, 31, 32)
MIXED = [
    BlockRecord(anchor=3, draft_tokens=(11, 99), num_accepted=1, num_plain_steps=1),  # the prefill step
    BlockRecord(anchor=7, draft_tokens=(22,), num_accepted=1, num_plain_steps=2),
    BlockRecord(anchor=9, draft_tokens=(30, 31, 32, 40), num_accepted=3),
]


def test_blocks_of_mixed_length_with_plain_steps_between_pass():
    rec = _record(MIXED, tokens=MIXED_TOKENS)
    assert check_fidelity(rec) == []
    assert SequenceRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec


@pytest.mark.parametrize("num_plain_steps", [0, 1, 3])
def test_plain_steps_must_cover_the_gap_exactly(num_plain_steps):
    """5 + 2 = 7: two plain steps between the blocks. Unmarked (0) the gap looks like a lost block."""
    blocks = [MIXED[0], dataclasses.replace(MIXED[1], num_plain_steps=num_plain_steps), MIXED[2]]
    errors = check_fidelity(_record(blocks, tokens=MIXED_TOKENS))
    assert errors == [f"blocks[1]: anchor 7 != previous anchor + r + 1 + num_plain_steps = 3 + 1 + 1 + "
                      f"{num_plain_steps}"]


def test_a_request_served_without_speculation_has_no_blocks_and_passes():
    assert check_fidelity(_record([], tokens=MIXED_TOKENS)) == []


def test_empty_blocks_and_bad_plain_step_counts_are_refused():
    empty = [BlockRecord(anchor=3, draft_tokens=(), num_accepted=0)]
    assert check_fidelity(_record(empty)) == ["blocks[0]: no draft tokens: a block drafts at least one"]
    data = _record(MIXED, tokens=MIXED_TOKENS).to_dict()
    data["blocks"][1]["num_plain_steps"] = -1
    with pytest.raises(ValueError, match=r"record.blocks\[1\].num_plain_steps must be a non-negative int"):
        SequenceRecord.from_dict(data)
    data["blocks"][1]["num_plain_steps"] = None  # older records: no plain steps
    assert SequenceRecord.from_dict(data).blocks[1].num_plain_steps == 0
