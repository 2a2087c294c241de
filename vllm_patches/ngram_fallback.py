"""The ngram fallback inside vLLM's worker: prompt lookup replaces the drafter's block where it pays.

``online-opd serve`` with ``serve.ngram_fallback.enabled`` sets ``ONLINE_OPD_NGRAM_FALLBACK`` (that
config section as JSON); then
``install`` (``register``, in every vLLM process; it acts in the worker) wraps the V1 model runner's
``propose_draft_token_ids``. vLLM's own ``custom_class`` proposer cannot do this: only its ``dflash``
and ``eagle3`` branches hand the drafter the target's auxiliary hidden states, so a hybrid has to sit
behind the drafter, not replace it. After the drafter proposed its blocks (a ``[requests, K]`` tensor),
for each request:

- its context is the tokens already in the input batch plus this step's accepted tokens (the sampled
  row without the rejected slots, ``-1``); drafting runs before vLLM's bookkeeping appends them;
- vLLM's prompt-lookup matcher (``ngram_proposer._find_longest_matched_ngram_and_propose_tokens``,
  the function its ``ngram`` method runs) looks for the longest earlier occurrence of the context's
  last ``prompt_lookup_min``..``prompt_lookup_max`` tokens and proposes the K tokens that followed it;
- with a full K-token match, ``ProposerChooser`` (online_opd/speculation/hybrid.py) decides from the
  acceptance each proposer's blocks got so far, and the match replaces the drafter's row if chosen.

The next step's verification says how many of each block were accepted: that feeds the chooser and the
counters (``online_opd_status``: blocks and accepted tokens per proposer; the endpoint subtracts the
ngram ones from vLLM's counters, so live acceptance per drafter version stays the drafter's). Capture
reads ``proposer_of`` to tag each verified block (``BlockRecord.proposer``).

The drafter still runs on every step: its context K/V must stay complete, and it is the fallback where
nothing matches. Output is unchanged: the target verifies whatever is proposed. Only synchronous
scheduling is supported (vLLM's CPU backend; with async scheduling the next step is scheduled before
the drafts could be replaced): there the fallback stays off and says so once. Nothing here raises
into vLLM: errors are logged once and counted, and the drafter's block is kept.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from online_opd.config_serving import NgramFallbackConfig
from online_opd.speculation.hybrid import DRAFTER, NGRAM, ProposerChooser
from vllm_patches import NGRAM_FALLBACK_ENV, settings_from_env

logger = logging.getLogger("online_opd.ngram_fallback")


# the config section itself travels as the worker's settings (its validation runs on both sides)
NgramFallbackSettings = NgramFallbackConfig


def _matcher():
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as match

    return match


class NgramFallback:
    """Per-worker state: the chooser, the proposer of each request's pending block, the counters."""

    def __init__(self, settings: NgramFallbackSettings):
        self.settings = settings
        self.chooser = ProposerChooser(explore_every=settings.explore_every)
        self._match = None  # vLLM's matcher, imported at the first step: importing numba before vLLM's
        # worker set up (register() runs earlier) breaks its CPU kernel overrides' scan of sys.modules
        self._pending: dict[str, str] = {}  # req_id -> proposer of the block it will verify next
        self.counters = {f"{p}_{what}": 0 for p in (DRAFTER, NGRAM) for what in ("blocks", "accepted")}
        self.counters.update(ngram_proposed=0, matches=0, errors=0)
        self._errors_logged: set[str] = set()

    def proposer_of(self, req_id: str) -> str:
        """Who drafted the block this request verifies in the current step (capture's tag)."""
        return self._pending.get(req_id, DRAFTER)

    def on_proposed(self, runner: Any, scheduler_output: Any, sampled: Any, drafts: Any) -> Any:
        """Account this step's verified blocks; return the drafts with chosen matches put in."""
        req_ids = list(runner.input_batch.req_ids)
        rows = sampled.tolist() if torch.is_tensor(sampled) else [list(r) for r in sampled]
        accepted = [[t for t in row if t >= 0] for row in rows]
        self._account(req_ids, accepted, scheduler_output)
        if not torch.is_tensor(drafts) or drafts.dim() != 2 or drafts.shape[1] == 0:
            self._pending = {}
            return drafts
        k = int(drafts.shape[1])
        if self._match is None:
            self._match = _matcher()
        batch = runner.input_batch
        discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        max_len = int(runner.max_model_len)
        pending: dict[str, str] = {}
        replaced: dict[int, np.ndarray] = {}
        for i, rid in enumerate(req_ids[: drafts.shape[0]]):
            if i >= len(accepted) or not accepted[i] or (discard is not None and bool(discard[i])):
                continue  # a partial prefill: nothing sampled to draft from
            n = int(batch.num_tokens_no_spec[i])
            context = np.concatenate([batch.token_ids_cpu[i, :n], np.asarray(accepted[i], dtype=np.int32)])
            match = self._match(context, self.settings.prompt_lookup_min, self.settings.prompt_lookup_max,
                                max_len, k)
            has_match = len(match) == k
            self.counters["matches"] += has_match
            proposer = self.chooser.choose(rid, has_match)
            pending[rid] = proposer
            if proposer == NGRAM:
                replaced[i] = match
        self._pending = pending
        if len(self.chooser) > 2 * len(req_ids) + 64:
            self.chooser.keep_only(set(req_ids))
        if not replaced:
            return drafts
        out = drafts.clone()
        for i, match in replaced.items():
            out[i] = torch.from_numpy(np.ascontiguousarray(match, dtype=np.int64)).to(out.device, out.dtype)
        self.counters["ngram_proposed"] += len(replaced)
        return out

    def _account(self, req_ids: list[str], accepted: list[list[int]], scheduler_output: Any) -> None:
        verified = scheduler_output.scheduled_spec_decode_tokens
        for i, rid in enumerate(req_ids):
            proposer = self._pending.get(rid)
            if proposer is None or i >= len(accepted) or not accepted[i] or not verified.get(rid):
                continue  # no block of ours verified for it in this step
            r = len(accepted[i]) - 1
            self.chooser.observe(rid, proposer, r)
            self.counters[f"{proposer}_blocks"] += 1
            self.counters[f"{proposer}_accepted"] += r

    def stats(self) -> dict:
        c = self.counters
        return dict(c, requests=len(self.chooser), settings=self.settings.model_dump(),
                    ngram_mean=self.chooser.mean(NGRAM), drafter_mean=self.chooser.mean(DRAFTER))

    def error(self, where: str, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self._pending = {}
        if where not in self._errors_logged:
            self._errors_logged.add(where)
            logger.exception("online-opd ngram fallback error in %s (further ones are counted only; the "
                             "drafter's blocks are kept): %s", where, exc)


_FALLBACK: NgramFallback | None = None


def current() -> NgramFallback | None:
    return _FALLBACK


def proposer_of(req_id: str) -> str:
    """The proposer of the block ``req_id`` verifies in this step ("drafter" without the fallback)."""
    return DRAFTER if _FALLBACK is None else _FALLBACK.proposer_of(req_id)


def install(settings: NgramFallbackSettings) -> NgramFallback:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` (the CPU runner subclasses it) once per process."""
    global _FALLBACK
    if _FALLBACK is not None:
        return _FALLBACK
    from vllm_patches.propose_hook import wrap_propose

    fallback = _FALLBACK = NgramFallback(settings)
    wrap_propose(fallback, logger, "ngram fallback")
    logger.info("online-opd ngram fallback installed: prompt lookup %d-%d, a losing proposer retried every "
                "%d matches", settings.prompt_lookup_min, settings.prompt_lookup_max, settings.explore_every)
    return fallback


def install_from_env() -> NgramFallback | None:
    settings = settings_from_env(NGRAM_FALLBACK_ENV, NgramFallbackSettings, "ngram fallback")
    return None if settings is None else install(settings)
