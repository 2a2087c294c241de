"""The soak's bookkeeping (serve/soak.py) on hand-made requests and records: the record multiset
match, the opt-out rule, the greedy comparison and the reproducible request plan."""

from __future__ import annotations

from online_opd.traces.records import SequenceRecord
from serve.soak import SoakRequest, TrafficSettings, check_soak, plan_request, problems

SETTINGS = TrafficSettings(base_url="http://unused", prompts=[[1, 2, 3], [4, 5]], opt_out_fraction=0.1)


def request(index: int, prompt: int, output: list[int], *, temperature: float = 0.0, opted_out: bool = False,
            error: str | None = None) -> SoakRequest:
    return SoakRequest(index, prompt, temperature, False, opted_out, 0.0, output_ids=output, error=error)


def record(prompt: list[int], output: list[int]) -> SequenceRecord:
    return SequenceRecord(record_id="r", model_id="m", drafter_version="v0001", temperature=0.0, top_p=1.0,
                          top_k=0, tokens=tuple(prompt + output), prompt_len=len(prompt), blocks=())


def test_each_captured_request_is_exactly_one_record():
    requests = [request(0, 0, [7, 8]), request(1, 0, [7, 8]),  # the same answer twice: two records
                request(2, 1, [9], temperature=0.8), request(3, 1, [9], temperature=0.8, opted_out=True),
                request(4, 1, [], error="HTTPStatusError: 500")]
    records = [record([1, 2, 3], [7, 8]), record([4, 5], [9])]
    figures = check_soak(SETTINGS, requests, records, references={0: [7, 8]})
    # one of the twin greedy requests has no record; the opted-out twin is covered by the sampled one
    assert (figures["expected_records"], figures["records"]) == (3, 2)
    assert (figures["missing_records"], figures["extra_records"], figures["failed"]) == (1, 0, 1)
    assert figures["greedy"] == 2 and figures["greedy_mismatches"] == 0
    assert problems(figures) == {"failed": 1, "missing_records": 1}


def test_an_opted_out_request_with_a_record_and_a_wrong_greedy_output_are_found():
    requests = [request(0, 0, [7, 8], opted_out=True), request(1, 1, [9, 9])]
    records = [record([1, 2, 3], [7, 8]), record([4, 5], [9, 9])]
    figures = check_soak(SETTINGS, requests, records, references={1: [9, 8]}, corrupt_segments=2,
                         reloads=[{"ok": True}, {"ok": False}])
    assert problems(figures) == {"extra_records": 1, "greedy_mismatches": 1, "corrupt_segments": 2,
                                 "failed_reloads": 1}


def test_the_request_plan_is_reproducible_and_mixes_everything():
    plans = [plan_request(SETTINGS, i) for i in range(200)]
    again = [plan_request(SETTINGS, i) for i in range(200)]
    key = [(p.prompt_index, p.temperature, p.is_stream, p.is_opted_out) for p in plans]
    assert key == [(p.prompt_index, p.temperature, p.is_stream, p.is_opted_out) for p in again]
    assert sum(p.is_opted_out for p in plans) == 20  # exactly 10%
    assert {(p.temperature, p.is_stream) for p in plans} == {(t, s) for t in (0.0, 0.8) for s in (False, True)}
    assert {p.prompt_index for p in plans} == {0, 1}
