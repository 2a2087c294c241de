"""The target's features for the capture (capture.py; ``hidden_sample_rate`` > 0, DFlash drafters).

For a share of the teacher-carrying requests the record also keeps the target's aux hidden
states the drafter reads (``SequenceRecord.hidden``), so replay runs no target
forward at all. ``DFlashProposer.propose`` receives them for every token the
target processed in the step (``target_hidden_states``, request i's rows
``query_start_loc[i]:query_start_loc[i + 1]``, their ``target_positions``): the
prefill chunks' prompt tokens, and per decode step the anchor and its drafts.
The request keeps them by position, later rows overwriting earlier ones: a
rejected draft's row at position p is replaced when the target processes the
token sampled there (the next step, or a recompute after preemption), and every
position before the last token is processed with its final token before the
request ends. At the end the rows for positions 0..T-2 are joined; positions the
target never ran (a prefix-cache hit, a step without the drafter) start the
kept rows after the last one missing (``TargetHidden.start``). A request whose
rows pass ``HIDDEN_MAX_BYTES`` stops keeping them.

Here: ``install`` (the hooks), ``join_hidden`` (the rows at the request's end); the per-request keeping is
``Capture.on_context`` (capture.py), which owns the tracked requests.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from online_opd.traces.target_signal import HIDDEN_DTYPES, TargetHidden

logger = logging.getLogger("online_opd.capture")

HIDDEN_MAX_BYTES = 256 << 20  # a request's kept feature rows (rejected drafts' included) past this: kept no more


def join_hidden(parts: list, num_positions: int) -> TargetHidden | None:
    """The rows for positions 0..num_positions - 1 from a request's (positions, rows, events) parts, in step
    order (a later row for a position replaces an earlier one), from the first position after the last
    one missing; None when none is left or a kept row is not finite."""
    if num_positions <= 0 or not parts:
        return None
    for _, _, events in parts:
        for event in events:
            if event is not None:
                event.synchronize()
    width, dtype = parts[0][1].shape[1], parts[0][1].dtype
    out = torch.empty(num_positions, width, dtype=dtype)
    covered = torch.zeros(num_positions, dtype=torch.bool)
    for positions, rows, _ in parts:
        keep = (positions >= 0) & (positions < num_positions)
        out[positions[keep]] = rows[keep]
        covered[positions[keep]] = True
    missing = (~covered).nonzero()
    start = int(missing[-1]) + 1 if missing.numel() else 0
    rows = out[start:]
    if start >= num_positions or not bool(rows.isfinite().all()):
        return None
    if str(dtype).removeprefix("torch.") not in HIDDEN_DTYPES:
        rows = rows.float()
    return TargetHidden.from_tensor(start, rows)


def install(cap: Any, enabled: Any) -> None:
    """The target's features: ``DFlashProposer.propose`` hands them to ``cap.on_context``, with the step's
    request ids, which the model runner's ``propose_draft_token_ids`` (the proposer's caller) sets."""
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_propose, orig_propose_ids = DFlashProposer.propose, GPUModelRunner.propose_draft_token_ids
    signature = inspect.signature(orig_propose)  # vLLM's, through any functools.wraps wrapper
    if not {"target_positions", "target_hidden_states", "common_attn_metadata"} <= set(signature.parameters):
        logger.error("online-opd capture keeps no target features: DFlashProposer.propose%s does not name "
                     "target_positions, target_hidden_states and common_attn_metadata (a wrapper installed "
                     "before this one must keep vLLM's signature: functools.wraps)", signature)
        return

    def propose_draft_token_ids(self, *args, **kwargs):
        cap.proposing = list(self.input_batch.req_ids) if enabled(self) else None
        try:
            return orig_propose_ids(self, *args, **kwargs)
        finally:
            cap.proposing = None

    @functools.wraps(orig_propose)  # keeps dflash_context's installed mark
    def propose(self, *args, **kwargs):
        if cap.proposing is not None:
            try:
                call = signature.bind(self, *args, **kwargs).arguments
                positions = call["target_positions"]
                if positions.dim() == 1:  # not M-RoPE
                    cap.on_context(cap.proposing, positions, call["common_attn_metadata"].query_start_loc_cpu,
                                   call["target_hidden_states"])
            except Exception as exc:
                cap.error("propose", exc)
        return orig_propose(self, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    DFlashProposer.propose = propose
    logger.info("online-opd capture keeps the target's features of %.3g of the teacher-carrying requests",
                cap.settings.hidden_sample_rate)
