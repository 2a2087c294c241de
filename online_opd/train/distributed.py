"""Data-parallel training with plain ``torch.distributed``: one drafter replica per process.

Every rank draws a step's whole global batch with the same seeded generator (the same records and
the same blocks), then replays only its own contiguous slice of it (``shard_bounds``). The loss of
the global batch is a mean over its N terms (records, or sequences for SFT); rank r backpropagates
its share of it (``share_of_mean``):

    L   = (1 / N) sum_{i < N} l_i                  (the single-process loss)
    L_r = (1 / N) sum_{i in shard r} l_i            so that  L = sum_r L_r  and  dL/dw = sum_r dL_r/dw

``all_reduce_gradients`` sums the gradients over the ranks, so clipping and AdamW see the gradient
of the whole global batch and every replica takes the same step: the update is the single-process
update, up to float rounding (the sum runs in another order). Without an initialised process group
(one process) every function here is the identity and ``share_of_mean`` is ``torch.stack(l).mean()``,
the single-process code path itself.

Rank 0 alone writes (state, metrics, the drafter); ``is_main_process`` says which rank that is. The
process group itself is set up by whoever starts the ranks (serve/trainer_dp.py through Ray Train,
tests through torch.multiprocessing); this module never imports ray.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether this process is one rank of several (an initialised process group of size > 1)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0, the one that writes; True in a single process."""
    return rank() == 0


def shard_bounds(num_items: int) -> tuple[int, int]:
    """[lo, hi) of this rank's contiguous slice of ``num_items``: rank r gets items
    floor(r N / W) .. floor((r + 1) N / W) - 1, so the sizes differ by at most one and the slices,
    in rank order, are the global batch in its own order."""
    r, w = rank(), world_size()
    return r * num_items // w, (r + 1) * num_items // w


def share_of_mean(terms: list[torch.Tensor], num_global: int, device: torch.device | None = None) -> torch.Tensor:
    """This rank's share of the mean of the global batch's ``num_global`` terms, given its own
    ``terms`` (each a []-shaped tensor): sum(terms) / num_global; the shares of all ranks sum to the
    mean. One process: ``torch.stack(terms).mean()``. A rank with no terms gets a constant 0 (on
    ``device``), which has no gradient: its replica contributes zeros to the all-reduce."""
    if not is_distributed():
        if len(terms) != num_global:
            raise ValueError(f"one process holds the whole batch: {len(terms)} terms, expected {num_global}")
        return torch.stack(terms).mean()
    if not terms:
        return torch.zeros((), device=device)
    return torch.stack(terms).sum() / num_global


def gather(items: list[Any]) -> list[Any]:
    """Every rank's ``items`` concatenated in rank order (on every rank): for the slices of
    ``shard_bounds``, the global batch's items in their own order. One process: ``items``."""
    if not is_distributed():
        return items
    parts: list[list[Any] | None] = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum the gradients of ``model``'s trainable parameters over the ranks, in one flat buffer (a
    parameter this rank's shard did not reach counts as a zero gradient)."""
    if not is_distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param in params:  # views into the reduced buffer: no second copy of the gradients
        param.grad = flat[offset: offset + param.numel()].view_as(param)
        offset += param.numel()


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks (a detached copy); itself in one process."""
    if not is_distributed():
        return value
    total = value.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any: a stop or a deadline seen by one rank ends the
    loop on all of them at the same step (a rank that left alone would hang the others)."""
    if not is_distributed():
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def sync_replicas(model: torch.nn.Module, step: int, source: str) -> None:
    """Start every replica alike: refuse ranks that resumed at different steps (each reads the state
    from ``source``, which must be storage they all see), then broadcast rank 0's parameters, as
    DistributedDataParallel does at construction. Buffers are not sent: a drafter's are the target's
    embeddings and LM head (frozen, loaded alike everywhere, and the largest tensors it holds)."""
    if not is_distributed():
        return
    steps = gather([step])
    if len(set(steps)) > 1:
        raise RuntimeError(f"ranks resumed at different steps {steps} from {source}: every worker must read "
                           "the same trainer state; put the run directory on storage all workers share")
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
