"""AdamW, and the offline schedule: linear warm-up then cosine decay (the paper's defaults).

The schedule is transformers' ``get_cosine_with_min_lr_schedule_with_warmup``: a ``LambdaLR``
whose state (``last_epoch``) train/state.py saves and restores with the optimizer.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import get_cosine_with_min_lr_schedule_with_warmup


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
    """The lr of step s (0-based) with W = round(warmup_ratio * num_steps) warm-up steps (at least 1
    when warmup_ratio > 0) and m = min_lr_ratio:

        lr * s / W                                                      for s < W
        lr * (m + (1 - m) * (1 + cos(pi * (s - W) / (num_steps - W))) / 2)   for s >= W
    """
    warmup = max(1, int(round(num_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup, num_training_steps=num_steps, min_lr_rate=min_lr_ratio)
