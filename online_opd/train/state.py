"""Resumable trainer state: drafter weights, optimizer, schedule, step, RNG.

RNG: the global torch and Python generators, and the trainer's own sampling
generator (the one that picks sequences and anchors) when one is passed, so a
resumed run draws what an uninterrupted one would have drawn.

Saved with `torch.save` through `online_opd.files.atomic_write_bytes`, so an
interrupted save never replaces a good checkpoint with a torn one.
Read back with `torch.load(weights_only=True)`: tensors, numbers, strings and
containers only, never arbitrary pickled objects.
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import torch

from online_opd.files import atomic_write_bytes

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


def save_state(run_dir: Path, *, step: int, drafter, optimizer, scheduler, extra: dict | None = None,
               generator: torch.Generator | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "drafter": drafter.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "generator": generator.get_state() if generator is not None else None,
        "extra": extra or {},
    }
    data = io.BytesIO()
    torch.save(state, data)
    return atomic_write_bytes(run_dir / STATE_FILE, data.getvalue())


def load_state(run_dir: Path, *, drafter, optimizer, scheduler,
               generator: torch.Generator | None = None) -> dict | None:
    """Restore from `run_dir` if it holds a state (``generator`` too, when it was saved); returns it (or None)."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torn or foreign file: refuse loudly, never half-load
        raise RuntimeError(f"{path}: trainer state unreadable ({exc}); remove it to start fresh") from exc
    drafter.load_state_dict(state["drafter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])
    logger.info("resumed from %s at step %d", path, state["step"])
    return state
