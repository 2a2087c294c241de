"""Training sequences (target rollouts or existing text): token ids plus the
target's aux hidden states (the drafter's context features) and, for text,
the target's greedy labels, computed once in one forward and stored.

Stored as one safetensors file: `tokens` (all sequences concatenated),
`offsets` [N+1], `prompt_lens` [N], `aux_hidden` [total_tokens, F] in
bfloat16 and, when every sequence has them, `labels` [total_tokens], written
atomically (online_opd/files.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from online_opd.files import atomic_write_file


@dataclass
class TrainSequence:
    tokens: torch.Tensor  # [T] int64, prompt + output
    prompt_len: int
    aux_hidden: torch.Tensor | None = None  # [T, F] target features at layer ids
    # [T] int64: labels[t] = argmax of the target's logits after tokens[:t] for t > prompt_len,
    # tokens[t] for t <= prompt_len (given, never predicted); None = tokens are the target's own
    labels: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def compute_aux_hidden(
    target, sequences: list[TrainSequence], layer_ids: tuple[int, ...], *, with_labels: bool = False,
    progress: bool = True, desc: str = "target features", deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Fill `aux_hidden` of every sequence with one target forward each; `with_labels` also fills
    `labels` from that forward's logits at the response positions (argmax ids only: the
    [T - prompt_len - 1, vocab] logits of one sequence are the largest transient). With a `deadline`
    (a `clock` reading) it stops before the first sequence it reaches at or after it. Returns the
    number of sequences filled: the first ones, in order."""
    total = sum(s.num_tokens for s in sequences)
    done = 0
    with tqdm(total=total, desc=desc, unit="tok", disable=not progress) as bar:
        for seq in sequences:
            if deadline is not None and clock() >= deadline:
                break
            # logits at rows prompt_len .. T-2 predict tokens prompt_len+1 .. T-1
            rows = torch.arange(seq.prompt_len, seq.num_tokens - 1) if with_labels else seq.tokens[:0]
            out = target.forward(seq.tokens, layer_ids=layer_ids, logits_at=rows)
            seq.aux_hidden = out.aux_hidden.to(torch.bfloat16)
            if with_labels:
                seq.labels = seq.tokens.clone()
                seq.labels[rows + 1] = out.logits.argmax(dim=-1)
            bar.update(seq.num_tokens)
            done += 1
    return done


def save_sequences(path: Path, sequences: list[TrainSequence], layer_ids: tuple[int, ...]) -> None:
    lengths = torch.tensor([s.num_tokens for s in sequences], dtype=torch.int64)
    tensors = {
        "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int64),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in sequences], dtype=torch.int64),
        "layer_ids": torch.tensor(layer_ids, dtype=torch.int64),
    }
    if all(s.aux_hidden is not None for s in sequences):
        tensors["aux_hidden"] = aux = torch.cat([s.aux_hidden for s in sequences]).contiguous()
        for seq, lo, hi in zip(sequences, tensors["offsets"][:-1].tolist(), tensors["offsets"][1:].tolist()):
            seq.aux_hidden = aux[lo:hi]  # views of the saved tensor: the per-sequence copies are freed
    num_labelled = sum(s.labels is not None for s in sequences)
    if num_labelled not in (0, len(sequences)):
        raise ValueError(f"{path}: {num_labelled} of {len(sequences)} sequences have labels; "
                         "save labelled (text) and unlabelled (rollout) sequences to separate files")
    if num_labelled:
        tensors["labels"] = torch.cat([s.labels for s in sequences]).to(torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_file(path, lambda tmp: save_file(tensors, tmp))  # streamed: no whole-file bytes in memory


def feature_bytes(num_tokens: int, num_features: int) -> int:
    """Bytes of the stored features of `num_tokens` tokens (bfloat16)."""
    return num_tokens * num_features * 2


def check_feature_memory(sequences: list[TrainSequence], num_features: int, what: str,
                         available: int | None = None) -> None:
    """MemoryError, before any target forward, when the features of `sequences` would not fit:
    they stay in memory for training and saving them copies them once more (2x), within 90% of
    the memory available now (`available` bytes; default: psutil's figure)."""
    import psutil

    need = 2 * feature_bytes(sum(s.num_tokens for s in sequences), num_features)
    available = psutil.virtual_memory().available if available is None else available
    if need > 0.9 * available:
        raise MemoryError(
            f"{what}: {len(sequences)} sequences, {sum(s.num_tokens for s in sequences):,} tokens x "
            f"{num_features} features need about {need / 2**30:.1f} GiB while training and saving, but "
            f"{available / 2**30:.1f} GiB are available; lower the number of sequences")


def load_sequences(path: Path, layer_ids: tuple[int, ...] | None = None) -> list[TrainSequence]:
    """Read sequences; refuses features computed at other layer ids."""
    tensors = load_file(path)
    stored = tuple(tensors["layer_ids"].tolist())
    if layer_ids is not None and "aux_hidden" in tensors and stored != tuple(layer_ids):
        raise ValueError(f"{path}: features are for layers {stored}, drafter wants {tuple(layer_ids)}")
    offsets, aux, labels = tensors["offsets"].tolist(), tensors.get("aux_hidden"), tensors.get("labels")
    return [
        TrainSequence(
            tokens=tensors["tokens"][lo:hi],
            prompt_len=int(pl),
            aux_hidden=None if aux is None else aux[lo:hi],
            labels=None if labels is None else labels[lo:hi],
        )
        for lo, hi, pl in zip(offsets[:-1], offsets[1:], tensors["prompt_lens"].tolist())
    ]
