"""Resumable trainer state: drafter weights, optimizer, schedule, step, RNG.

Saved with `torch.save` to a temporary file that is fsynced and renamed into
place, so an interrupted save never replaces a good checkpoint with a torn one.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


def save_state(run_dir: Path, *, step: int, drafter, optimizer, scheduler, extra: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / STATE_FILE
    tmp = run_dir / f".{STATE_FILE}.tmp"
    state = {
        "step": step,
        "drafter": drafter.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "extra": extra or {},
    }
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_state(run_dir: Path, *, drafter, optimizer, scheduler) -> dict | None:
    """Restore from `run_dir` if it holds a state; returns it (or None)."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torn or foreign file: refuse loudly, never half-load
        raise RuntimeError(f"{path}: trainer state unreadable ({exc}); remove it to start fresh") from exc
    drafter.load_state_dict(state["drafter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    logger.info("resumed from %s at step %d", path, state["step"])
    return state
