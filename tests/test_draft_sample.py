"""vllm_patches/draft_sample.py: the argmax over the draft vocabulary is the token vLLM's own
DFlash ``compute_logits(...).argmax(-1)`` picks, ties and NaNs included (vLLM's method runs
here unbound on a stand-in holding real tensors; the real engine's drafts are compared with the
torch drafter's in test_vllm_dflash.py's "dflash-reduced" case)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_patches import draft_sample


def _model(d2t: torch.Tensor | None, vocab: int, head: torch.Tensor):
    """What DFlashQwen3ForCausalLM.compute_logits reads: a processor (here a plain matmul, in place
    of vLLM's LogitsProcessor, which needs an engine config), the head, the map, the config."""
    return SimpleNamespace(logits_processor=lambda lm_head, h: h @ lm_head.weight.T,
                           lm_head=SimpleNamespace(weight=head), draft_id_to_target_id=d2t,
                           config=SimpleNamespace(draft_vocab_size=head.shape[0], vocab_size=vocab))


def _vllm_tokens(model, hidden: torch.Tensor) -> torch.Tensor:
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    return DFlashQwen3ForCausalLM.compute_logits(model, hidden).argmax(dim=-1)


def test_draft_space_argmax_is_vllms_token_on_random_and_tied_logits():
    gen = torch.Generator().manual_seed(0)
    vocab, draft, width = 1000, 64, 16
    ids = torch.sort(torch.randperm(vocab, generator=gen)[:draft]).values  # ascending, as check_d2t demands
    d2t = ids - torch.arange(draft)
    head = torch.randn(draft, width, generator=gen)
    head[10] = head[3]  # rows 3 and 10 tie everywhere: the lower draft id (lower target id) wins
    head[40] = head[3]
    model = _model(d2t, vocab, head)
    hidden = torch.randn(128, width, generator=gen)
    hidden[:8] = head[3] * 10  # rows whose maximum is the tied triple
    hidden[8] = float("nan")  # a NaN row: vLLM's argmax and ours both pick the first NaN column
    logits, got_d2t = draft_sample.draft_space_logits(model, hidden)
    assert logits.shape == (128, draft) and got_d2t is d2t
    ours = draft_sample.greedy_target_ids(logits, got_d2t)
    assert torch.equal(ours, _vllm_tokens(model, hidden))
    assert (ours[:8] == ids[3]).all()
    assert set(ours.tolist()) <= set(ids.tolist())


def test_a_drafter_without_a_map_keeps_vllms_compute_logits():
    head = torch.randn(50, 8)
    calls = []
    model = SimpleNamespace(draft_id_to_target_id=None, compute_logits=lambda h: calls.append(h) or h @ head.T)
    hidden = torch.randn(5, 8)
    logits, d2t = draft_sample.draft_space_logits(model, hidden)
    assert d2t is None and len(calls) == 1 and logits.shape == (5, 50)
    assert torch.equal(draft_sample.greedy_target_ids(logits, None), (hidden @ head.T).argmax(-1))


def test_the_installed_method_drafts_vllms_tokens_and_shows_the_observer_draft_logits(monkeypatch):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    monkeypatch.setattr(DFlashProposer, "_greedy_sample", DFlashProposer._greedy_sample)  # restored after
    monkeypatch.setattr(draft_sample, "_INSTALLED", False)
    draft_sample.install()
    seen = []
    monkeypatch.setattr(draft_sample, "_OBSERVER", lambda proposer, logits: seen.append(logits))
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([2, 5, 6, 30, 31, 44])
    model = _model(ids - torch.arange(6), 50, torch.randn(6, 8, generator=gen))
    proposer = SimpleNamespace(model=model, use_local_argmax_reduction=False, use_heterogeneous_vocab=False)
    hidden = torch.randn(20, 8, generator=gen)
    assert torch.equal(DFlashProposer._greedy_sample(proposer, hidden), _vllm_tokens(model, hidden))
    assert len(seen) == 1 and seen[0].shape == (20, 6)
    # vLLM's own modes keep vLLM's method; the observer hears that no draft logits exist
    proposer.use_heterogeneous_vocab = True
    with pytest.raises(AttributeError):  # vLLM's method needs the real proposer's vocab_mapping
        DFlashProposer._greedy_sample(proposer, hidden)
    assert seen[-1] is None
