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
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

logger = logging.getLogger("online_opd.speculation")


def context_slots(positions: torch.Tensor, query_start_loc: torch.Tensor, block_table: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """[num_tokens] cache slots of the scheduled tokens (the DFlash input kernel's context slots).

    positions [num_tokens], query_start_loc [num_reqs + 1], block_table [num_reqs, max_blocks].
    """
    counts = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    request = torch.repeat_interleave(torch.arange(counts.numel(), device=positions.device), counts)
    block = torch.clamp(positions // block_size, max=block_table.shape[1] - 1)
    return block_table[request, block].to(torch.int64) * block_size + positions % block_size


def store_context_only(proposer: Any, target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                       common_attn_metadata: Any) -> torch.Tensor:
    """The K = 0 first pass: context K/V into the cache; returns the empty [batch, 0] drafts."""
    num_tokens = int(common_attn_metadata.query_start_loc_cpu[-1])
    positions = target_positions[:num_tokens].to(torch.int64)
    hidden = proposer.model.combine_hidden_states(target_hidden_states[:num_tokens])
    slots = context_slots(positions, common_attn_metadata.query_start_loc,
                          common_attn_metadata.block_table_tensor, proposer.block_size)
    proposer.model.precompute_and_store_context_kv(hidden, positions, slots)
    return torch.empty(common_attn_metadata.batch_size(), 0, dtype=torch.int64, device=positions.device)


def install() -> None:
    """Patch ``DFlashProposer.propose`` (once): K = 0 takes the context-only path."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    orig = DFlashProposer.propose
    if getattr(orig, "_online_opd", False):
        return
    signature = inspect.signature(orig)

    def propose(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        positions = call["target_positions"]
        if call["num_speculative_tokens"] != 0 or positions.dim() != 1:
            return orig(self, *args, **kwargs)
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        return store_context_only(self, positions, call["target_hidden_states"], call["common_attn_metadata"])

    propose._online_opd = True
    DFlashProposer.propose = propose
    logger.info("DFlash drafter: K = 0 steps store the context K/V only")
