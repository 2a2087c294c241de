"""A bootstrap's wall-time budget (``bootstrap.time_budget_s``).

The bootstrap's work scales with the machine: the same config took 26.5 min on
a CPU that computes in bfloat16 and 68 min (81 with the served eval) on one
without it. With a budget the phases are sized to the machine they run on:

- rollouts and their features run in full (the smallest phase, ~6 min at worst
  here);
- the teacher-forced text feature pass stops, between conversations, at
  ``text_feature_share`` of the budget (counted from the bootstrap's start);
  the conversations done are kept;
- the SFT steps are planned from a measured step time: ``planned_steps`` fits
  them into what is left, less a reserve for saving, and the loop stops at the
  budget's end in any case (``train``'s ``time_budget_s``).

With ``bootstrap.overlap_features`` the text feature pass runs beside the SFT
instead (serve/feature_stream.py), from the end of the rollouts' features to the
SFT's end (the budget less the reserve); the step time is then measured while it
runs, on the trainer's share of the threads.

The plan is stored in the run folder (``budget.json``) and a resumed run keeps it:
the learning-rate schedule depends on the number of steps.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

PLAN_FILE = "budget.json"
RESERVE_SHARE = 0.05  # of the budget, kept for saving the drafter and for step-time noise


@dataclass
class Budget:
    """``total_s`` wall seconds from ``start`` (a ``clock`` reading)."""

    total_s: float
    start: float
    clock: Callable[[], float] = time.monotonic

    def deadline(self, share: float = 1.0) -> float:
        return self.start + share * self.total_s

    def left_s(self) -> float:
        return self.deadline() - self.clock()

    def used_s(self) -> float:
        return self.clock() - self.start


@dataclass
class StepPlan:
    """What a budgeted bootstrap decided before its SFT loop (stored as ``budget.json``)."""

    time_budget_s: float
    used_before_training_s: float
    step_s: float  # measured SFT step time
    num_steps_configured: int
    num_steps: int  # planned

    def save(self, run_dir: Path) -> None:
        (run_dir / PLAN_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> StepPlan | None:
        path = run_dir / PLAN_FILE
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not a bootstrap step plan ({exc}); delete it to plan again") from exc


def planned_steps(configured: int, step_s: float, seconds_left: float, reserve_s: float) -> int:
    """The SFT steps that fit in ``seconds_left - reserve_s`` at ``step_s`` each, at most ``configured``;
    0 when not one fits."""
    if step_s <= 0 or not math.isfinite(step_s):
        raise ValueError(f"step time must be a positive number of seconds, got {step_s}")
    return min(configured, math.floor(max(seconds_left - reserve_s, 0.0) / step_s))
