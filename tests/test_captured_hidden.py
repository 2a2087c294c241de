"""The target's features in records (``SequenceRecord.hidden``, capture.hidden_sample_rate): the record and
buffer round trip, the capture's join of a request's per-step rows, and replay from them (no target
forward) against replay with the target's own forward. On vLLM's real CPU engine the captured rows are
checked against a Hugging Face forward by the slow test in test_teacher_capture.py."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from online_opd.opd.losses import draft_opd_loss
from online_opd.opd.replay import replay_sequence, sequence_aux
from online_opd.opd.rollout import simulated_record
from online_opd.opd.specdec import target_generate
from online_opd.opd.teacher_rows import top_k_teacher
from online_opd.traces.buffer import SEGMENT_SCHEMA, BufferReader, decode_segment, encode_segment
from online_opd.traces.records import BlockRecord, SequenceRecord
from online_opd.traces.target_signal import TargetHidden
from online_opd.train.opd import replay_records
from tests.test_teacher_capture import new_request, run_step, schedule
from tests.test_teacher_signal import PROMPT, K  # the target and drafter fixtures: conftest.py
from tests.tiny import VOCAB
from vllm_patches.capture import Capture, CaptureSettings
from vllm_patches.capture_features import join_hidden


@pytest.fixture(scope="module")
def record(target, drafter):
    """A greedy sequence with three blocks (the last anchored at T - 2), every block with its full teacher."""
    tokens = torch.tensor(target_generate(target, PROMPT, 14))  # T = 20
    T = len(tokens)
    blocks = []
    for anchor, r in ((len(PROMPT) - 1, 1), (len(PROMPT) + 3, 2), (T - 2, 0)):
        draft = [int(t) for t in tokens[anchor + 1:anchor + 1 + r]] + [(int(tokens[min(anchor + 1 + r, T - 1)]) + 1)
                                                                       % VOCAB]
        draft += [7] * (K - len(draft))
        seq = torch.cat([tokens[: anchor + 1], torch.tensor(draft)])
        teacher = top_k_teacher(target.forward(seq).logits[anchor:], VOCAB)
        blocks.append(BlockRecord(anchor, tuple(draft), r, teacher=teacher))
    return SequenceRecord("r", "m", "v", 0.0, 1.0, 0, tuple(tokens.tolist()), len(PROMPT), tuple(blocks))


def features(target, drafter, tokens) -> torch.Tensor:
    """The target's aux hidden states [T, F] at every sequence position (what vLLM hands the drafter)."""
    layer_ids = tuple(drafter.target_layer_ids)
    return target.forward(tokens, layer_ids, logits_at=tokens.new_empty(0, dtype=torch.long)).aux_hidden


# ---------------------------------------------------------------- records and buffer


def test_hidden_round_trips_through_json_and_segments(target, drafter, record):
    tokens = torch.tensor(record.tokens)
    rows = features(target, drafter, tokens)[2:-1].to(torch.bfloat16)  # positions 2..T-2
    rec = dataclasses.replace(record, hidden=TargetHidden.from_tensor(2, rows))
    assert rec.hidden.num_rows == len(tokens) - 3 and rec.hidden.end == len(tokens) - 1
    assert torch.equal(rec.hidden.to_tensor(), rows)
    assert SequenceRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    [back, plain] = decode_segment(encode_segment([rec, record]))
    assert back == rec and plain.hidden is None
    assert torch.equal(back.hidden.to_tensor(), rows)


def test_segments_written_before_the_hidden_columns_still_read(record):
    old = pa.schema([f for f in SEGMENT_SCHEMA if not f.name.startswith("hidden_")])
    table = pq.read_table(pa.BufferReader(encode_segment([record]))).select(old.names)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    [back] = decode_segment(sink.getvalue().to_pybytes())
    assert back == record and back.hidden is None


def test_bad_hidden_is_refused_with_the_field_named(record):
    rows = torch.zeros(3, 8, dtype=torch.float16)
    good = TargetHidden.from_tensor(1, rows)
    with pytest.raises(ValueError, match="whole number"):
        TargetHidden(1, 8, "float16", good.data[:-2])
    with pytest.raises(ValueError, match="dtype"):
        TargetHidden(1, 8, "int8", good.data)
    with pytest.raises(ValueError, match="start"):
        TargetHidden(-1, 8, "float16", good.data)
    with pytest.raises(ValueError, match="base64"):
        SequenceRecord.from_dict({**record.to_dict(), "hidden": {**good.to_dict(), "data": "not base64!"}})
    T = len(record.tokens)
    with pytest.raises(ValueError, match="features up to position"):  # a row for the last token: none exists
        dataclasses.replace(record, hidden=TargetHidden.from_tensor(T - 3, torch.zeros(3, 8)))
    nan = torch.zeros(2, 8)
    nan[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        TargetHidden.from_tensor(0, nan).to_tensor()


def test_capture_settings_need_the_teacher_for_hidden(tmp_path):
    with pytest.raises(ValueError, match="teacher_top_k"):
        CaptureSettings(buffer_dir=str(tmp_path), hidden_sample_rate=0.5)
    assert CaptureSettings(buffer_dir=str(tmp_path), teacher_top_k=8, hidden_sample_rate=0.5).hidden_sample_rate == 0.5


# ---------------------------------------------------------------- the capture's join of per-step rows


def part(positions, rows):
    return torch.tensor(positions), torch.tensor(rows, dtype=torch.float32)[:, None].expand(-1, 2), (None, None)


def test_join_keeps_the_last_row_per_position_and_starts_after_the_last_gap():
    """Prefill of positions 0-3, a step at 3 with drafts at 4-6 (4 rejected: rows 4-6 are the drafts'), the
    next step at 4 (the target's token) with drafts 5-6, then position 7; 8 tokens: rows 0..6 are kept."""
    parts = [part([0, 1, 2, 3], [0, 1, 2, 3]), part([3, 4, 5, 6], [30, 99, 99, 99]),
             part([4, 5, 6], [40, 50, 60]), part([7], [70])]
    hidden = join_hidden(parts, 7)
    assert (hidden.start, hidden.num_rows) == (0, 7)
    assert hidden.to_tensor()[:, 0].tolist() == [0, 1, 2, 30, 40, 50, 60]
    # positions 0-1 came from the prefix cache (no rows) and 4 fell in a step without the drafter
    gap = [part([2, 3], [2, 3]), part([5, 6], [5, 6])]
    hidden = join_hidden(gap, 7)
    assert (hidden.start, hidden.to_tensor()[:, 0].tolist()) == (5, [5, 6])
    assert join_hidden([part([0, 1], [0, 1])], 4) is None  # position 3 never ran
    nan = [part([0, 1, 2], [0, float("nan"), 2])]
    assert join_hidden(nan, 3) is None
    assert join_hidden([], 3) is None and join_hidden(parts, 0) is None


def context(cap: Capture, rows: dict[str, list[int]]) -> None:
    """One step's features as DFlashProposer.propose receives them: request by request, the row at
    position p holds 100 * (its index in the step) + p in every column."""
    positions = [p for ps in rows.values() for p in ps]
    owner = [i for i, ps in enumerate(rows.values()) for _ in ps]
    bounds = torch.tensor([0, *torch.tensor([len(ps) for ps in rows.values()]).cumsum(0).tolist()])
    hidden = (torch.tensor(owner) * 100 + torch.tensor(positions)).to(torch.bfloat16)[:, None].expand(-1, 3)
    cap.on_context(list(rows), torch.tensor(positions), bounds, hidden.contiguous())


def test_capture_keeps_each_requests_rows_for_its_record(tmp_path):
    """Prefill rows 0-4 of "a" and "b"; a step verifies "a"'s 2-token block at positions 5-7 (one accepted):
    its record of 8 tokens keeps rows 0-6 (7, the rejected draft's, is past its last fed token); "b" (a plain
    record of 6 tokens) rows 0-4. A capture without the features keeps none."""
    cap = Capture(CaptureSettings(buffer_dir=str(tmp_path), teacher_top_k=4, hidden_sample_rate=1.0,
                                  flush_interval_s=0.05, seed=0))
    schedule(cap, new=[new_request("a"), new_request("b")])
    context(cap, {"a": [0, 1, 2, 3, 4], "b": [0, 1, 2, 3, 4]})
    cap.on_output(None, ["a", "b"], [[6], [6]])
    context(cap, {"a": [5, 6, 7]})
    run_step(cap, ["a"], [2], torch.randn(3, 32))
    schedule(cap, finished=["a", "b"])
    cap.close()
    records = {len(r.tokens): r for r in BufferReader(tmp_path).iter_records()}
    assert records[8].hidden.start == 0 and records[8].hidden.to_tensor()[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert records[6].hidden.to_tensor()[:, 2].tolist() == [100, 101, 102, 103, 104]
    assert records[8].blocks[0].teacher is not None
    assert cap.stats()["hidden_records"] == 2 and cap.stats()["hidden_rows"] == 12

    off = Capture(CaptureSettings(buffer_dir=str(tmp_path / "off"), teacher_top_k=4, flush_interval_s=0.05))
    schedule(off, new=[new_request("a")])
    context(off, {"a": [0, 1, 2, 3, 4]})
    off.on_output(None, ["a"], [[6]])
    schedule(off, finished=["a"])
    off.close()
    assert [r.hidden for r in BufferReader(tmp_path / "off").iter_records()] == [None]


WRAPPED = r"""
import functools, sys
import torch
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm_patches import capture_features, dflash_context

@functools.wraps(DFlashProposer.propose)
def vllm_propose(self, *args, **kwargs):  # vLLM's signature; stands in for its GPU/CPU drafting pass
    return "drafted"

class Cap:
    proposing = None
    contexts = []
    class settings:
        hidden_sample_rate = 1.0
    def on_context(self, req_ids, positions, bounds, hidden):
        self.contexts.append((req_ids, positions.tolist(), bounds.tolist(), hidden.shape))
    def error(self, where, exc):
        raise exc

class Meta:
    query_start_loc_cpu = torch.tensor([0, 3])

DFlashProposer.propose = vllm_propose
cap = Cap()
for name in sys.argv[1].split(","):
    dflash_context.install() if name == "context" else capture_features.install(cap, lambda runner: True)
cap.proposing = ["r"]
out = DFlashProposer.propose(object(), 4, torch.zeros(3, dtype=torch.long), torch.arange(3), torch.zeros(3, 8),
                             torch.zeros(1, dtype=torch.long), None, Meta(), None)
assert out == "drafted" and cap.contexts == [(["r"], [0, 1, 2], [0, 3], (3, 8))], (out, cap.contexts)
"""


@pytest.mark.parametrize("order", ["context,features", "features,context"])
def test_features_hook_reads_the_drafts_arguments_under_the_k0_wrapper(order):
    """``--speculation auto`` wraps ``DFlashProposer.propose`` too (dflash_context.py, K = 0 steps); whichever
    wrapper comes second must still bind vLLM's arguments by name (a run of benchmarks/domain_shift.py with
    both lost every record's features: KeyError 'target_positions' in each step). vLLM's classes are real;
    the drafting pass itself is replaced by a function of its signature (it needs a loaded drafter)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WRAPPED, order], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


# ---------------------------------------------------------------- replay from the captured features


def test_replay_from_captured_features_runs_no_target_and_matches(target, drafter, record):
    """Features captured from position 0 (the target's own float32 rows): the target runs over no token and
    the draft logits and loss equal replay with the forward; from position 5 it runs over 5 tokens."""
    tokens = torch.tensor(record.tokens)
    aux = features(target, drafter, tokens)
    reference = replay_sequence(target, drafter, tokens, record.blocks)
    for start in (0, 5):
        hidden = TargetHidden.from_tensor(start, aux[start:-1])
        batch = replay_sequence(target, drafter, tokens[:-1], record.blocks, hidden=hidden)
        assert batch.num_target_tokens == start
        torch.testing.assert_close(batch.draft_logits, reference.draft_logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(batch.target_logits, reference.target_logits)
        loss = draft_opd_loss(batch.target_logits, batch.draft_logits, batch.num_accepted,
                              num_drafted=batch.num_drafted)
        ref = draft_opd_loss(reference.target_logits, reference.draft_logits, reference.num_accepted,
                             num_drafted=reference.num_drafted)
        torch.testing.assert_close(loss.loss, ref.loss, atol=1e-5, rtol=1e-4)
    bf16 = replay_sequence(target, drafter, tokens[:-1], record.blocks,
                           hidden=TargetHidden.from_tensor(0, aux[:-1].to(torch.bfloat16)))
    assert bf16.num_target_tokens == 0  # the serving dtype's rows, cast: close, not equal
    torch.testing.assert_close(bf16.draft_logits, reference.draft_logits, atol=0.05, rtol=0.05)


def test_unusable_features_fall_back_to_the_forward(target, drafter, record):
    tokens = torch.tensor(record.tokens)
    aux = features(target, drafter, tokens)
    T = len(tokens) - 1
    layer_ids = tuple(drafter.target_layer_ids)
    wrong_width = TargetHidden.from_tensor(0, aux[:-1, :-1])
    short = TargetHidden.from_tensor(0, aux[: T - 1])  # stops before the last anchor
    bad = aux[:-1].clone()
    bad[2, 0] = float("inf")
    for hidden in (None, wrong_width, short, TargetHidden.from_tensor(0, bad)):
        rows, ran_over = sequence_aux(target, tokens[:-1], layer_ids, hidden)
        assert ran_over == T
        # a forward over T tokens against one over T + 1: other GEMM shapes, float32 rounding only
        torch.testing.assert_close(rows, aux[:-1], atol=2e-4, rtol=1e-4)
    # a block without its teacher needs the packed forward: the features are not used then
    blocks = (dataclasses.replace(record.blocks[0], teacher=None), *record.blocks[1:])
    batch = replay_sequence(target, drafter, tokens[:-1], blocks, hidden=TargetHidden.from_tensor(0, aux[:-1]))
    assert batch.num_target_tokens == T + len(blocks[0].draft_tokens) - 1


def test_training_steps_use_the_records_features_or_ignore_them(target, drafter, record):
    tokens = torch.tensor(record.tokens)
    aux = features(target, drafter, tokens)
    rec = dataclasses.replace(record, hidden=TargetHidden.from_tensor(0, aux[:-1]))

    def step(r, use_teacher):
        out = replay_records(target, drafter, [r], lambda t, d, a, n: draft_opd_loss(t, d, a, num_drafted=n), anchors_per_sequence=8,
                             generator=torch.Generator().manual_seed(0), use_teacher=use_teacher)
        return float(out.loss.detach())

    assert step(rec, True) == pytest.approx(step(record, True), rel=1e-4, abs=1e-5)
    assert step(rec, False) == step(record, False)


def test_simulated_blocks_use_the_records_features(target, drafter, record, monkeypatch):
    """A record replayed on simulated blocks (rollout.simulated_record, served without speculation) takes the
    drafter's context from its captured features: the same blocks as with the target's forward, and the
    target runs over no token (from position 0) or over the positions before the rows (from position 5);
    ``captured_features=False`` and unusable rows run the forward over the T - 1 positions the walk reads."""
    tokens = torch.tensor(record.tokens)
    aux = features(target, drafter, tokens)
    plain = dataclasses.replace(record, blocks=())
    reference = simulated_record(target, drafter, plain).blocks
    assert len(reference) >= 3
    ran_over = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda toks, *a, **k: ran_over.append(len(toks)) or forward(toks, *a, **k))
    cases = [(TargetHidden.from_tensor(0, aux[:-1]), True, []), (TargetHidden.from_tensor(5, aux[5:-1]), True, [5]),
             (TargetHidden.from_tensor(0, aux[:-1]), False, [len(tokens) - 1]),
             (TargetHidden.from_tensor(0, aux[:-2]), True, [len(tokens) - 1])]  # stops short: not used
    for hidden, use, expected in cases:
        ran_over.clear()
        blocks = simulated_record(target, drafter, dataclasses.replace(plain, hidden=hidden), use).blocks
        assert blocks == reference and ran_over == expected, (hidden.start, use, ran_over)
