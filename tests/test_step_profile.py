"""The step profile's pure parts (vllm_patches/step_profile.py): step kinds from scheduler outputs,
reading the per-process files (a torn last line skipped), the per-kind summary. On the real engine it
runs in tests/test_speculation_serve.py, beside every other hook."""

from __future__ import annotations

import json

import pytest

from tests.helpers.speculation import step
from vllm_patches.step_profile import StepLog, classify, decode_by_shape, read, summarise


def test_classify_names_decode_prefill_and_mixed_steps():
    decode = classify(step({"a": 3, "b": 3}, 2, {"a": 2, "b": 2}))
    assert decode == {"kind": "decode", "b": 2, "prefill_reqs": 0, "prefill_tokens": 0, "decode_tokens": 6,
                      "verified": 4, "k": 2}
    assert classify(step({"a": 1, "b": 1}, 0))["kind"] == "decode"  # plain decode: one token each
    new = step({"a": 40}, 2)
    new.scheduled_new_reqs = [type("New", (), {"req_id": "a"})()]
    assert classify(new) == {"kind": "prefill", "b": 1, "prefill_reqs": 1, "prefill_tokens": 40,
                                  "decode_tokens": 0, "verified": 0, "k": 2}
    # a chunk (or a resumed request) is scheduled more than one token plus its drafts: a prefill
    mixed = classify(step({"a": 3, "b": 17}, 2, {"a": 2}))
    assert (mixed["kind"], mixed["prefill_tokens"], mixed["decode_tokens"]) == ("mixed", 17, 3)
    assert classify(step({}, 0))["kind"] == "idle"


def test_step_log_reads_back_in_time_order_and_skips_a_torn_line(tmp_path):
    log = StepLog(tmp_path / "scheduler-1.jsonl")
    for t, kind, seconds in ((2.0, "decode", 0.03), (1.0, "mixed", 0.09), (3.0, "decode", 0.05)):
        log.add({"kind": kind, "b": 8, "seconds": seconds, "time": t})
    with open(tmp_path / "scheduler-2.jsonl", "w") as f:  # another process, killed mid-line
        f.write(json.dumps({"kind": "prefill", "b": 1, "seconds": 0.2, "time": 0.5}) + "\n" + '{"kind": "dec')
    records = read(tmp_path, "scheduler")
    assert [r["time"] for r in records] == [0.5, 1.0, 2.0, 3.0]
    assert read(tmp_path, "worker") == []
    summary = summarise(records)
    assert summary["decode"] == {"steps": 2, "seconds_total": pytest.approx(0.08), "seconds_mean": 0.04,
                                 "b_mean": 8.0}
    assert summary["mixed"]["steps"] == 1 and summary["prefill"]["seconds_mean"] == 0.2


def test_step_log_reports_an_unwritable_file_once(tmp_path, caplog):
    log = StepLog(tmp_path / "missing-dir" / "worker-1.jsonl")
    log.add({"kind": "decode", "time": 1.0})
    log.add({"kind": "decode", "time": 2.0})
    assert log.errors == 2
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1


def test_decode_by_shape_groups_decode_steps_by_batch_size_and_k():
    records = [{"kind": "decode", "b": 8, "k": 1, "seconds": 0.04, "output_tokens": 13},
               {"kind": "decode", "b": 8, "k": 1, "seconds": 0.05, "output_tokens": 14},
               {"kind": "decode", "b": 8, "k": 0, "seconds": 0.03, "output_tokens": 8},
               {"kind": "mixed", "b": 8, "k": 1, "seconds": 0.2, "output_tokens": 14}]
    rows = decode_by_shape(records)
    assert [(r["b"], r["k"], r["steps"]) for r in rows] == [(8, 0, 1), (8, 1, 2)]
    assert rows[1]["seconds_mean"] == pytest.approx(0.045) and rows[1]["output_tokens_mean"] == 13.5
    assert rows[1]["seconds_per_output_token"] == pytest.approx(0.09 / 27, abs=1e-6)
