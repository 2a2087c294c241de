"""K = 0 steps of a DFlash drafter: store the context K/V, skip the block query.

At K = 0 (a dynamic schedule said "do not speculate at this batch size") vLLM
0.32's proposer still runs the whole first pass (llm_base_proposer.py: "The
prefill forward pass above already ran to keep the drafter KV cache in sync")
and returns no drafts. For DFlash only part of that pass keeps anything: the
context K/V of the tokens the target processed in the step, projected from its
hidden states (``precompute_and_store_context_kv``) into the paged cache, where
the next drafted block attends to them. The drafter's forward over the query
slot ([x_a] with no mask tokens) writes the K/V of position a + 1, which the
next step overwrites with that token's context K/V before anything reads it,
and its hidden states are dropped. So at K = 0 ``propose`` here computes the
context K/V only, at the same positions and cache slots vLLM's input kernel
(``_copy_and_expand_dflash_inputs``) gives them:

    slot = block_table[request, position // block_size] * block_size + position % block_size

for every scheduled token (rejected draft positions included, as the kernel
does: they are rewritten when the target processes those positions again).
On the 2-core CPU this takes a K = 0 step from ~5% to ~1.5% over a plain step.

Deferred. Even that pass, one token per request per decode step, cost about
4% of the worker's time at c=1 (profiled: per-call overhead of a 1-row GEMM,
norm, rotary and cache write), to fill a cache nothing reads until the next
drafted block. So a decode-sized K = 0 step (fewer than ``DEFER_MAX_TOKENS``
tokens) only keeps its tokens' target hidden states, positions and slots;
``flush`` computes and stores all kept ones in one batched pass, before any
of them could be read or their slots reused:

- before a step that drafts (K > 0: the only reader of the drafter's cache);
- before a step whose scheduler output names finished or preempted requests
  (their blocks are freed and may go to another request in that very step; a
  prefix-cache hit reads them only when drafting, which flushes first);
- before a drafter reload (the context must be the old weights', as capture's
  context-purity labels assume);
- when ``FLUSH_TOKENS`` are kept, and before an eager (prefill-sized) pass.

The values stored are the per-token pass's (every op is per token); only the
GEMM's summation order may differ in the last bits, as between vLLM's prefill
and decode passes.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

logger = logging.getLogger("online_opd.speculation")

DEFER_MAX_TOKENS = 64  # a K = 0 step with more tokens (a prefill chunk) is one batched pass already
FLUSH_TOKENS = 256  # kept tokens that trigger a flush (hidden states: 256 x the aux width)
_PENDING = "_online_opd_pending_context"


def context_slots(positions: torch.Tensor, query_start_loc: torch.Tensor, block_table: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """[num_tokens] cache slots of the scheduled tokens (the DFlash input kernel's context slots).

    positions [num_tokens], query_start_loc [num_reqs + 1], block_table [num_reqs, max_blocks].
    """
    counts = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    request = torch.repeat_interleave(torch.arange(counts.numel(), device=positions.device), counts)
    block = torch.clamp(positions // block_size, max=block_table.shape[1] - 1)
    return block_table[request, block].to(torch.int64) * block_size + positions % block_size


class PendingContext:
    """A proposer's kept K = 0 tokens: (target hidden states, positions, cache slots) per step."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_tokens = 0
        self.counters = {"deferred_steps": 0, "flushes": 0, "flushed_tokens": 0}

    def add(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.parts.append((hidden, positions, slots))
        self.num_tokens += int(positions.numel())
        self.counters["deferred_steps"] += 1

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """All kept tokens in the order they were kept (None when there are none); empties the list."""
        if not self.parts:
            return None
        parts, self.parts, self.num_tokens = self.parts, [], 0
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(column) for column in zip(*parts))  # type: ignore[return-value]


def pending_of(proposer: Any) -> PendingContext:
    pending = getattr(proposer, _PENDING, None)
    if pending is None:
        pending = PendingContext()
        setattr(proposer, _PENDING, pending)
    return pending


def flush(proposer: Any) -> int:
    """Compute and store the kept context K/V in one pass; returns the number of tokens (0: none kept,
    or a proposer that keeps nothing)."""
    pending = getattr(proposer, _PENDING, None)
    taken = pending.take() if pending is not None else None
    if taken is None:
        return 0
    hidden, positions, slots = taken
    proposer.model.precompute_and_store_context_kv(proposer.model.combine_hidden_states(hidden), positions, slots)
    pending.counters["flushes"] += 1
    pending.counters["flushed_tokens"] += int(positions.numel())
    return int(positions.numel())


def store_context_only(proposer: Any, target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                       common_attn_metadata: Any) -> torch.Tensor:
    """The K = 0 first pass: context K/V into the cache, deferred for decode-sized steps (the module
    docstring); returns the empty [batch, 0] drafts."""
    num_tokens = int(common_attn_metadata.query_start_loc_cpu[-1])
    positions = target_positions[:num_tokens].to(torch.int64)
    slots = context_slots(positions, common_attn_metadata.query_start_loc,
                          common_attn_metadata.block_table_tensor, proposer.block_size)
    if num_tokens < DEFER_MAX_TOKENS:
        pending = pending_of(proposer)  # copies: vLLM reuses its position (and, on GPUs, hidden) buffers
        pending.add(target_hidden_states[:num_tokens].clone(), positions.clone(), slots)
        if pending.num_tokens >= FLUSH_TOKENS:
            flush(proposer)
    else:
        flush(proposer)  # kept tokens first: the cache is written in step order
        hidden = proposer.model.combine_hidden_states(target_hidden_states[:num_tokens])
        proposer.model.precompute_and_store_context_kv(hidden, positions, slots)
    return torch.empty(common_attn_metadata.batch_size(), 0, dtype=torch.int64, device=positions.device)


def stats(proposer: Any) -> dict | None:
    """The deferral's counters and the tokens kept now (None: this proposer never deferred)."""
    pending = getattr(proposer, _PENDING, None)
    return None if pending is None else {**pending.counters, "pending_tokens": pending.num_tokens}


def flush_runner(runner: Any) -> None:
    """Flush the model runner's drafter, if it keeps context (errors logged once; the kept tokens are
    dropped then: the drafter's context is incomplete, its drafts stay lossless)."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or getattr(drafter, _PENDING, None) is None:
        return
    try:
        flush(drafter)
    except Exception as exc:
        getattr(drafter, _PENDING).take()
        if not getattr(flush_runner, "_logged", False):
            flush_runner._logged = True  # type: ignore[attr-defined]
            logger.exception("online-opd: flushing the deferred DFlash context failed (logged once): %s", exc)


def install() -> None:
    """Patch ``DFlashProposer.propose`` (once): K = 0 takes the context-only path, deferred; and the
    model runner's ``_update_states``: a step that finishes or preempts requests flushes first."""
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = DFlashProposer.propose
    if getattr(orig, "_online_opd", False):
        return
    signature = inspect.signature(orig)

    @functools.wraps(orig)  # later wrappers (vllm_patches/capture_features.py) read vLLM's signature through it
    def propose(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        positions = call["target_positions"]
        if call["num_speculative_tokens"] != 0 or positions.dim() != 1:
            flush(self)  # drafting reads the context: complete it first
            return orig(self, *args, **kwargs)
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        return store_context_only(self, positions, call["target_hidden_states"], call["common_attn_metadata"])

    orig_update = GPUModelRunner._update_states

    def _update_states(self, scheduler_output, *args, **kwargs):
        if scheduler_output.finished_req_ids or getattr(scheduler_output, "preempted_req_ids", None):
            flush_runner(self)  # their cache blocks are free from this step on
        return orig_update(self, scheduler_output, *args, **kwargs)

    propose._online_opd = True
    DFlashProposer.propose = propose
    GPUModelRunner._update_states = _update_states
    logger.info("DFlash drafter: K = 0 steps store the context K/V only, deferred to one batched pass")
