"""The verifier as teacher: ``TeacherTopK`` records and their buffer round trip, the top-k math the
capture runs, the reconstruction of p from it, and replay with it (no target forward over the drafted
positions) against replay without it."""

from __future__ import annotations

import dataclasses
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from online_opd.opd.losses import draft_opd_loss
from online_opd.opd.replay import replay_sequence, replay_sequence_naive
from online_opd.opd.specdec import target_generate
from online_opd.opd.teacher_rows import (
    TAIL_MASS_FLOOR,
    teacher_logits,
    teacher_truncation,
    top_k_logprobs,
    top_k_teacher,
)
from online_opd.traces.buffer import SEGMENT_SCHEMA, decode_segment, encode_segment
from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity
from online_opd.traces.target_signal import TeacherTopK
from tests.tiny import REPLAY_PROMPT, VOCAB, mixed_blocks, tiny_eagle3_drafter

K = 4
PROMPT = REPLAY_PROMPT


def block_teacher(target, tokens: torch.Tensor, block: BlockRecord, k: int) -> TeacherTopK:
    """What the verifier would capture for ``block``: the target's K_m + 1 rows on x_<=a, d_1..d_K_m."""
    a, draft = block.anchor, torch.tensor(block.draft_tokens)
    logits = target.forward(torch.cat([tokens[: a + 1], draft])).logits[a:]  # [K_m + 1, vocab]
    return top_k_teacher(logits, k)


def with_teacher(target, tokens, blocks, k: int, which=None) -> list[BlockRecord]:
    """``blocks`` with a captured teacher of top-k ``k`` (on the blocks whose index is in ``which``: all)."""
    return [dataclasses.replace(b, teacher=block_teacher(target, tokens, b, k))
            if which is None or m in which else b for m, b in enumerate(blocks)]


@pytest.fixture(scope="module")
def mixed(target):
    """Greedy target sequence with blocks of K_m = 4, 2, 1, 3, 4 tokens (r = 1, 2, 0, 3, 2), wrong after r."""
    tokens = target_generate(target, PROMPT, 24)  # T = 30
    return torch.tensor(tokens), mixed_blocks(tokens, len(PROMPT))


def _teacher(rows: int = 3, k: int = 2) -> TeacherTopK:
    logits = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows * 10 + k))
    return top_k_teacher(logits, k)


# ---------------------------------------------------------------- records


def test_teacher_and_block_round_trip_through_json():
    teacher = _teacher(3, 4)
    assert teacher.top_k == 4 and len(teacher.token_ids) == 3
    assert all(list(row) == sorted(row, reverse=True) for row in teacher.logprobs)  # descending
    block = BlockRecord(anchor=3, draft_tokens=(11, 12), num_accepted=1, teacher=teacher)
    data = json.loads(json.dumps(block.to_dict()))
    assert data["teacher"] == {"token_ids": [list(r) for r in teacher.token_ids],
                               "logprobs": [list(r) for r in teacher.logprobs]}
    assert BlockRecord.from_dict(data) == block
    assert TeacherTopK.from_dict(data["teacher"]) == teacher
    plain = dataclasses.replace(block, teacher=None)
    assert "teacher" not in plain.to_dict()  # the JSON shape of records without it is unchanged
    assert BlockRecord.from_dict(plain.to_dict()).teacher is None
    assert BlockRecord.from_dict({**plain.to_dict(), "teacher": None}).teacher is None


@pytest.mark.parametrize(
    "teacher, match",
    [
        ({"token_ids": [[1, 2], [3]], "logprobs": [[-1.0, -2.0], [-1.0]]}, r"\[rows\]\[k\] shape"),
        ({"token_ids": [[1, 2], [3, 4]], "logprobs": [[-1.0, -2.0], [-1.0]]}, r"\[rows\]\[k\] shape"),
        ({"token_ids": [[], []], "logprobs": [[], []]}, "k >= 1"),
        ({"token_ids": [], "logprobs": []}, r"teacher.token_ids must be a non-empty"),
        ({"token_ids": [[1, 2]], "logprobs": [[-1.0, -2.0]]}, "has 1 rows"),  # the block has 1 draft token
        ({"token_ids": [[1, 2], [3, 4]], "logprobs": [[-1.0, 0.5], [-1.0, -2.0]]}, r"logprobs\[0\]"),
        ({"token_ids": [[1, 2], [3, 4]], "logprobs": [[-1.0, -2.0], [float("nan"), -2.0]]}, r"logprobs\[1\]"),
        ({"token_ids": [[1, 2], [3, 4]], "logprobs": [[-1.0, float("-inf")], [-1.0, -2.0]]}, r"logprobs\[0\]"),
        ({"token_ids": [[1, 2], [3, 4]], "logprobs": [[-1.0, "x"], [-1.0, -2.0]]}, r"logprobs\[0\]"),
        ({"token_ids": [[1, -2], [3, 4]], "logprobs": [[-1.0, -2.0], [-1.0, -2.0]]}, r"token_ids\[0\]"),
        ({"token_ids": [[1, 1], [3, 4]], "logprobs": [[-1.0, -2.0], [-1.0, -2.0]]}, r"token_ids\[0\]"),
        ({"token_ids": [[1, 2.0], [3, 4]], "logprobs": [[-1.0, -2.0], [-1.0, -2.0]]}, r"token_ids\[0\]"),
        ({"token_ids": [[1, 2], [3, 4]]}, "teacher.logprobs is missing"),
        ([[1, 2]], "teacher must be a dict"),
    ],
)
def test_bad_teachers_raise_naming_the_field(teacher, match):
    data = {"anchor": 3, "draft_tokens": [11], "num_accepted": 0, "teacher": teacher}
    with pytest.raises(ValueError, match=match):
        BlockRecord.from_dict(data, "record.blocks[2]")
    with pytest.raises(ValueError, match=r"record\.blocks\[2\]"):
        BlockRecord.from_dict(data, "record.blocks[2]")


def test_a_block_built_with_a_wrong_row_count_raises_at_once():
    """Built directly (the capture hook), a block whose teacher does not have K + 1 rows fails here, not
    when its segment is read (which would quarantine every record in it)."""
    with pytest.raises(ValueError, match="2 draft tokens has 3"):
        BlockRecord(anchor=3, draft_tokens=(11, 12), num_accepted=1, teacher=_teacher(2))


def test_fidelity_and_record_round_trip_with_a_teacher():
    blocks = (BlockRecord(anchor=3, draft_tokens=(11, 12, 99), num_accepted=2, teacher=_teacher(4)),
              BlockRecord(anchor=6, draft_tokens=(21, 22, 23), num_accepted=3))
    record = SequenceRecord("r1", "m", "v0", 0.0, 1.0, 0, (1, 2, 3, 10, 11, 12, 20, 21, 22, 23), 3, blocks)
    assert check_fidelity(record) == []
    assert SequenceRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


# ---------------------------------------------------------------- buffer segments


def _record(with_teacher_on: tuple[int, ...] = (0,)) -> SequenceRecord:
    tokens = (1, 2, 3, 10, 11, 12, 20, 21, 22, 23)
    blocks = [BlockRecord(anchor=3, draft_tokens=(11, 12, 99), num_accepted=2),
              BlockRecord(anchor=6, draft_tokens=(21, 22, 23), num_accepted=3, num_drafted=4)]
    gen = torch.Generator().manual_seed(3)
    blocks = [dataclasses.replace(b, teacher=top_k_teacher(torch.randn(4, 30000, generator=gen) * 4, 8))
              if m in with_teacher_on else b for m, b in enumerate(blocks)]
    return SequenceRecord("r1", "m", "v0", 0.7, 0.9, 20, tokens, 3, tuple(blocks))


@pytest.mark.parametrize("on", [(), (0,), (0, 1)])
def test_segment_round_trip_with_and_without_a_teacher(on):
    record = _record(on)
    back = decode_segment(encode_segment([record]))
    assert back == [record]  # float32 logprobs come back equal, not merely close
    assert [b.teacher is not None for b in back[0].blocks] == [m in on for m in range(2)]
    for b in back[0].blocks:
        if b.teacher is not None:  # the values are float32's, the same as a float32 tensor's
            assert torch.equal(torch.tensor(b.teacher.logprobs, dtype=torch.float32).double(),
                               torch.tensor(b.teacher.logprobs, dtype=torch.float64))
    struct = pq.read_schema(pa.BufferReader(encode_segment([record]))).field("blocks").type.value_type
    assert struct.field("teacher_ids").type == pa.list_(pa.list_(pa.int32()))
    assert struct.field("teacher_logprobs").type == pa.list_(pa.list_(pa.float32()))


def test_a_segment_written_before_the_teacher_columns_still_reads():
    record = _record(())
    new_block = SEGMENT_SCHEMA.field("blocks").type.value_type
    old_block = pa.struct([f for f in new_block if not f.name.startswith("teacher_")])
    fields = [pa.field("blocks", pa.list_(old_block)) if f.name == "blocks" else f for f in SEGMENT_SCHEMA]
    row = record.to_dict()
    row["events"] = json.dumps(row["events"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema(fields)), sink)
    data = sink.getvalue().to_pybytes()
    assert "teacher_ids" not in str(pq.read_schema(pa.BufferReader(data)).field("blocks").type)
    back = decode_segment(data)
    assert back == [record] and all(b.teacher is None for b in back[0].blocks)


def test_a_segment_with_one_teacher_column_null_does_not_parse():
    row = _record((0,)).to_dict()
    teacher = row["blocks"][0].pop("teacher")
    row["blocks"][0]["teacher_ids"] = teacher["token_ids"]  # the logprobs lost
    row["events"] = json.dumps(row["events"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([row], schema=SEGMENT_SCHEMA), sink)
    with pytest.raises(ValueError, match=r"blocks\[0\].teacher.logprobs"):
        decode_segment(sink.getvalue().to_pybytes())


# ---------------------------------------------------------------- top-k math and reconstruction


def test_top_k_logprobs_is_log_softmax_then_topk():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 8
    ids, logprobs = top_k_logprobs(logits, 7)
    values, expected = torch.log_softmax(logits.float(), dim=-1).topk(7, dim=-1)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, expected) and torch.equal(logprobs, values.clamp(max=0.0))
    teacher = TeacherTopK.from_tensors(ids, logprobs)
    assert torch.equal(torch.tensor(teacher.logprobs), logprobs)  # exact: float32 values as Python floats
    masked = torch.tensor([[0.0, float("-inf"), float("-inf"), 1.0]])  # a logit masked to -inf: finite, <= 0
    ids, logprobs = top_k_logprobs(masked, 4)
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    TeacherTopK.from_tensors(ids, logprobs)
    with pytest.raises(ValueError, match="k <= vocab"):
        top_k_logprobs(masked, 5)


def test_full_vocabulary_teacher_reconstructs_log_softmax():
    """k = vocab: no tail to guess (so no floor either), the rows are the log-softmax itself."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    teacher = top_k_teacher(logits, VOCAB)
    rebuilt = teacher_logits(teacher, 3, VOCAB)
    assert rebuilt.shape == (3, VOCAB) and rebuilt.dtype == torch.float32
    torch.testing.assert_close(rebuilt, torch.log_softmax(logits[:3], dim=-1), atol=1e-6, rtol=1e-6)
    figures = teacher_truncation(logits[:3], teacher)
    assert figures["kl"].abs().max() < 1e-5 and figures["tv"].max() < 1e-5
    torch.testing.assert_close(figures["captured_mass"], torch.ones(3), atol=1e-5, rtol=0)


def test_small_k_reconstruction_keeps_the_top_k_and_spreads_the_tail():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    k = 5
    teacher = top_k_teacher(logits, k)
    rebuilt = teacher_logits(teacher, 3, VOCAB)
    torch.testing.assert_close(rebuilt.exp().sum(-1), torch.ones(3))  # proper distributions
    ids = torch.tensor(teacher.token_ids)
    full = torch.log_softmax(logits, dim=-1)
    # the captured entries are the true ones (the tail's mass is the true tail's: nothing to renormalise)
    torch.testing.assert_close(rebuilt.gather(1, ids), full.gather(1, ids), atol=1e-5, rtol=1e-5)
    tail = torch.ones(3, VOCAB, dtype=torch.bool).scatter_(1, ids, False)
    tail_values = rebuilt[tail].view(3, VOCAB - k)
    assert torch.equal(tail_values, tail_values[:, :1].expand_as(tail_values))  # uniform
    assert (tail_values[:, 0] <= rebuilt.gather(1, ids).min(-1).values).all()
    figures = teacher_truncation(logits, teacher)
    assert (figures["kl"] > 0).all() and (figures["tv"] > 0).all() and (figures["captured_mass"] < 1).all()
    torch.testing.assert_close(figures["captured_mass"], full.gather(1, ids).exp().sum(-1))


@pytest.mark.parametrize("second", [-10.0, -30.0])
def test_a_row_with_all_its_mass_captured_keeps_a_floored_tail(second):
    """The top-k holds all the mass (here a hair more, as rounding can): the tail gets TAIL_MASS_FLOOR, so
    log p stays finite where a drafter may put mass, and the reverse KL with it; never above the smallest
    captured entry (-30: the cap, not the floor, sets it)."""
    teacher = TeacherTopK(((3, 1),), ((0.0, second),))
    rebuilt = teacher_logits(teacher, 1, 10)
    assert torch.isfinite(rebuilt).all()
    fill = min(math.log(TAIL_MASS_FLOOR / 8), second)  # 8 ids outside the top-k
    norm = math.log(1.0 + math.exp(second) + 8 * math.exp(fill))
    torch.testing.assert_close(rebuilt[0, [0, 2, 4, 5, 6, 7, 8, 9]], torch.full((8,), fill - norm))
    torch.testing.assert_close(rebuilt[0, [3, 1]], torch.tensor([0.0, second]) - norm)
    with pytest.raises(ValueError, match="vocabulary of 3"):
        teacher_logits(teacher, 1, 3)  # id 3 outside a 3-token vocabulary
    with pytest.raises(ValueError, match="num_rows"):
        teacher_logits(teacher, 2, 10)


# ---------------------------------------------------------------- replay with the captured teacher


def _assert_close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("make_drafter", [lambda t: None, tiny_eagle3_drafter], ids=["dflash", "eagle3"])
def test_full_vocabulary_teacher_replays_as_the_recomputed_target(target, drafter, mixed, make_drafter):
    """The key parity: with every block's teacher at k = vocab, replay runs only a plain causal target
    forward, and gives the recomputed target rows (as log-probabilities) and the same draft logits."""
    drafter = make_drafter(target) or drafter
    tokens, blocks = mixed
    captured = with_teacher(target, tokens, blocks, VOCAB)
    reference = replay_sequence(target, drafter, tokens, blocks)
    batch = replay_sequence(target, drafter, tokens, captured)
    drafted = torch.arange(K)[None, :] < reference.num_drafted[:, None]  # [M, W] rows k <= K_m
    _assert_close(batch.target_logits[drafted], torch.log_softmax(reference.target_logits[drafted], dim=-1))
    assert not batch.target_logits[~drafted].any()  # padding rows stay zero
    _assert_close(batch.draft_logits, reference.draft_logits)
    assert torch.equal(batch.num_accepted, reference.num_accepted)
    assert torch.equal(batch.num_drafted, reference.num_drafted)
    assert batch.num_target_tokens == len(tokens)  # the sequence only: no drafted position appended
    assert reference.num_target_tokens == len(tokens) + sum(len(b.draft_tokens) - 1 for b in blocks)
    off = replay_sequence(target, drafter, tokens, captured, use_teacher=False)  # recomputes every block
    assert torch.equal(off.target_logits, reference.target_logits)
    assert off.num_target_tokens == reference.num_target_tokens
    loss = draft_opd_loss(batch.target_logits, batch.draft_logits, batch.num_accepted,
                          num_drafted=batch.num_drafted)
    ref_loss = draft_opd_loss(reference.target_logits, reference.draft_logits, reference.num_accepted,
                              num_drafted=reference.num_drafted)
    _assert_close(loss.loss, ref_loss.loss)


def test_small_k_teacher_replay_uses_the_reconstruction(target, drafter, mixed):
    tokens, blocks = mixed
    captured = with_teacher(target, tokens, blocks, 4)
    batch = replay_sequence(target, drafter, tokens, captured, teacher_tail="uniform")
    for m, block in enumerate(captured):
        length = len(block.draft_tokens)
        assert torch.equal(batch.target_logits[m, :length], teacher_logits(block.teacher, length, VOCAB))
    _assert_close(batch.draft_logits, replay_sequence_naive(target, drafter, tokens, blocks).draft_logits)
    drafter.zero_grad(set_to_none=True)
    out = draft_opd_loss(batch.target_logits, batch.draft_logits, batch.num_accepted,
                         num_drafted=batch.num_drafted)
    assert torch.isfinite(out.loss) and out.num_accepted_positions > 0 and out.num_rejected_positions > 0
    out.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in drafter.parameters())
    assert drafter.fc.weight.grad.abs().sum() > 0
    drafter.zero_grad(set_to_none=True)


def test_student_tail_gives_the_collapsed_objectives(target, drafter, mixed):
    """teacher_tail="student": captured ids keep their log-probabilities, the tail follows
    the drafter's q, and the forward and reverse KL of each row equal their (k+1)-way form over the k ids
    and one "rest" outcome."""
    tokens, blocks = mixed
    k = 4
    captured = with_teacher(target, tokens, blocks, k)
    batch = replay_sequence(target, drafter, tokens, captured, teacher_tail="student")
    for m, block in enumerate(captured):
        for j in range(len(block.draft_tokens)):
            log_p, log_q = batch.target_logits[m, j], torch.log_softmax(batch.draft_logits[m, j].detach(), -1)
            ids = torch.tensor(block.teacher.token_ids[j])
            captured_lp = torch.tensor(block.teacher.logprobs[j])
            assert torch.allclose(log_p[ids], captured_lp, atol=1e-5)
            assert torch.allclose(log_p.exp().sum(), torch.tensor(1.0), atol=1e-5)
            tail = torch.ones(VOCAB, dtype=torch.bool)
            tail[ids] = False
            ratio = (log_p - log_q)[tail]
            assert float(ratio.max() - ratio.min()) < 1e-4  # p proportional to q on the tail
            p_rest, q_rest = 1 - captured_lp.exp().sum(), 1 - log_q[ids].exp().sum()
            forward = (captured_lp.exp() * (captured_lp - log_q[ids])).sum() + p_rest * torch.log(p_rest / q_rest)
            reverse = (log_q[ids].exp() * (log_q[ids] - captured_lp)).sum() + q_rest * torch.log(q_rest / p_rest)
            assert torch.allclose((log_p.exp() * (log_p - log_q)).sum(), forward, atol=1e-4)
            assert torch.allclose((log_q.exp() * (log_q - log_p)).sum(), reverse, atol=1e-4)
    with pytest.raises(ValueError, match="teacher_tail"):
        replay_sequence(target, drafter, tokens, captured, teacher_tail="flat")


def test_blocks_with_and_without_a_teacher_in_one_sequence(target, drafter, mixed):
    """Blocks 1 and 3 carry a teacher (rows rebuilt from it), the others go through a packed forward of
    their own (rows the recomputed ones), and the drafter sees the same features either way."""
    tokens, blocks = mixed
    captured = with_teacher(target, tokens, blocks, 6, which={1, 3})
    batch = replay_sequence(target, drafter, tokens, captured, teacher_tail="uniform")
    naive = replay_sequence_naive(target, drafter, tokens, captured)  # the reference never reads a teacher
    for m, block in enumerate(captured):
        length = len(block.draft_tokens)
        if block.teacher is not None:
            assert torch.equal(batch.target_logits[m, :length], teacher_logits(block.teacher, length, VOCAB))
        else:
            _assert_close(batch.target_logits[m, :length], naive.target_logits[m, :length])
        assert not batch.target_logits[m, length:].any()
    _assert_close(batch.draft_logits, naive.draft_logits)
    assert batch.num_target_tokens == len(tokens) + sum(len(captured[m].draft_tokens) - 1 for m in (0, 2, 4))


def test_records_without_a_teacher_replay_as_before(target, drafter, mixed):
    tokens, blocks = mixed
    assert all(b.teacher is None for b in blocks)
    batch = replay_sequence(target, drafter, tokens, blocks)
    naive = replay_sequence_naive(target, drafter, tokens, blocks)
    torch.testing.assert_close(batch.target_logits, naive.target_logits, atol=1e-4, rtol=1e-4)
    assert batch.target_logits.dtype == target.dtype  # the raw logits, not log-probabilities
    assert batch.num_target_tokens == len(tokens) + sum(len(b.draft_tokens) - 1 for b in blocks)


def test_a_training_step_replays_the_captured_teacher_unless_told_not_to(target, drafter, mixed):
    """``replay_records`` (what every trainer step calls, ``trainer.captured_teacher`` choosing
    ``use_teacher``): with a full-vocabulary teacher the step's loss is the recomputed one; with top-4 it
    is the reconstruction's, and ``use_teacher=False`` ignores the teacher."""
    from online_opd.config_training import TrainerConfig
    from online_opd.traces.records import SequenceRecord
    from online_opd.train.opd import objective_fn, replay_records

    tokens, blocks = mixed

    def record(blocks):
        return SequenceRecord(record_id="r", model_id="m", drafter_version="v", temperature=0.0, top_p=1.0,
                              top_k=0, tokens=tuple(tokens.tolist()), prompt_len=len(PROMPT), blocks=tuple(blocks))

    def loss(blocks, use_teacher):
        out = replay_records(target, drafter, [record(blocks)], objective_fn(TrainerConfig(objective="draft_opd")),
                             anchors_per_sequence=len(blocks), generator=torch.Generator().manual_seed(0),
                             use_teacher=use_teacher)
        return float(out.loss.detach())

    plain = loss(blocks, True)
    assert loss(with_teacher(target, tokens, blocks, VOCAB), True) == pytest.approx(plain, rel=1e-5, abs=1e-6)
    top4 = with_teacher(target, tokens, blocks, 4)
    assert loss(top4, False) == pytest.approx(plain, rel=1e-6, abs=1e-7)
    assert abs(loss(top4, True) - plain) > 1e-4
    assert TrainerConfig().captured_teacher and not TrainerConfig(captured_teacher=False).captured_teacher
