"""Training loops on tiny models: SFT and Draft-OPD learn, resume, and save."""

from __future__ import annotations

import json

import torch

from online_opd.config import TrainerConfig
from online_opd.models.drafters.checkpoint import load_drafter, save_drafter
from online_opd.opd.rollout import greedy_blocks
from online_opd.traces.records import SequenceRecord
from online_opd.train.loop import train
from online_opd.train.opd import opd_step_fn, read_records, write_records
from online_opd.train.sequences import TrainSequence, compute_aux_hidden, load_sequences, save_sequences
from online_opd.train.sft import block_labels, sample_anchors, sft_loss
from tests.tiny import greedy_sequences, tiny_drafter, tiny_target


def _sequences(target, drafter):
    seqs = [TrainSequence(tokens, plen) for tokens, plen in greedy_sequences(target)]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, progress=False)
    return seqs


def test_block_labels_and_anchors():
    tokens = torch.arange(10)
    labels = block_labels(tokens, torch.tensor([2, 7]), 3)
    assert labels.tolist() == [[3, 4, 5], [8, 9, -100]]
    anchors = sample_anchors(4, 10, 100, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [4, 5, 6, 7, 8]


def test_sequences_round_trip(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    seqs = _sequences(target, drafter)
    save_sequences(tmp_path / "s.safetensors", seqs, drafter.target_layer_ids)
    back = load_sequences(tmp_path / "s.safetensors", drafter.target_layer_ids)
    assert [s.prompt_len for s in back] == [3, 3, 3]
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.aux_hidden, b.aux_hidden)
               for a, b in zip(seqs, back))


def test_sft_learns_and_resumes(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    seqs = _sequences(target, drafter)
    gen = torch.Generator().manual_seed(0)
    anchors = [sample_anchors(s.prompt_len, s.num_tokens, 16, gen) for s in seqs]

    def step_fn(step):
        i = step % len(seqs)
        return sft_loss(drafter, seqs[i], anchors[i], decay=7.0)

    first = sum(float(step_fn(i)[0].detach()) for i in range(3))
    cfg = TrainerConfig(objective="sft", lr=1e-2, num_steps=30, checkpoint_every=10, warmup_ratio=0.0)
    assert train(step_fn, drafter, cfg, tmp_path, progress=False) == 30
    last = sum(float(step_fn(i)[0].detach()) for i in range(3))
    assert last < 0.7 * first
    # resume: more steps continue from the saved state
    more = cfg.model_copy(update={"num_steps": 35})
    assert train(step_fn, drafter, more, tmp_path, progress=False) == 35
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 36))


def test_draft_opd_on_records_improves_acceptance(tmp_path):
    target = tiny_target(seed=1)
    drafter = tiny_drafter(target, seed=2)
    # target-greedy sequences so that acceptance is meaningful
    seqs = _sequences(target, drafter)
    records = [SequenceRecord(f"r{i}", "tiny", "v0", 0.0, 1.0, 0, tuple(s.tokens.tolist()),
                              s.prompt_len, tuple(greedy_blocks(drafter, s))) for i, s in enumerate(seqs)]
    write_records(tmp_path / "rec" / "a.jsonl", records)
    (tmp_path / "rec" / "b.jsonl").write_text('{"not": "a record"}\n')
    loaded, skipped = read_records(tmp_path / "rec")
    assert len(loaded) == 3 and skipped == 1

    def accepted():
        return sum(b.num_accepted for s in seqs for b in greedy_blocks(drafter, s))

    before = accepted()
    cfg = TrainerConfig(objective="draft_opd", lr=1e-2, num_steps=40, sequences_per_step=2,
                        anchors_per_sequence=8, warmup_ratio=0.0, checkpoint_every=40)
    train(opd_step_fn(target, drafter, loaded, cfg), drafter, cfg, tmp_path / "run", progress=False)
    assert accepted() > before
    path = save_drafter(drafter, tmp_path / "out", parent_version="v0", step=40)
    assert load_drafter(path).cfg == drafter.cfg
