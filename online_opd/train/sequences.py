"""Target rollouts as training data: token ids plus the target's aux hidden
states (the drafter's context features), computed once and stored.

Stored as one safetensors file: `tokens` (all sequences concatenated),
`offsets` [N+1], `prompt_lens` [N] and `aux_hidden` [total_tokens, F] in
bfloat16, written atomically (online_opd/files.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from online_opd.files import atomic_write_bytes


@dataclass
class TrainSequence:
    tokens: torch.Tensor  # [T] int64, prompt + output
    prompt_len: int
    aux_hidden: torch.Tensor | None = None  # [T, F] target features at layer ids

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def compute_aux_hidden(
    target, sequences: list[TrainSequence], layer_ids: tuple[int, ...], *, progress: bool = True
) -> None:
    """Fill `aux_hidden` of every sequence with one target forward each."""
    total = sum(s.num_tokens for s in sequences)
    with tqdm(total=total, desc="target features", unit="tok", disable=not progress) as bar:
        for seq in sequences:
            out = target.forward(seq.tokens, layer_ids=layer_ids, logits_at=seq.tokens[:0])
            seq.aux_hidden = out.aux_hidden.to(torch.bfloat16)
            bar.update(seq.num_tokens)


def save_sequences(path: Path, sequences: list[TrainSequence], layer_ids: tuple[int, ...]) -> None:
    lengths = torch.tensor([s.num_tokens for s in sequences], dtype=torch.int64)
    tensors = {
        "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int64),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in sequences], dtype=torch.int64),
        "layer_ids": torch.tensor(layer_ids, dtype=torch.int64),
    }
    if all(s.aux_hidden is not None for s in sequences):
        tensors["aux_hidden"] = torch.cat([s.aux_hidden for s in sequences]).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save(tensors))


def load_sequences(path: Path, layer_ids: tuple[int, ...] | None = None) -> list[TrainSequence]:
    """Read sequences; refuses features computed at other layer ids."""
    tensors = load_file(path)
    stored = tuple(tensors["layer_ids"].tolist())
    if layer_ids is not None and "aux_hidden" in tensors and stored != tuple(layer_ids):
        raise ValueError(f"{path}: features are for layers {stored}, drafter wants {tuple(layer_ids)}")
    offsets, aux = tensors["offsets"].tolist(), tensors.get("aux_hidden")
    return [
        TrainSequence(
            tokens=tensors["tokens"][lo:hi],
            prompt_len=int(pl),
            aux_hidden=None if aux is None else aux[lo:hi],
        )
        for lo, hi, pl in zip(offsets[:-1], offsets[1:], tensors["prompt_lens"].tolist())
    ]
