"""An exponential moving average of a drafter's trainable weights: what the online trainer publishes.

The online trainer steps AdamW at a constant rate (online.py: an endless run has no horizon to decay over), so
its weights keep moving about the optimum of the recent traffic; their moving average sits nearer to it and
generalises better (Polyak averaging; SWA, Izmailov et al. 2018). The gate scores the average against the
serving drafter, and a promoted version is the average; training goes on from the trained weights.

After n updates since the last ``reset`` the average keeps ``min(decay, (1 + n) / (10 + n))`` of itself (the
warm-up of TensorFlow's ``ExponentialMovingAverage(num_updates=...)`` and of diffusers' ``EMAModel``): it follows
the weights closely while they move fast, then widens towards a mean age of decay / (1 - decay) steps.

Only parameters with ``requires_grad`` are averaged, in place of a second module: torch's
``swa_utils.AveragedModel`` would deep-copy the drafter with the target's embeddings and LM head that it holds
as (shared, frozen) buffers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class WeightAverage:
    """The moving average of ``model``'s trainable parameters; ``decay`` 0 keeps it equal to them."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.reset(model)

    @staticmethod
    def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
        return {name: p for name, p in model.named_parameters() if p.requires_grad}

    def reset(self, model: nn.Module) -> None:
        """Start again from ``model``'s weights (a restart from a registry version)."""
        self.average = {name: p.detach().clone() for name, p in self._trainable(model).items()}
        self.num_updates = 0

    def next_decay(self) -> float:
        """The share of itself the average keeps at the next ``update``."""
        n = self.num_updates
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s weights (after each optimizer step)."""
        weight = 1.0 - self.next_decay()
        params = self._trainable(model)
        if params.keys() != self.average.keys():
            raise ValueError("the model's trainable parameters are not those the average was started from")
        for name, p in params.items():
            self.average[name].lerp_(p.detach(), weight)
        self.num_updates += 1

    @contextmanager
    def applied_to(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within the block ``model`` holds the average; its own weights come back afterwards, bit for bit,
        whatever the block raised."""
        params = self._trainable(model)
        kept = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.average[name])
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(kept[name])

    def state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates, "average": dict(self.average)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved average; ValueError (nothing changed) when its parameters are not this one's."""
        average = state["average"]
        if average.keys() != self.average.keys() or any(
                average[k].shape != v.shape for k, v in self.average.items()):
            raise ValueError("the saved average holds other parameters than the drafter's")
        self.average = {k: v.to(self.average[k].device, self.average[k].dtype).clone() for k, v in average.items()}
        self.num_updates = int(state["num_updates"])
