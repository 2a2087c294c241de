"""The draft vocabulary of a reduced-vocabulary drafter (`drafter.draft_vocab_size`).

The drafter scores only the target tokens it is most likely to need: the most
frequent ones among the tokens the target itself produced in the training data
(rollout responses, and the target's greedy labels on text). A target token
outside the draft vocabulary can never be drafted, so the share of target
tokens it covers (``coverage``) bounds the acceptance the drafter can reach.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_target_tokens(sequences: Iterable, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often the target produced each token in `sequences`
    (``TrainSequence``: response tokens of rollouts; greedy labels of labelled text)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        if seq.labels is not None:  # labels[prompt_len + 1:] are the target's argmax; [prompt_len] is text
            ids = seq.labels[seq.prompt_len + 1:]
        else:
            ids = seq.tokens[seq.prompt_len:]
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += torch.bincount(ids.to(torch.int64), minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, size: int, required: Iterable[int] = ()) -> torch.Tensor:
    """The `size` target ids to draft over, ascending: every id in `required` (e.g. the end-of-turn
    token), then the most frequent by `counts` (ties to the lower id)."""
    if not 1 <= size <= len(counts):
        raise ValueError(f"draft vocabulary size {size} outside 1..{len(counts)}")
    required = sorted({int(i) for i in required})
    if len(required) > size or any(not 0 <= i < len(counts) for i in required):
        raise ValueError(f"required ids {required} do not fit a draft vocabulary of {size} "
                         f"out of {len(counts)} tokens")
    order = torch.argsort(-counts, stable=True)
    keep = torch.zeros(len(counts), dtype=torch.bool)
    keep[required] = True
    rest = order[~keep[order]][: size - len(required)]
    keep[rest] = True
    return torch.nonzero(keep)[:, 0]


def coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """Share of the counted target tokens that lie in the draft vocabulary `token_ids`."""
    total = int(counts.sum())
    return float(counts[token_ids].sum()) / total if total else 0.0
