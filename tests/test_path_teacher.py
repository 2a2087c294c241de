"""The teacher on the plain steps (``SequenceRecord.path_teacher``): the target's captured top-k rows along a
record's own tokens, their record and buffer round trip, ``path_rows`` (with the logged blocks' on-path
rows), and replay of objectives that read positions k <= r + 1 only (LK, target-rollout KL) from them: no
target forward, the recomputed loss at k = vocab, and objectives reading other positions left as they were."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from online_opd.config_training import TrainerConfig
from online_opd.opd.replay import ReplayBatch, replay_sequence
from online_opd.opd.rollout import propose_all, simulated_record
from online_opd.opd.specdec import target_generate
from online_opd.opd.teacher_rows import path_block_teacher, top_k_teacher
from online_opd.traces.buffer import decode_segment, encode_segment
from online_opd.traces.records import BlockRecord, SequenceRecord, path_rows
from online_opd.traces.target_signal import PathTeacher, TargetHidden
from online_opd.train.opd import (
    objective_fn,
    replay_records,
    widened_blocks,
    with_greedy_acceptance,
    with_path_teachers,
)
from online_opd.train.sequences import TrainSequence
from tests.tiny import REPLAY_PROMPT, VOCAB, mixed_blocks

K = 4
PROMPT = REPLAY_PROMPT


@pytest.fixture(scope="module")
def tokens(target):
    return torch.tensor(target_generate(target, PROMPT, 24))  # greedy, T = 30


@pytest.fixture(scope="module")
def mixed(tokens):
    return mixed_blocks(tokens.tolist(), len(PROMPT))


def sequence_teacher(target, tokens: torch.Tensor, k: int, positions=None) -> PathTeacher:
    """What the capture keeps on plain steps: the target's next-token top-k at each position p <= T - 2."""
    positions = list(range(len(PROMPT) - 1, len(tokens) - 1)) if positions is None else list(positions)
    with torch.no_grad():
        logits = target.forward(tokens).logits[positions]
    return PathTeacher(tuple(positions), top_k_teacher(logits, k))


def make_record(tokens, blocks=(), path_teacher=None, hidden=None) -> SequenceRecord:
    return SequenceRecord(record_id="r", model_id="m", drafter_version="v", temperature=0.0, top_p=1.0, top_k=0,
                          tokens=tuple(tokens.tolist()), prompt_len=len(PROMPT), blocks=tuple(blocks),
                          path_teacher=path_teacher, hidden=hidden)


# ---------------------------------------------------------------- records


def test_path_teacher_round_trips_through_json_and_a_segment(target, tokens):
    teacher = sequence_teacher(target, tokens, 3, positions=(6, 7, 9))
    record = make_record(tokens, path_teacher=teacher)
    assert SequenceRecord.from_dict(record.to_dict()) == record
    [back] = decode_segment(encode_segment([record, dataclasses.replace(record, path_teacher=None)]))[:1]
    assert back == record
    assert decode_segment(encode_segment([dataclasses.replace(record, path_teacher=None)]))[0].path_teacher is None


def test_a_segment_without_the_path_teacher_columns_still_reads(target, tokens):
    record = make_record(tokens, path_teacher=sequence_teacher(target, tokens, 2))
    table = pq.read_table(pa.BufferReader(encode_segment([record])))
    old = table.drop_columns(["path_teacher_positions", "path_teacher_ids", "path_teacher_logprobs"])
    sink = pa.BufferOutputStream()
    pq.write_table(old, sink)
    [back] = decode_segment(sink.getvalue().to_pybytes())
    assert back == dataclasses.replace(record, path_teacher=None)


def test_a_segment_with_one_path_teacher_column_null_does_not_parse(target, tokens):
    table = pq.read_table(pa.BufferReader(encode_segment([make_record(tokens, path_teacher=sequence_teacher(
        target, tokens, 2))])))
    column = table.schema.get_field_index("path_teacher_ids")
    broken = table.set_column(column, table.schema.field(column), pa.array([None], table.schema.field(column).type))
    sink = pa.BufferOutputStream()
    pq.write_table(broken, sink)
    with pytest.raises(ValueError, match="path_teacher"):
        decode_segment(sink.getvalue().to_pybytes())


@pytest.mark.parametrize("positions, match", [((7, 7), "strictly increasing"), ((8, 7), "strictly increasing"),
                                               ((-1, 3), "strictly increasing")])
def test_bad_path_teachers_raise(target, tokens, positions, match):
    rows = sequence_teacher(target, tokens, 2, positions=(6, 7)).rows
    with pytest.raises(ValueError, match=match):
        PathTeacher(positions, rows)
    with pytest.raises(ValueError, match="one row per position"):
        PathTeacher((6,), rows)
    data = {"positions": [6, 7], **rows.to_dict()}
    data["logprobs"][1][0] = 0.5
    with pytest.raises(ValueError, match="path_teacher.logprobs"):
        PathTeacher.from_dict(data)


def test_a_record_refuses_a_row_past_its_last_predicting_position(target, tokens):
    last = len(tokens) - 2
    make_record(tokens, path_teacher=sequence_teacher(target, tokens, 2, positions=(last,)))
    with pytest.raises(ValueError, match="path_teacher has a row at position"):
        make_record(tokens[:-1], path_teacher=sequence_teacher(target, tokens, 2, positions=(last,)))


def test_path_rows_take_the_plain_rows_and_the_blocks_rows_on_the_sequence(target, tokens, mixed):
    """A block (a, d, r) verified row j at a + j over d_<=j: on the sequence for j <= r (its bonus row K_m
    too when r = K_m); a plain row at the same position wins."""
    blocks = []
    for block in mixed:
        seq = torch.cat([tokens[: block.anchor + 1], torch.tensor(block.draft_tokens)])
        blocks.append(dataclasses.replace(block, teacher=top_k_teacher(target.forward(seq).logits[block.anchor:], 3)))
    plain = sequence_teacher(target, tokens, 3, positions=(len(PROMPT) - 1, blocks[0].anchor))
    rows = path_rows(make_record(tokens, blocks, plain))
    expected = {}
    for block in blocks:
        n, r = len(block.draft_tokens), block.num_accepted
        for j in range(min(r, n) + 1):
            expected[block.anchor + j] = (block.teacher.token_ids[j], block.teacher.logprobs[j])
    expected.update(zip(plain.positions, zip(plain.rows.token_ids, plain.rows.logprobs)))
    assert rows == expected
    assert blocks[3].num_accepted == len(blocks[3].draft_tokens) and blocks[3].anchor + 3 in rows  # a bonus row
    full = sequence_teacher(target, tokens, 3)  # every row along the sequence: the blocks' agree with it
    for p, (ids, logprobs) in rows.items():
        j = full.positions.index(p)
        assert ids == full.rows.token_ids[j]
        assert logprobs == pytest.approx(full.rows.logprobs[j], abs=1e-5)


def test_path_block_teacher_repeats_the_last_row_on_the_path(target, tokens, mixed):
    rows = path_rows(make_record(tokens, path_teacher=sequence_teacher(target, tokens, 2)))
    for block in mixed:
        teacher = path_block_teacher(block, rows)
        n, r = len(block.draft_tokens), block.num_accepted
        assert len(teacher.token_ids) == n + 1
        on_path = min(r, n - 1)
        for j in range(n + 1):
            position = block.anchor + (j if j <= on_path or (j == n and r == n) else on_path)
            assert (teacher.token_ids[j], teacher.logprobs[j]) == rows[position]
    missing = dict(rows)
    del missing[mixed[0].anchor + 1]  # r = 1: its row at k = 2 is on the path
    assert path_block_teacher(mixed[0], missing) is None
    assert path_block_teacher(mixed[2], missing) is not None  # r = 0, K_m = 1: row a only


# ---------------------------------------------------------------- replay


def _loss(target, drafter, record, name, use_teacher=True):
    out = replay_records(target, drafter, [record], objective_fn(TrainerConfig(objective=name)),
                         anchors_per_sequence=len(record.blocks), generator=torch.Generator().manual_seed(0),
                         use_teacher=use_teacher)
    return float(out.loss.detach())


@pytest.mark.parametrize("name", ["lk", "target_rollout"])
def test_path_only_objectives_replay_the_path_teacher_as_the_recomputed_target(target, drafter, tokens,
                                                                                mixed, name):
    """At k = vocab the rows along the sequence are the target's own: the LK and target-rollout losses equal
    the recomputed ones, and replay runs no target forward beyond the sequence's (none with the features)."""
    with torch.no_grad():
        aux = target.forward(tokens[:-1], tuple(drafter.target_layer_ids), logits_at=tokens.new_empty(0)).aux_hidden
    record = make_record(tokens, mixed, sequence_teacher(target, tokens, VOCAB),
                         TargetHidden.from_tensor(0, aux))
    assert _loss(target, drafter, record, name) == pytest.approx(_loss(target, drafter, record, name, False),
                                                                 rel=1e-5, abs=1e-6)
    blocks = with_path_teachers(record, list(record.blocks))
    assert all(b.teacher is not None for b in blocks)
    end = max(b.anchor for b in blocks) + 1
    batch = replay_sequence(target, drafter, tokens[:end], blocks, hidden=record.hidden)
    assert batch.num_target_tokens == 0  # the captured features and teacher: no target forward at all


def test_objectives_reading_other_positions_ignore_the_path_teacher(target, drafter, tokens, mixed):
    """Draft-OPD reads positions after the first rejection, which the sequence never visited: a top-2 path
    teacher (far from the target's full rows) leaves its loss the recomputed one; LK's moves."""
    record = make_record(tokens, mixed, sequence_teacher(target, tokens, 2))
    assert not objective_fn(TrainerConfig(objective="draft_opd")).path_only
    assert objective_fn(TrainerConfig(objective="draft_opd", first_rejected_only=True)).path_only
    assert _loss(target, drafter, record, "draft_opd") == _loss(target, drafter, record, "draft_opd", False)
    assert abs(_loss(target, drafter, record, "lk") - _loss(target, drafter, record, "lk", False)) > 1e-4


def test_a_simulated_record_keeps_the_rows_of_the_blocks_it_drops(target, drafter, tokens, mixed):
    """Simulation replaces the logged blocks by the current drafter's: their on-path rows move into the
    record's path teacher with the plain ones, and every simulated block then carries a teacher."""
    blocks = []
    for block in mixed:
        seq = torch.cat([tokens[: block.anchor + 1], torch.tensor(block.draft_tokens)])
        blocks.append(dataclasses.replace(block, teacher=top_k_teacher(target.forward(seq).logits[block.anchor:],
                                                                       VOCAB)))
    logged = {p for b in blocks for p in range(b.anchor, b.anchor + min(b.num_accepted, len(b.draft_tokens)) + 1)}
    plain = [p for p in range(len(PROMPT) - 1, len(tokens) - 1) if p not in logged]
    record = make_record(tokens, blocks, sequence_teacher(target, tokens, VOCAB, positions=plain))
    simulated = simulated_record(target, drafter, record)
    assert simulated.blocks and simulated.blocks != record.blocks
    assert simulated.path_teacher.positions == tuple(range(len(PROMPT) - 1, len(tokens) - 1))
    assert path_rows(simulated) == path_rows(record)
    assert all(b.teacher is not None for b in with_path_teachers(simulated, list(simulated.blocks)))
    assert _loss(target, drafter, simulated, "lk") == pytest.approx(_loss(target, drafter, simulated, "lk", False),
                                                                    rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- blocks replayed K wide (trainer.widen_share)


def test_widened_blocks_replace_blocks_by_the_sequences_own(tokens, mixed):
    """At share 1 every block becomes the K-wide block at its anchor on the sequence's tokens (no teacher of its
    own; num_accepted its width, a placeholder), also a K-wide one; near the end it stops at the last token,
    and a block that would end narrower than served stays; at share 0 nothing changes."""
    record = make_record(tokens, mixed)
    out, widened = widened_blocks(record, list(mixed), K, 1.0, torch.Generator().manual_seed(0))
    assert widened == list(range(len(mixed)))
    for old, new in zip(mixed, out):
        assert new.anchor == old.anchor and new.num_accepted == K and new.teacher is None
        assert list(new.draft_tokens) == tokens[old.anchor + 1:old.anchor + 1 + K].tolist()
    assert widened_blocks(record, list(mixed), K, 0.0, torch.Generator().manual_seed(0)) == (list(mixed), [])
    near_end = [dataclasses.replace(mixed[2], anchor=len(tokens) - 3),  # 1 wide, two tokens left: widened to 2
                dataclasses.replace(mixed[0], anchor=len(tokens) - 3)]  # 4 wide: stays
    out, widened = widened_blocks(record, near_end, K, 1.0, torch.Generator().manual_seed(0))
    assert widened == [0] and list(out[0].draft_tokens) == tokens[-2:].tolist() and out[1] is near_end[1]


def test_greedy_acceptance_counts_the_leading_argmax_hits():
    """r of a widened block = the leading positions where the drafter's argmax is the sequence's token,
    within the block (a shorter block's padding never counts); other blocks keep theirs."""
    logits = torch.full((3, K, VOCAB), -1.0)
    for m, row in enumerate([[5, 6, 9, 8], [1, 2, 3, 4], [7, 7, 0, 0]]):
        logits[m, torch.arange(K), torch.tensor(row)] = 1.0
    blocks = [BlockRecord(0, (5, 6, 7, 8), 4), BlockRecord(0, (9,), 0), BlockRecord(0, (7, 7), 2)]
    batch = ReplayBatch(torch.zeros_like(logits), logits, torch.tensor([4, 0, 2]), torch.tensor([4, 1, 2]))
    assert with_greedy_acceptance(batch, blocks, [0, 2]).num_accepted.tolist() == [2, 0, 2]
    assert batch.num_accepted.tolist() == [4, 0, 2]  # not changed in place


def sequence_the_drafter_half_predicts(target, drafter, prompt_tokens: torch.Tensor, num_blocks: int):
    """(tokens, anchors): after each anchor the drafter's first two greedy K-wide drafts, then a token it did not
    draft, so that the K-wide blocks at those anchors are accepted for exactly two positions (a block's drafts
    depend on the tokens up to its anchor only)."""
    tokens, anchors = prompt_tokens.clone(), []
    for _ in range(num_blocks):
        a = len(tokens) - 1
        with torch.no_grad():
            aux = target.forward(tokens, tuple(drafter.target_layer_ids), logits_at=tokens.new_empty(0)).aux_hidden
        draft = propose_all(drafter, TrainSequence(tokens, len(PROMPT), aux), torch.tensor([a]))[0].tolist()
        tokens = torch.cat([tokens, torch.tensor([draft[0], draft[1], (draft[2] + 1) % VOCAB])])
        anchors.append(a)
    return torch.cat([tokens, tokens[-2:]]), anchors  # two more: the last block's K positions lie inside


@pytest.mark.parametrize("name", ["lk", "target_rollout"])
def test_a_widened_block_replays_as_the_block_the_drafter_would_draft_k_wide(target, drafter, tokens, name):
    """Blocks served 1 wide, or K wide by other weights, replayed K wide give the loss of the K-wide blocks the
    current drafter drafts greedily at those anchors (``propose_all``) with T=0 verification's acceptance (here
    2 of 4 each): the blocks a server drafting K tokens with these weights would have logged there; the path
    teacher and the recomputed target agree. As served (share 0) they train position 1 alone."""
    seq, anchors = sequence_the_drafter_half_predicts(target, drafter, tokens[:len(PROMPT) + 4], 4)
    with torch.no_grad():
        aux = target.forward(seq[:-1], tuple(drafter.target_layer_ids), logits_at=seq.new_empty(0)).aux_hidden
    drafts = propose_all(drafter, TrainSequence(seq, len(PROMPT), aux), torch.tensor(anchors)).tolist()
    wide = [BlockRecord(a, tuple(d), 2) for a, d in zip(anchors, drafts)]
    assert all(list(b.draft_tokens[:2]) == seq[b.anchor + 1:b.anchor + 3].tolist() for b in wide)
    narrow = [BlockRecord(a, (seq[a + 1].item(),), 1) for a in anchors]
    stale = [BlockRecord(a, tuple((t + 1) % VOCAB for t in d), 0) for a, d in zip(anchors, drafts)]  # other weights'
    cfg = TrainerConfig(objective=name, widen_share=1.0)

    def replay(blocks, share, teacher=None):
        return replay_records(target, drafter, [make_record(seq, blocks, teacher)], objective_fn(cfg),
                              anchors_per_sequence=len(blocks), generator=torch.Generator().manual_seed(0),
                              widen_share=share)

    expected = replay(wide, 0.0)
    assert expected.num_widened == 0 and expected.rejected > 0  # position 3 of each block: the first rejected
    for blocks in (narrow, stale, wide):
        for teacher in (None, sequence_teacher(target, seq, VOCAB)):
            got = replay(blocks, 1.0, teacher)
            assert got.num_widened == len(blocks)
            assert float(got.loss) == pytest.approx(float(expected.loss), rel=1e-5, abs=1e-6)
            assert got.rejected == pytest.approx(expected.rejected, rel=1e-5)
    assert replay(narrow, 0.0).rejected == 0.0  # position 1 alone, accepted
    assert replay(stale, 0.0).accepted == 0.0  # position 1 alone, rejected
