"""Reduced draft vocabulary (drafter.draft_vocab_size): selection by hand, the drafter's logits, its
checkpoint in vLLM's format, and the losses restricted to it."""

from __future__ import annotations

import json

import pytest
import torch

from online_opd.models.drafters.checkpoint import CheckpointError, load_drafter, save_drafter
from online_opd.models.drafters.dflash import DFlashConfig, DFlashDrafter, init_weights
from online_opd.models.drafters.vocab import count_target_tokens, coverage, select_draft_vocab
from online_opd.opd.losses import draft_opd_loss
from online_opd.train.sequences import TrainSequence
from online_opd.train.sft import sft_loss

V, H = 12, 16


def test_selection_by_hand():
    counts = torch.tensor([0, 5, 1, 5, 9, 0, 2, 0])
    assert select_draft_vocab(counts, 3).tolist() == [1, 3, 4]  # 9, then the tie 5/5
    assert select_draft_vocab(counts, 3, required=[7]).tolist() == [1, 4, 7]  # 7 forced in: 3 (the later tie) drops
    assert select_draft_vocab(counts, 8).tolist() == list(range(8))
    assert coverage(counts, torch.tensor([1, 3, 4])) == 19 / 22
    with pytest.raises(ValueError, match="outside 1..8"):
        select_draft_vocab(counts, 9)
    with pytest.raises(ValueError, match="do not fit"):
        select_draft_vocab(counts, 1, required=[2, 3])


def test_counts_take_rollout_responses_and_text_labels():
    rollout = TrainSequence(torch.tensor([9, 9, 1, 2, 2]), prompt_len=2)
    text = TrainSequence(torch.tensor([9, 3, 4, 5]), prompt_len=1)
    text.labels = torch.tensor([9, 3, 6, 6])  # position 1 is the text's own token, 2.. the target's argmax
    assert count_target_tokens([rollout, text], 10).tolist() == [0, 1, 2, 0, 0, 0, 2, 0, 0, 0]


def _drafter(draft_vocab_size: int | None) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                       vocab_size=V, target_layer_ids=(0, 1), mask_token_id=V - 1, block_size=3,
                       draft_vocab_size=draft_vocab_size)
    drafter = DFlashDrafter(cfg)
    init_weights(drafter, seed=1)
    gen = torch.Generator().manual_seed(2)
    drafter.attach_target(torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen))
    return drafter


def _inputs():
    gen = torch.Generator().manual_seed(3)
    aux = torch.randn(6, 2 * H, generator=gen)
    return aux, torch.tensor([2, 4]), torch.tensor([5, 7])


def test_reduced_logits_are_the_full_drafters_on_the_draft_ids_and_minus_inf_elsewhere():
    full, reduced = _drafter(None), _drafter(5)
    reduced.load_state_dict({**full.state_dict(), **{k: v for k, v in reduced.state_dict().items()
                                                     if k in ("lm_head.weight", "d2t")}})
    ids = torch.tensor([0, 2, 3, 7, 10])
    reduced.set_draft_vocab(ids)
    assert reduced.d2t.tolist() == [0, 1, 1, 4, 6]  # target id - draft index: vLLM's d2t
    a, b = full(*_inputs()), reduced(*_inputs())
    assert torch.allclose(b[..., ids], a[..., ids], atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(b[..., outside]).all()
    assert set(reduced.propose(*_inputs()).flatten().tolist()) <= set(ids.tolist())


def test_checkpoint_carries_the_head_and_d2t_as_vllm_loads_them(tmp_path):
    drafter = _drafter(4)
    drafter.set_draft_vocab(torch.tensor([1, 4, 5, 9]))
    path = save_drafter(drafter, tmp_path / "d")
    config = json.loads((path / "config.json").read_text())
    assert config["draft_vocab_size"] == 4 and config["vocab_size"] == V
    loaded = load_drafter(path)
    assert loaded.d2t.dtype == torch.int64 and loaded.d2t.tolist() == [1, 3, 3, 6]
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head_weight[[1, 4, 5, 9]])
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["d2t"] = torch.tensor([1, 3, 2, 6])  # ids 1, 4, 4, 9: not distinct
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="d2t.*ascending"):
        load_drafter(path, verify_hashes=False)


def test_losses_stay_finite_and_ignore_what_the_draft_vocabulary_cannot_reach():
    drafter = _drafter(5)
    drafter.set_draft_vocab(torch.tensor([0, 2, 3, 7, 10]))
    logits = drafter(*_inputs())  # [2, 3, V]
    target = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(4))
    loss = draft_opd_loss(target, logits, torch.tensor([1, 0]), gamma=0.8)
    loss.loss.backward()
    assert torch.isfinite(loss.loss) and all(torch.isfinite(p.grad).all() for p in drafter.parameters()
                                             if p.grad is not None)
    # the teacher renormalised over the draft vocabulary: KL 0 when the drafter matches it there
    matched = torch.full_like(target, float("-inf"))
    ids = drafter.draft_token_ids()
    matched[..., ids] = target[..., ids]
    zero = draft_opd_loss(target, matched, torch.tensor([1, 0]), gamma=0.8)
    assert abs(float(zero.loss)) < 1e-6
    seq = TrainSequence(torch.tensor([1, 5, 2, 3, 11, 7, 0]), prompt_len=1)
    seq.aux_hidden = _inputs()[0][:6].repeat(2, 1)[:7]
    ce, stats = sft_loss(drafter, seq, torch.tensor([2]), decay=7.0)
    assert torch.isfinite(ce)  # label 11 (position 4) is outside the draft vocabulary: not supervised
    assert stats["supervised_pos2"] == 0.0 and stats["supervised_pos1"] == 1.0


def test_sft_loss_in_draft_space_equals_the_loss_over_the_whole_vocabulary():
    """sft_loss scores a reduced drafter over its draft vocabulary only: the loss, its gradients and
    the stats are those of cross-entropy over vLLM's [.., vocab] logits (-inf outside), labels that
    the vocabulary cannot reach unsupervised."""
    import torch.nn.functional as F

    from online_opd.train.sft import block_labels, position_weights, to_draft_space

    ids = torch.tensor([0, 2, 3, 7, 10])
    assert to_draft_space(torch.tensor([[7, -100, 3], [5, 10, 0]]), ids, V).tolist() == [[3, -100, 2], [-100, 4, 0]]
    drafter = _drafter(5)
    drafter.set_draft_vocab(ids)
    seq = TrainSequence(torch.tensor([1, 5, 2, 5, 7, 1, 0, 10, 2]), prompt_len=1)
    seq.aux_hidden = torch.randn(9, 2 * H, generator=torch.Generator().manual_seed(5))
    anchors = torch.tensor([1, 3, 5])
    loss, stats = sft_loss(drafter, seq, anchors, decay=2.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    full = drafter(seq.aux_hidden[:5], anchors, seq.tokens[anchors])  # [3, 3, V], -inf outside ids
    labels = block_labels(seq.tokens, anchors, 3)
    labels = labels.masked_fill(~torch.isin(labels, ids), -100)  # 5 and 1 cannot be drafted
    assert (labels == -100).sum() == 2
    ce = F.cross_entropy(full.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="none")
    weights = position_weights(3, 2.0)[None, :] * (labels != -100)
    expected = (ce.view_as(weights) * weights).sum() / weights.sum()
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert grads.keys() == {n for n, p in drafter.named_parameters() if p.grad is not None}
    assert all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in drafter.named_parameters() if n in grads)
    hits = (full.argmax(-1) == labels) & (labels != -100)
    assert stats["top1_pos1"] == float(hits[:, 0].float().mean())
    assert stats["supervised_pos1"] == float((labels[:, 0] != -100).float().mean())


def test_hot_reload_checks_take_a_reduced_head_and_refuse_a_bad_map(tmp_path):
    from safetensors.torch import load_file, save_file

    from vllm_patches.worker_ext import ReloadError, read_checked_tensors, verify_for_reload

    drafter = _drafter(4)
    drafter.set_draft_vocab(torch.tensor([1, 4, 5, 9]))
    path = save_drafter(drafter, tmp_path / "d")
    serving = json.loads((path / "config.json").read_text())
    assert set(read_checked_tensors(path, None, serving)) >= {"lm_head.weight", "d2t"}  # the drafter's own
    verify_for_reload(path, None)
    tensors = load_file(path / "model.safetensors")
    tensors["d2t"] = torch.tensor([1, 3, 3, 9])  # id 12: beyond the target's 12-token vocabulary
    save_file(tensors, path / "model.safetensors")
    (path / "manifest.json").unlink()
    with pytest.raises(ReloadError, match="d2t.*0..11"):
        verify_for_reload(path, None)
    full = save_drafter(_drafter(None), tmp_path / "full")
    tensors = {**load_file(full / "model.safetensors"), "lm_head.weight": torch.zeros(V, H)}
    save_file(tensors, full / "model.safetensors")
    (full / "manifest.json").unlink()
    with pytest.raises(ReloadError, match="shared target tensors"):  # a full-vocabulary drafter shares the head
        verify_for_reload(full, None)


def test_bootstrap_vocabulary_comes_from_the_targets_tokens_with_the_end_of_turn_token():
    from types import SimpleNamespace

    from online_opd.config import load_config
    from serve.pipeline import choose_draft_vocab

    drafter = _drafter(4)
    rollout = TrainSequence(torch.tensor([1, 1, 6, 6, 6, 3, 3, 8]), prompt_len=2)  # responses: 6 x3, 3 x2, 8
    figures = choose_draft_vocab(load_config(None, []), drafter, SimpleNamespace(eos_token_id=11), [rollout])
    assert drafter.draft_token_ids().tolist() == [3, 6, 8, 11]
    assert figures == {"draft_vocab_size": 4, "draft_vocab_coverage": 1.0, "draft_vocab_source": "training sequences"}
    assert choose_draft_vocab(load_config(None, []), _drafter(None), None, [rollout]) == {}  # full vocabulary


def _eagle3(draft_vocab_size: int | None):
    from online_opd.models.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config(hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                       vocab_size=V, target_layer_ids=(0, 1), block_size=3, draft_vocab_size=draft_vocab_size)
    drafter = Eagle3Drafter(cfg)
    init_weights(drafter, std=1.0, seed=4)  # large enough that the chain's steps differ
    gen = torch.Generator().manual_seed(2)
    drafter.attach_target(torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen))
    return drafter


def test_eagle3_drafts_over_a_reduced_vocabulary_as_vllm_chains_it(tmp_path):
    """EAGLE-3 with draft_vocab_size: the logits are the full-vocabulary head's on the draft ids and
    -inf elsewhere (vLLM's compute_logits), draft space is those columns, each greedy step feeds the
    next the target id of its argmax, and the checkpoint carries the head rows and d2t vLLM loads."""
    from online_opd.config import load_config

    full, reduced = _eagle3(None), _eagle3(5)
    reduced.load_state_dict({**full.state_dict(), **{k: v for k, v in reduced.state_dict().items()
                                                     if k in ("lm_head.weight", "d2t")}})
    ids = torch.tensor([0, 2, 3, 7, 10])
    reduced.set_draft_vocab(ids)
    aux, anchors, anchor_tokens = _inputs()
    tokens = torch.tensor([1, 5, 2, 5, 7, 1])
    logged = torch.tensor([[3, 7, 0], [10, 2, 2]])  # logged drafts: both chains see the same inputs
    a = full(aux, anchors, anchor_tokens, tokens, draft_tokens=logged)
    b = reduced(aux, anchors, anchor_tokens, tokens, draft_tokens=logged)
    assert torch.allclose(b[..., ids], a[..., ids], atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(b[..., outside]).all()
    small = reduced(aux, anchors, anchor_tokens, tokens, draft_tokens=logged, draft_space=True)
    assert small.shape == (2, 3, 5) and torch.equal(small, b[..., ids])
    drafts = reduced.propose(aux, anchors, anchor_tokens, tokens)
    assert set(drafts.flatten().tolist()) <= set(ids.tolist())
    # greedy: the chain fed its own drafts gives the same drafts back (step k+1 saw target id d_k)
    again = reduced(aux, anchors, anchor_tokens, tokens, draft_tokens=drafts)
    assert torch.equal(again.argmax(-1), drafts)
    assert len(set(drafts.flatten().tolist())) > 1  # the steps differ, so the chain is really compared
    assert reduced(aux, anchors[:0], anchor_tokens[:0], tokens, draft_space=True).shape == (0, 3, 5)

    path = save_drafter(reduced, tmp_path / "e")
    config = json.loads((path / "config.json").read_text())
    assert (config["draft_vocab_size"], config["vocab_size"]) == (5, V)
    loaded = load_drafter(path)
    assert loaded.d2t.tolist() == reduced.d2t.tolist() and loaded.cfg.draft_vocab_size == 5
    assert torch.equal(loaded.lm_head.weight, full.lm_head_weight[ids])
    assert load_drafter(save_drafter(full, tmp_path / "f")).cfg.draft_vocab_size is None  # 12 of 12: none
    cfg = load_config(None, ["drafter.method=eagle3", "drafter.draft_vocab_size=8192"]).drafter
    assert (cfg.method, cfg.draft_vocab_size) == ("eagle3", 8192)
