"""Capture (vllm_patches/capture.py) driven by hand-made worker events, in the order vLLM's async
scheduling produces them (GPU; the CPU backend always schedules synchronously): step S is scheduled
(``on_schedule``) and sampled (``snapshot_step``) before the output of step S-1 is read
(``on_output``). Records go through the real writer and buffer.

Request "r" (prompt of 5 tokens, K = 2, greedy) below: tokens from index 5 on are 20, 21, ...; a block
drafted at anchor a proposes the next two tokens, with a wrong token 99 from position r + 1 on.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online_opd.traces.buffer import BufferReader, default_writer_id
from online_opd.traces.records import check_fidelity
from vllm_patches.capture import Capture, CaptureSettings

PROMPT = [10, 11, 12, 13, 14]
K = 2


def token(i: int) -> int:
    return 20 + i - len(PROMPT)


def new_request(rid: str, num_computed_tokens: int = 0) -> SimpleNamespace:
    params = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, max_tokens=None, min_tokens=0,
                             stop_token_ids=[], ignore_eos=True, eos_token_id=None, extra_args=None)
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(PROMPT), sampling_params=params,
                           num_computed_tokens=num_computed_tokens)


class AsyncWorker:
    """Feeds one Capture the worker-side events of async scheduling (or, with ``is_async=False``, of
    synchronous scheduling: each step's output is read before the next step), one request at a time."""

    def __init__(self, cap: Capture, is_async: bool = True):
        self.cap = cap
        self.is_async = is_async
        self.pending = None  # (step, req_ids, sampled) of the step whose output is not read yet
        self.computed = 0  # tokens of "r" whose K/V are computed (the anchor of its next block)

    def step(self, *, new=(), preempted=(), finished=(), scheduled=("r",), r: int | None = None,
             prefill_to: int | None = None, k: int = K) -> None:
        """One engine step of request "r": a prefill up to index `prefill_to` (samples one token), or a
        k-block at the current anchor of which `r` drafts are accepted (k = 0: a plain decode step in a
        speculative batch); or no work for "r"."""
        self.cap.on_schedule(SimpleNamespace(
            scheduled_new_reqs=list(new), preempted_req_ids=set(preempted), finished_req_ids=set(finished),
            num_scheduled_tokens={rid: 1 for rid in scheduled}))
        step, sampled = None, []
        if r is not None:
            a = self.computed
            drafts = [token(a + 1 + j) if j < r else 99 for j in range(k)]
            batch = SimpleNamespace(req_ids=["r"], num_computed_tokens_cpu=np.array([a]))
            step = self.cap.snapshot_step(batch, SimpleNamespace(num_draft_tokens=[k],
                                                                 draft_token_ids=torch.tensor(drafts, dtype=torch.long)))
            sampled = [[token(a + 1 + j) for j in range(r + 1)]]
            self.computed = a + r + 1
        elif prefill_to is not None:
            sampled = [[token(prefill_to + 1)]]
            self.computed = prefill_to + 1
        self.read_output()
        if sampled:
            self.pending = (step, ["r"], sampled)
        if not self.is_async:
            self.read_output()

    def read_output(self) -> None:
        if self.pending is not None:
            self.cap.on_output(*self.pending)
            self.pending = None

    def finish(self, rid: str = "r") -> None:
        self.read_output()
        self.cap.on_schedule(SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(),
                                             finished_req_ids={rid}, num_scheduled_tokens={}))


def capture(tmp_path, version: str = "v1") -> Capture:
    return Capture(CaptureSettings(buffer_dir=str(tmp_path), drafter_version=version, flush_interval_s=0.05))


def records(cap: Capture, tmp_path) -> list:
    cap.close()
    return list(BufferReader(tmp_path).iter_records())


@pytest.mark.parametrize("is_async", [True, False])
def test_preempted_request_yields_a_valid_record(tmp_path, is_async):
    """Async: the preemption reaches the worker while the output of the request's last block before
    it is still in flight; the break goes after that block (anchor 7), not the one before (anchor 5)."""
    cap = capture(tmp_path)
    worker = AsyncWorker(cap, is_async)
    worker.step(new=[new_request("r")], prefill_to=4)  # samples x_5
    worker.step(r=1)  # block at anchor 5
    worker.step(r=2)  # block at anchor 7, its output still in flight when ...
    worker.step(preempted=["r"], scheduled=())  # ... the scheduler preempts "r"
    worker.step(prefill_to=worker.computed)  # resumed: recomputes x_0..x_10, samples x_11
    worker.step(r=0)  # block at anchor 11
    worker.finish()
    [record] = records(cap, tmp_path)
    [segment] = BufferReader(tmp_path).segments()
    assert record.replica == segment.writer_id == default_writer_id()  # host and pid of the capturing process
    assert [(b.anchor, b.num_accepted) for b in record.blocks] == [(5, 1), (7, 2), (11, 0)]
    assert record.events == ({"anchor_before": 7, "kind": "preemption"},)
    assert record.tokens == tuple(PROMPT) + tuple(token(i) for i in range(5, 13))
    assert check_fidelity(record) == []


def test_blocks_carry_the_version_that_drafted_them_across_a_reload(tmp_path):
    """A hot reload between steps, the prefix cache kept: the block verified right after it was drafted
    by the old weights (pure); later blocks by the new weights on context K/V the old ones computed
    (mixed), until a preemption recomputes it. The record stays one chain (no break is marked)."""
    cap = capture(tmp_path)
    worker = AsyncWorker(cap)
    worker.step(new=[new_request("r")], prefill_to=4)
    worker.step(r=1)  # anchor 5: v1
    cap.set_version("v2")
    worker.step(r=1)  # anchor 7: drafted by v1 in the step before the reload
    worker.step(r=0)  # anchor 9: v2 on v1's context
    worker.finish()
    [record] = records(cap, tmp_path)
    assert [(b.anchor, b.drafter_version, b.is_context_pure) for b in record.blocks] == \
        [(5, "v1", True), (7, "v1", True), (9, "v2", False)]
    assert record.drafter_version == "v1" and record.events == ()
    assert check_fidelity(record) == []


def test_a_reload_with_the_cache_reset_gives_a_clean_boundary(tmp_path):
    """The endpoint pauses the engine, resets the prefix cache (preempting every running request) and
    reloads: after the resume every block is drafted by the new weights on context they computed."""
    cap = capture(tmp_path)
    worker = AsyncWorker(cap)
    worker.step(new=[new_request("r")], prefill_to=4)
    worker.step(r=1)  # anchor 5: v1
    worker.read_output()  # the pause waits for the in-flight step
    assert cap.set_version("v2", is_cache_reset=True) == 1  # the request in flight, recomputed by v2
    worker.step(preempted=["r"], prefill_to=worker.computed)  # recomputed by v2, samples x_8
    worker.step(r=2)  # anchor 8: v2
    worker.step(r=0)  # anchor 11: v2
    worker.finish()
    [record] = records(cap, tmp_path)
    assert [(b.anchor, b.drafter_version, b.is_context_pure) for b in record.blocks] == \
        [(5, "v1", True), (8, "v2", True), (11, "v2", True)]
    assert record.events == ({"anchor_before": 5, "kind": "preemption"},)
    assert check_fidelity(record) == []


def test_prefix_cache_hits_after_a_reload_without_reset_are_mixed(tmp_path):
    cap = capture(tmp_path, version="v1")
    cap.set_version("v2")  # blocks computed by v1 may still sit in the prefix cache
    worker = AsyncWorker(cap)
    worker.step(new=[new_request("r", num_computed_tokens=4)], prefill_to=4)  # 4 tokens from the cache
    worker.step(r=1)
    worker.finish()
    cap2 = capture(tmp_path / "fresh", version="v1")
    cap2.set_version("v2")
    worker = AsyncWorker(cap2)
    worker.step(new=[new_request("r")], prefill_to=4)  # no cache hit: all context computed by v2
    worker.step(r=1)
    worker.finish()
    [mixed], [pure] = records(cap, tmp_path), records(cap2, tmp_path / "fresh")
    assert [(b.drafter_version, b.is_context_pure) for b in mixed.blocks] == [("v2", False)]
    assert [(b.drafter_version, b.is_context_pure) for b in pure.blocks] == [("v2", True)]


@pytest.mark.parametrize("is_async", [True, False])
def test_blocks_of_changing_length_and_plain_steps_chain(tmp_path, is_async):
    """K changes per step: a 2-block, a plain step of a batch without speculation (no metadata), a plain
    step of a speculative batch (0 drafts for "r"), a 1-block, a 3-block. The plain steps are counted on
    the next block, so its anchor is exactly a + r + 1 + num_plain_steps."""
    cap = capture(tmp_path)
    worker = AsyncWorker(cap, is_async)
    worker.step(new=[new_request("r")], prefill_to=4)  # samples x_5: the first plain step
    worker.step(r=1, k=2)  # anchor 5
    worker.step(prefill_to=worker.computed)  # no spec_decode_metadata at all: samples x_8
    worker.step(r=0, k=0)  # drafted nothing for "r": samples x_9
    worker.step(r=1, k=1)  # anchor 9
    worker.step(r=0, k=3)  # anchor 11
    worker.finish()
    [record] = records(cap, tmp_path)
    assert [(b.anchor, len(b.draft_tokens), b.num_accepted, b.num_plain_steps) for b in record.blocks] == \
        [(5, 2, 1, 1), (9, 1, 1, 2), (11, 3, 0, 0)]
    assert record.tokens == tuple(PROMPT) + tuple(token(i) for i in range(5, 13))
    assert check_fidelity(record) == []


def test_a_request_that_never_speculated_is_recorded_with_its_tokens(tmp_path):
    cap = capture(tmp_path)
    worker = AsyncWorker(cap)
    worker.step(new=[new_request("r")], prefill_to=4)
    for _ in range(3):
        worker.step(prefill_to=worker.computed)
    worker.finish()
    [record] = records(cap, tmp_path)
    assert record.blocks == () and record.tokens == tuple(PROMPT) + tuple(token(i) for i in range(5, 9))
    assert check_fidelity(record) == []
