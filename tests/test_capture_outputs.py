"""Where the capture cuts a request's output ids (vllm_patches/capture.py ``kept_output_ids``): by hand,
and against vLLM's own scheduler loop (``Scheduler._update_request_with_output``, which calls
``check_stop`` after each token) on requests built from real SamplingParams."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from online_opd.traces.buffer import BufferReader
from vllm_patches.capture import Capture, CaptureSettings, kept_output_ids

EOS = 7


@pytest.mark.parametrize("sampled, max_tokens, stop_ids, kept", [
    ([5, 6, 1, 2, 3], 3, set(), [5, 6, 1]),  # cut at max_tokens
    ([5, 6, 1, 2, 3], None, set(), [5, 6, 1, 2, 3]),  # no limit
    ([5, 6, 2, 1, 2], 10, {2}, [5, 6, 2]),  # the first stop id ends the output and is kept
    ([5, 6, 2, 1], 3, {2}, [5, 6, 2]),  # a stop id in the last allowed place
    ([5, 6, 1, 2], 3, {2}, [5, 6, 1]),  # a stop id past max_tokens is never reached
    ([2, 5], 1, {2, 5}, [2]),  # a stop id first of all
    ([], 4, {2}, []),
])
def test_kept_output_ids_by_hand(sampled, max_tokens, stop_ids, kept):
    assert kept_output_ids(sampled, max_tokens, frozenset(stop_ids)) == kept


def _params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 10)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randint(0, max_tokens),
                            stop_token_ids=rng.choice([[], [3], [3, 5]]), ignore_eos=rng.random() < 0.3)
    params.update_from_generation_config({}, eos_token_id=EOS)  # as vLLM's input processor does
    return params


def _vllm_output(request: Request, steps: list[list[int]]) -> list[int]:
    """The output ids vLLM's scheduler keeps when the worker returns `steps` (ids per engine step)."""
    scheduler = SimpleNamespace(max_model_len=10_000)
    for step in steps:
        _, stopped = Scheduler._update_request_with_output(scheduler, request, list(step))
        if stopped:
            break
    return list(request.output_token_ids)


def _split(tokens: list[int], rng: random.Random) -> list[list[int]]:
    """Tokens as engine steps of 1 to 3 ids (a verified block: accepted drafts plus one)."""
    steps = []
    while tokens:
        n = rng.randint(1, 3)
        steps.append(tokens[:n])
        tokens = tokens[n:]
    return steps


def test_captured_outputs_are_the_ones_vllm_returns(tmp_path):
    rng = random.Random(0)
    cap = Capture(CaptureSettings(buffer_dir=str(tmp_path), flush_interval_s=0.05))
    cases = {}  # first prompt id -> (request, worker steps)
    for i in range(300):
        sampled = [rng.randint(0, EOS) for _ in range(rng.randint(1, 14))]
        cases[100 + i] = (Request(f"r{i}", [100 + i, 1, 2], _params(rng), None), _split(sampled, rng))
    # min_tokens masks stop ids when sampling; one that still comes out (every other id masked, e.g. by a
    # grammar) ends the request all the same
    early = SamplingParams(max_tokens=8, min_tokens=5)
    early.update_from_generation_config({}, eos_token_id=EOS)
    cases[99] = (Request("early", [99, 1, 2], early, None), [[4, EOS], [6, 6]])

    schedule = SchedulerOutput.make_empty()
    schedule.scheduled_new_reqs = [NewRequestData.from_request(r, ([],)) for r, _ in cases.values()]
    cap.on_schedule(schedule)
    for request, steps in cases.values():
        for step in steps:  # the worker samples every step; the scheduler may already have stopped
            cap.on_output(None, [request.request_id], [step])
    finished = SchedulerOutput.make_empty()
    finished.finished_req_ids = {r.request_id for r, _ in cases.values()}
    cap.on_schedule(finished)
    cap.close()

    captured = {rec.tokens[0]: list(rec.tokens[rec.prompt_len:]) for rec in BufferReader(tmp_path).iter_records()}
    expected = {first: _vllm_output(request, steps) for first, (request, steps) in cases.items()}
    assert captured == expected
    assert expected[99] == [4, EOS]
    lengths = [len(v) for v in expected.values()]
    assert min(lengths) == 1 and max(lengths) == 10  # both cuts occur, not just one
