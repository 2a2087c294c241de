"""Tests for online_opd.traces.records: round trip, validation, capture fidelity."""

import json

import pytest

from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity


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
    ],
)
def test_from_dict_names_the_bad_field(field, value, match):
    data = _record(GOOD).to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=match):
        SequenceRecord.from_dict(data)


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
