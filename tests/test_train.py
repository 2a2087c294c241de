"""Training loops on tiny models: SFT and Draft-OPD learn, resume, and save."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from online_opd.config import TrainerConfig
from online_opd.models.drafters.checkpoint import load_drafter, save_drafter
from online_opd.opd.rollout import greedy_blocks
from online_opd.traces.records import SequenceRecord
from online_opd.train.loop import train
from online_opd.train.opd import opd_step_fn, read_records, write_records
from online_opd.train.optim import build_optimizer, cosine_with_warmup
from online_opd.train.sequences import TrainSequence, compute_aux_hidden, load_sequences, save_sequences
from online_opd.train.sft import block_labels, sample_anchors, sft_loss
from online_opd.train.state import load_state, save_state
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


def test_cosine_schedule_by_hand_and_across_a_resume(tmp_path):
    layer = torch.nn.Linear(2, 2)  # a weight (decayed group) and a bias (no-decay group)

    def make():
        optimizer = build_optimizer(layer, lr=2.0, weight_decay=0.0, betas=(0.9, 0.95))
        return optimizer, cosine_with_warmup(optimizer, num_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1)

    def lr(optimizer) -> float:
        rates = {group["lr"] for group in optimizer.param_groups}
        assert len(rates) == 1  # both groups follow the schedule
        return rates.pop()

    optimizer, scheduler = make()
    rates = []
    for step in range(11):
        rates.append(lr(optimizer))
        optimizer.step()
        scheduler.step()
        if step == 3:
            save_state(tmp_path, step=4, drafter=layer, optimizer=optimizer, scheduler=scheduler)
    # W = 2 warm-up steps: 2 * s / W; then 2 * (0.1 + 0.9 * (1 + cos(pi * (s - 2) / 8)) / 2)
    expected = {0: 0.0, 1: 1.0, 2: 2.0, 4: 2 * (0.1 + 0.9 * (1 + 2**-0.5) / 2), 6: 1.1, 10: 0.2}
    assert {s: rates[s] for s in expected} == pytest.approx(expected)
    assert all(a > b for a, b in zip(rates[2:], rates[3:]))  # cosine decays monotonically to the floor

    optimizer, scheduler = make()
    assert lr(optimizer) == 0.0
    assert load_state(tmp_path, drafter=layer, optimizer=optimizer, scheduler=scheduler)["step"] == 4
    resumed = []
    for _ in range(7):
        resumed.append(lr(optimizer))
        optimizer.step()
        scheduler.step()
    assert resumed == pytest.approx(rates[4:])


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


def test_stop_event_ends_after_the_current_step_and_saves(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    seqs = _sequences(target, drafter)
    anchors = sample_anchors(seqs[0].prompt_len, seqs[0].num_tokens, 16, torch.Generator().manual_seed(0))
    stop = threading.Event()

    def step_fn(step):
        if step == 3:
            stop.set()  # as a signal arriving during step 4 would
        return sft_loss(drafter, seqs[0], anchors, decay=7.0)

    cfg = TrainerConfig(objective="sft", lr=1e-2, num_steps=30, checkpoint_every=10, warmup_ratio=0.0)
    assert train(step_fn, drafter, cfg, tmp_path, progress=False, stop=stop) == 4
    # the state saved at step 4 resumes there, though 4 is not a multiple of checkpoint_every
    stop.clear()
    more = cfg.model_copy(update={"num_steps": 6})
    assert train(step_fn, drafter, more, tmp_path, progress=False, stop=stop) == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


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
    # each step's served tokens of its replayed blocks (r + 1 each): at least 1 and at most K + 1 per block
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    k, most_blocks = drafter.cfg.block_size, cfg.sequences_per_step * cfg.anchors_per_sequence
    assert len(rows) == 40 and all(1 <= r["block_tokens"] <= most_blocks * (k + 1) for r in rows)
    path = save_drafter(drafter, tmp_path / "out", parent_version="v0", step=40)
    assert load_drafter(path).cfg == drafter.cfg
