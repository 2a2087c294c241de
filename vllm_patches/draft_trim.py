"""Draft trimming inside vLLM's worker: each request verifies only the drafted tokens likely to pay.

``online-opd serve`` with ``serve.draft_trim.enabled`` (and ``--speculation auto``, whose policy loop
sets the thresholds, or a fixed ``serve.draft_trim.threshold``) sets ``ONLINE_OPD_DRAFT_TRIM``; then
``install`` (``register``, in every vLLM process; it acts in the worker) wraps:

- ``DFlashProposer._greedy_sample`` (through ``draft_sample.py``'s observer: the same tokens): each
  drafted position's confidence, its top softmax probability over the drafter's own vocabulary,
  kept on the proposer for this step;
- the V1 model runner's ``propose_draft_token_ids`` (outside the ngram fallback's wrapper, when both
  are on): each request's block is cut to the leading tokens whose calibrated probability of all
  being accepted exceeds the threshold of this step's batch size (online_opd/speculation/trim.py),
  and handed to the scheduler as per-request lists, as vLLM's own ngram proposer does (synchronous
  scheduling only: under async scheduling the drafts stay on the device and nothing is trimmed).
  Blocks the ngram fallback put in are kept whole (no confidence of the drafter's says anything
  about them). The next step's verification (its sampled tokens) says how many of each kept block
  were accepted: that teaches the calibration.

``online_opd_trim(thresholds)`` (worker_ext.py, called by the policy loop through
``collective_rpc``) sets the thresholds by batch size and returns the figures: counters, the
calibration, and the outlook (drafted and accepted tokens per block at each threshold, from the
recent untrimmed blocks' confidences) with which the policy decides whether speculating pays. Until
the first call nothing is trimmed; a configured ``threshold`` holds at every batch size instead. A
reload resets the calibration (``reset``): a new version's confidences mean something else.

Output is unchanged: the target verifies every token kept, and a kept prefix is the drafter's own.
Nothing here raises into vLLM: errors are logged once and counted, and the untrimmed drafts stay.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from online_opd.config_serving import DraftTrimConfig
from online_opd.speculation.hybrid import NGRAM
from online_opd.speculation.trim import ConfidenceCalibration, TrimOutlook
from vllm_patches import DRAFT_TRIM_ENV, settings_from_env

logger = logging.getLogger("online_opd.draft_trim")

DraftTrimSettings = DraftTrimConfig
_CONFIDENCE = "_online_opd_draft_confidence"


def draft_confidence(logits: torch.Tensor) -> torch.Tensor:
    """[rows] top softmax probability of each row of draft-space logits (``draft_sample.py``: the
    draft vocabulary's columns only, where the drafter has one)."""
    x = logits.float()
    return torch.exp(x.max(dim=-1).values - torch.logsumexp(x, dim=-1))


class DraftTrim:
    """Per-worker state: calibration, outlook, thresholds, the confidences of pending blocks."""

    def __init__(self, settings: DraftTrimSettings):
        self.settings = settings
        self.calibration: ConfidenceCalibration | None = None  # made at the first drafted block
        self.outlook = TrimOutlook(settings.outlook_blocks)
        # by batch size, index 0 unused; None: trim nothing (until the policy sends them)
        self.thresholds: list[float] | None = None if settings.threshold is None else [0.0, settings.threshold]
        self._pending: dict[str, np.ndarray] = {}  # req_id -> confidences of the tokens it verifies next
        self._widths: dict[str, int] = {}  # req_id -> width of the block it verifies next (drafter rows)
        self.counters = {"blocks": 0, "trimmed_blocks": 0, "drafted_tokens": 0, "kept_tokens": 0,
                         "verified_blocks": 0, "accepted_tokens": 0, "errors": 0}
        self._errors_logged: set[str] = set()

    def set_thresholds(self, thresholds: list[float] | None) -> None:
        """The policy's thresholds by batch size; ignored where the config fixes one."""
        if self.settings.threshold is not None:
            return
        if thresholds is not None:
            thresholds = [float(t) for t in thresholds]
            if any(not 0.0 <= t <= 1.0 for t in thresholds):
                raise ValueError(f"thresholds must be in [0, 1]: {thresholds}")
        self.thresholds = thresholds

    def threshold_for(self, batch_size: int) -> float | None:
        t = self.thresholds
        if not t or len(t) < 2:
            return None
        return t[min(batch_size, len(t) - 1)]

    def reset(self) -> None:
        """A new drafter version: forget the calibration and the outlook."""
        if self.calibration is not None:
            self.calibration.reset()
        self.outlook.blocks.clear()
        self._pending = {}
        self._widths = {}

    def on_proposed(self, runner: Any, scheduler_output: Any, sampled: Any, drafts: Any) -> Any:
        """Learn from this step's verified blocks; return the drafts, trimmed per request."""
        req_ids = list(runner.input_batch.req_ids)
        rows = sampled.tolist() if torch.is_tensor(sampled) else [list(r) for r in sampled]
        self._account(req_ids, [[t for t in row if t >= 0] for row in rows], scheduler_output)
        conf = getattr(runner.drafter, _CONFIDENCE, None)
        setattr(runner.drafter, _CONFIDENCE, None)
        if (not torch.is_tensor(drafts) or drafts.dim() != 2 or drafts.shape[1] == 0 or conf is None
                or conf.numel() != drafts.numel()):
            self._pending, self._widths = {}, {}
            return drafts
        num, k = drafts.shape
        if self.calibration is None:
            self.calibration = ConfidenceCalibration(
                max(k, int(runner.speculative_config.num_speculative_tokens)), prior=self.settings.prior)
        conf = conf.view(num, k).cpu().numpy().astype(np.float64)
        if k == self.calibration.max_k:
            self.outlook.add(conf)
        threshold = self.threshold_for(len(req_ids))
        keep = np.full(num, k) if threshold is None else self.calibration.keep_lengths(conf, threshold)
        fallback = _ngram_fallback()
        pending: dict[str, np.ndarray] = {}
        for i, rid in enumerate(req_ids[:num]):
            if fallback is not None and fallback.proposer_of(rid) == NGRAM:
                keep[i] = k  # an ngram match: the drafter's confidence says nothing about it
            else:
                pending[rid] = conf[i, : keep[i]]
        self._pending = pending
        self._widths = {rid: k for rid in pending}
        c = self.counters
        c["blocks"] += num
        c["drafted_tokens"] += num * k
        c["kept_tokens"] += int(keep.sum())
        c["trimmed_blocks"] += int((keep < k).sum())
        if (keep == k).all():
            return drafts
        return [row[:n] for row, n in zip(drafts.tolist(), keep.tolist())]

    def drafted_width(self, req_id: str) -> int | None:
        """Tokens the drafter drafted in the block ``req_id`` verifies now (None: not the drafter's)."""
        return self._widths.get(req_id)

    def _account(self, req_ids: list[str], accepted: list[list[int]], scheduler_output: Any) -> None:
        if self.calibration is None:
            return
        verified = scheduler_output.scheduled_spec_decode_tokens
        for i, rid in enumerate(req_ids):
            conf = self._pending.get(rid)
            drafted = verified.get(rid)
            if conf is None or not drafted or i >= len(accepted) or not accepted[i]:
                continue  # no block of the drafter's verified for it in this step
            r = len(accepted[i]) - 1
            self.calibration.observe(conf[: len(drafted)], r)
            self.counters["verified_blocks"] += 1
            self.counters["accepted_tokens"] += r

    def stats(self, with_outlook: bool = True) -> dict:
        """Counters, thresholds, calibration; the outlook (the policy's input, computed over the recent
        blocks) only when asked: the engine status polls every few seconds between steps."""
        cal = self.calibration
        out = {**self.counters, "thresholds": self.thresholds, "settings": self.settings.model_dump(),
               "calibration": cal.to_dict() if cal is not None else None,
               "outlook_blocks": len(self.outlook.blocks)}
        if with_outlook:
            out["outlook"] = self.outlook.summary(cal) if cal is not None else []
        return out

    def error(self, where: str, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self._pending = {}
        self._widths = {}
        if where not in self._errors_logged:
            self._errors_logged.add(where)
            logger.exception("online-opd draft trimming error in %s (further ones are counted only; the "
                             "untrimmed drafts are kept): %s", where, exc)


def _ngram_fallback():
    from vllm_patches import ngram_fallback

    return ngram_fallback.current()


_TRIM: DraftTrim | None = None


def current() -> DraftTrim | None:
    return _TRIM


def drafted_width(req_id: str) -> int | None:
    """The drafter's block width for the block ``req_id`` verifies now (None without trimming)."""
    return None if _TRIM is None else _TRIM.drafted_width(req_id)


def install(settings: DraftTrimSettings) -> DraftTrim:
    """Wrap the DFlash proposer's sampling and the model runner's drafting, once per process."""
    global _TRIM
    if _TRIM is not None:
        return _TRIM
    from vllm_patches import draft_sample
    from vllm_patches.propose_hook import wrap_propose

    trim = _TRIM = DraftTrim(settings)

    def observe(proposer: Any, logits: torch.Tensor | None) -> None:
        try:
            setattr(proposer, _CONFIDENCE, None if logits is None else draft_confidence(logits))
        except Exception as exc:
            setattr(proposer, _CONFIDENCE, None)
            trim.error("_greedy_sample", exc)

    draft_sample.install()
    draft_sample.set_observer(observe)
    wrap_propose(trim, logger, "draft trimming")
    logger.info("online-opd draft trimming installed: calibration prior %.1f blocks per bin, outlook of %d "
                "blocks", settings.prior, settings.outlook_blocks)
    return trim


def install_from_env() -> DraftTrim | None:
    settings = settings_from_env(DRAFT_TRIM_ENV, DraftTrimSettings, "draft trimming")
    return None if settings is None else install(settings)
