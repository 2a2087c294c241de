"""vllm_patches.zero_draft: a step without drafts gets the plain sampler's output.

vLLM's own RejectionSampler and Sampler on CPU (the platform's kernel overrides
registered as in the engine): at zero drafts the rejection sampler's result and
the plain sampler's are equal, tokens and logprobs, greedy and seeded random
rows; a step with drafts still goes through the rejection sampler. The served
path (K = 0 stretches, exploration bursts, outputs equal to plain vLLM's) is
covered by tests/test_speculation_serve.py on the real engine.
"""

from __future__ import annotations

import pytest
import torch

from vllm_patches import cpu_fixes, zero_draft

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

BATCH, VOCAB = 4, 64


@pytest.fixture(scope="module")
def vllm_sampling():
    """vLLM's RejectionSampler class and an instance built as the model runner builds it."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.triton_utils import dispatcher

        current_platform.import_kernels()
        cpu_fixes.apply()
        # once per process: a second registration rescans every loaded module for kernel holders and
        # trips over objects other tests loaded (vLLM's _rebind_kernels); test_cpu_fixes may have done it
        if not any(name.startswith("vllm.v1.sample.rejection_sampler.") for name in dispatcher._registry):
            current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    return RejectionSampler, RejectionSampler(Sampler())


def _sampling_metadata(temperatures: list[float], logprobs: int | None, seed: int = 0):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temperatures)
    greedy = all(t == 0 for t in temperatures)
    return SamplingMetadata(
        temperature=None if greedy else torch.tensor(temperatures),
        all_greedy=greedy, all_random=all(t > 0 for t in temperatures), top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(seed + i) for i, t in enumerate(temperatures) if t > 0},
        max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=[[] for _ in range(n)])


def _spec_metadata(drafts: list[list[int]]):
    """SpecDecodeMetadata as GPUModelRunner._calc_spec_decode_metadata lays it out."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num_draft = [len(d) for d in drafts]
    cu_sampled = torch.cumsum(torch.tensor([n + 1 for n in num_draft]), 0).to(torch.int32)
    starts = cu_sampled - torch.tensor([n + 1 for n in num_draft], dtype=torch.int32)
    target = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n in zip(starts.tolist(), num_draft)])
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=torch.cumsum(torch.tensor(num_draft), 0).to(torch.int32),
        cu_num_sampled_tokens=cu_sampled, target_logits_indices=target,
        bonus_logits_indices=cu_sampled - 1, logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32))


def _original_forward(cls):
    """RejectionSampler.forward as vLLM defines it, whether or not install() ran in this process."""
    return getattr(cls.forward, "__wrapped__", cls.forward)


def _assert_same(a, b) -> None:
    assert a.sampled_token_ids.dtype == b.sampled_token_ids.dtype == torch.int32
    assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)
    if a.logprobs_tensors is None:
        assert b.logprobs_tensors is None
        return
    assert torch.equal(a.logprobs_tensors.logprob_token_ids, b.logprobs_tensors.logprob_token_ids)
    assert torch.allclose(a.logprobs_tensors.logprobs, b.logprobs_tensors.logprobs)
    assert torch.equal(a.logprobs_tensors.selected_token_ranks, b.logprobs_tensors.selected_token_ranks)


@pytest.mark.parametrize(("temperatures", "logprobs"), [
    ([0.0] * BATCH, None), ([0.0] * BATCH, 3), ([0.8, 1.2, 0.5, 1.0], None), ([0.0, 0.8, 0.0, 1.3], 2)])
def test_a_step_without_drafts_samples_as_the_rejection_sampler_does(vllm_sampling, temperatures, logprobs):
    cls, sampler = vllm_sampling
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(7))
    metadata = _spec_metadata([[]] * BATCH)
    reference = _original_forward(cls)(sampler, metadata, None, logits.clone(), _sampling_metadata(temperatures, logprobs))
    plain = zero_draft.sample_without_drafts(sampler, metadata, logits.clone(), _sampling_metadata(temperatures, logprobs))
    assert plain is not None and plain.sampled_token_ids.shape == (BATCH, 1)
    _assert_same(plain, reference)
    if all(t == 0 for t in temperatures):
        assert plain.sampled_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()


def test_a_step_with_drafts_is_left_to_the_rejection_sampler(vllm_sampling):
    _, sampler = vllm_sampling
    metadata = _spec_metadata([[5, 6], [], [7], []])
    logits = torch.randn(7, VOCAB)
    assert zero_draft.sample_without_drafts(sampler, metadata, logits, _sampling_metadata([0.0] * 4, None)) is None
    # logits that are not one row per request are not the runner's layout: left alone
    assert zero_draft.sample_without_drafts(sampler, _spec_metadata([[]] * 4), torch.randn(5, VOCAB),
                                            _sampling_metadata([0.0] * 4, None)) is None


def test_install_routes_only_draft_free_steps_to_the_plain_sampler(vllm_sampling, monkeypatch):
    cls, sampler = vllm_sampling
    zero_draft.install()
    zero_draft.install()  # once per process: a second call wraps nothing twice
    original = _original_forward(cls)
    assert original.__name__ == "forward" and original is not cls.forward
    calls = []
    plain_forward = sampler.sampler.forward

    def counting(logits, sampling_metadata, *args, **kwargs):
        calls.append(sampling_metadata.max_num_logprobs)
        return plain_forward(logits, sampling_metadata, *args, **kwargs)

    monkeypatch.setattr(sampler.sampler, "forward", counting)
    logits = torch.randn(BATCH, VOCAB)
    out = sampler(_spec_metadata([[]] * BATCH), None, logits.clone(), _sampling_metadata([0.0] * BATCH, None))
    assert calls == [None] and out.sampled_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    calls.clear()
    with_drafts = _spec_metadata([[int(logits[0].argmax())], [], [], []])
    logits = torch.cat([logits[:1], logits])  # the drafted row's target logits, then every bonus row
    out = sampler(with_drafts, None, logits.clone(), _sampling_metadata([0.0] * BATCH, None))
    assert calls == [-1]  # the rejection sampler's bonus pass (full raw logits), as vLLM does it
    assert out.sampled_token_ids.shape == (BATCH, 2)

