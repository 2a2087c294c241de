"""AdamW with linear warmup and cosine decay (the paper's defaults)."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over trainable params; no decay on norms (1-d tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def cosine_with_warmup(
    optimizer: torch.optim.Optimizer, *, num_steps: int, warmup_ratio: float, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """lr(s) = lr * s/W during warmup, then cosine from lr down to min_lr_ratio * lr."""
    warmup = max(1, int(round(num_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, num_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
