"""Greedy drafting over the draft vocabulary, not the target's: the same tokens, without a
[rows, target vocabulary] tensor.

vLLM 0.32's DFlash drafter with a reduced draft vocabulary (``draft_vocab_size`` and its
``draft_id_to_target_id`` map, online-opd's default of 8,192 of SmolLM2's 49,152 ids) computes
its logits over the draft ids and then, in ``compute_logits``
(``model_executor/models/qwen3_dflash.py``), scatters them into a new [rows, 49152] tensor of
-inf, which the proposer's ``_greedy_sample`` takes the argmax of. On the 2-core CPU the fill and
the scatter cost more than the LM head itself: 10.8 ms against 4.75 ms for the argmax over the
draft columns at 128 rows (batch 32, K=4), 3.15 against 1.73 ms at 32 rows (torch, float32).

``install`` replaces ``DFlashProposer._greedy_sample`` for drafters with a map: the argmax of
the draft logits (``logits_processor(lm_head, hidden)``, vLLM's own first line of
``compute_logits``), mapped to a target id (``index + d2t[index]``). The same tokens, bit for
bit: every other column of vLLM's tensor is -inf, and online-opd refuses maps that are not
strictly ascending (``check_d2t``), so the first maximal draft column is the first maximal target
column (ties and NaNs included). Drafters without a map, vLLM's local-argmax or heterogeneous-
vocabulary modes, and any model without the attributes used here keep vLLM's own method.

An observer (draft trimming, ``draft_trim.py``) sees each call's draft-space logits: the
confidences it needs are softmax maxima over exactly those columns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("online_opd.draft_sample")

#: Called with (proposer, draft-space logits) on every greedy draft; the logits are None where
#: vLLM's own method drafted (they were not computed here).
Observer = Callable[[Any, torch.Tensor | None], None]

_INSTALLED = False
_OBSERVER: Observer | None = None


def draft_space_logits(model: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, d2t): the drafter's logits over its own vocabulary and its draft-to-target offsets,
    or vLLM's ``compute_logits`` (target columns) and None for a drafter without a map."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    if d2t is None or head is None or processor is None:
        return model.compute_logits(hidden_states), None
    return processor(head, hidden_states), d2t


def greedy_target_ids(logits: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """[rows] target ids of each row's first maximal column (draft columns mapped through d2t)."""
    index = logits.argmax(dim=-1)
    return index if d2t is None else index + d2t.index_select(0, index)


def set_observer(observer: Observer | None) -> None:
    """Let ``observer`` see every greedy draft's draft-space logits (None: nobody)."""
    global _OBSERVER
    _OBSERVER = observer


def install() -> None:
    """Replace ``DFlashProposer._greedy_sample`` once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.spec_decode.dflash import DFlashProposer

    orig_sample = DFlashProposer._greedy_sample

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        observer = _OBSERVER
        if self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            if observer is not None:
                observer(self, None)
            return orig_sample(self, hidden_states)
        logits, d2t = draft_space_logits(self.model, hidden_states)
        if observer is not None:
            observer(self, logits)  # it must not raise (draft_trim.py catches and counts)
        return greedy_target_ids(logits, d2t)

    _greedy_sample.__wrapped__ = orig_sample
    DFlashProposer._greedy_sample = _greedy_sample
    _INSTALLED = True
    logger.debug("DFlash drafts are argmaxed over the draft vocabulary")
