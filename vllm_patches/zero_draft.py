"""A step in which no request carries a draft is sampled as plain vLLM samples it.

With a speculative config, vLLM 0.32's V1 model runner treats every step as a
speculative one (``_prepare_inputs``: ``use_spec_decode = self.speculative_config
is not None``) and samples it with the rejection sampler, drafts or not. For a
step with no drafts at all — every step at K = 0 under the speculation policy,
prefill-only steps, an ngram fallback that found nothing — the rejection
sampler still runs its bonus pass with ``max_num_logprobs=-1`` (a float32 copy
of the whole [batch, vocabulary] logits, kept as "raw logits") and its kernels
on empty inputs. On the 2-core CPU that made sampling a K = 0 step at batch 32
3-9x the plain sampler's time (``benchmarks/serving_overhead.py`` and the README
give the served figures).

``install`` wraps ``RejectionSampler.forward``: when ``metadata.max_spec_len``
is 0 it returns ``self.sampler(logits=logits, sampling_metadata=...)``, the call
vLLM's ``GPUModelRunner._sample`` makes without a speculative config. With no
drafts every row of ``logits`` is a bonus row (``logits_indices`` holds one
position per request and ``bonus_logits_indices`` is 0..batch-1), so the sampler
sees the same logits and sampling metadata as in the rejection sampler's bonus
pass: the same tokens (greedy: the argmax of the same processed logits; random:
the same sampler and per-request generators), and logprobs as plain vLLM
computes them. The output has the shape the rejection sampler gives at
``max_spec_len`` 0 ([batch, 1], int32), which the runner's bookkeeping and the
drafter's next-token preparation read the same way. Steps with drafts are
untouched. Wrappers of ``GPUModelRunner._sample`` (capture) see the same
arguments and an equal output.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("online_opd.zero_draft")

_INSTALLED = False


def sample_without_drafts(rejection_sampler: Any, metadata: Any, logits: Any, sampling_metadata: Any) -> Any | None:
    """The plain sampler's output for a step with no drafts; None where the step has drafts
    (or its logits are not one row per request), for the rejection sampler to handle."""
    if metadata.max_spec_len != 0 or logits is None or logits.shape[0] != len(metadata.num_draft_tokens):
        return None
    return rejection_sampler.sampler(logits=logits, sampling_metadata=sampling_metadata)


def install() -> None:
    """Wrap ``RejectionSampler.forward`` once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    orig_forward = RejectionSampler.forward

    def forward(self, metadata, draft_probs, logits, sampling_metadata, *args, **kwargs):
        if not args and not kwargs:
            out = sample_without_drafts(self, metadata, logits, sampling_metadata)
            if out is not None:
                return out
        return orig_forward(self, metadata, draft_probs, logits, sampling_metadata, *args, **kwargs)

    forward.__wrapped__ = orig_forward
    RejectionSampler.forward = forward
    _INSTALLED = True
    logger.debug("steps without drafts sample with the plain sampler")
