"""Choose the training objective from live acceptance (``trainer.objective: auto``).

Which objective trains a drafter best depends on how good the drafter already is. The paper's
Draft-OPD beats the naive target-rollout forward KL from strong drafters (Table 4: tau 4.4-6.6 at
K = 16, where most blocks accept their first tokens). From the weak drafters this product starts from
(tau 1.1-1.5 at K = 4, position-1 acceptance 0.26-0.39) target-rollout is ahead or tied in every
comparison measured here: 3 seeds from the default bootstrap under domain shift (HumanEval), +0.039
tau [0.020, 0.057] after 100 steps, 1.8x Draft-OPD's gain over the bootstrap; from the text bootstrap
on ShareGPT tied at 100 steps and ahead at 30 (README, Figures: the objectives rows). The mechanism:
when most blocks reject their first token, Draft-OPD's accepted group is small and half of its loss
is a reverse KL on positions that follow a rejected draft, while target-rollout puts a forward
(mass-covering) KL on exactly the positions that decide acceptance, the verified trajectory up to
and including the first rejection.

The thresholds' defaults (0.6 up, 0.5 down) lie between the two measured regimes; no drafter this
CPU can train reaches the strong one, so the crossing point itself is not measured.

The signal is the **position-1 acceptance rate** a1 of the newest ``window_blocks`` verified blocks:
the share whose first drafted token the verifier accepted (vLLM's per-position acceptance counter at
position 1, over the traffic the trainer reads). It does not depend on the block size K, and it is the
share of blocks that give Draft-OPD's accepted group anything at all.

Rule, with hysteresis so that noise near a threshold cannot make it flap:

- it starts on ``weak`` (target-rollout by default);
- on ``weak``, it switches to ``strong`` (Draft-OPD) once a1 >= ``up_at``;
- on ``strong``, it switches back once a1 <= ``down_at`` (< ``up_at``);
- no decision before the window holds ``min_blocks`` blocks, and none within
  ``min_steps_between_switches`` steps of the last switch (the first switch may come at any step).

The gate ends a failed trial (``trial_gates`` > 0). A switch to ``strong`` is a trial: the online
trainer reports every gate (``gate_outcome``), and when ``trial_gates`` gates in a row on ``strong``
promote nothing while their candidates score below the serving version on the held-out prompts (the
upper ``trial_confidence`` Student-t bound of the mean tau difference over those gates is <= 0), the
schedule switches back to ``weak`` (the trainer then restarts from the serving version) and raises
its switch-up threshold to the trial's a1 plus ``retry_margin``. A bound, not the mean: a plateau
also gives differences around 0 (target-rollout's candidates in one 30-min run: a mean of -0.001
over 8 gates, bound +0.003), and a plateau is not a failure.

Measured (README, domain shift 30 min, 3 seeds): from the default bootstrap on HumanEval traffic, a1
reached 0.60-0.62 after 450-780 steps (15-22 min); after the switch the Draft-OPD candidates scored
below the serving target-rollout version in 51 of 57 gates (mean -0.017 to -0.028 tau) and none was
promoted in the remaining 8-15 minutes. So a1 0.6 is not yet the strong regime for these drafters;
the gate, not a fixed threshold, tells. Replayed on those gate logs, the rule ends each trial at its
8th gate and never fires on target-rollout's stretches.

Pure Python (and scipy's t quantile): ``observe`` takes the accepted counts of verified blocks, oldest
first; ``choose(step)`` returns the objective for that step and records a switch in ``switches``;
``gate_outcome`` takes each gate's result; ``state_dict`` / ``load_state_dict`` carry it through the
online trainer's state file.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from scipy import stats


@dataclass(frozen=True)
class Switch:
    """One change of objective: at ``step``, from ``before`` to ``after``, with the a1 that decided it."""

    step: int
    before: str
    after: str
    first_position_acceptance: float
    num_blocks: int
    reason: str = "acceptance"  # or "gate": a trial of the strong objective ended by the gate


def upper_bound(values: list[float], confidence: float) -> float:
    """Upper one-sided Student-t bound of the mean of ``values`` (the value itself for one)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean
    return mean + float(stats.t.ppf(confidence, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


class ObjectiveSchedule:
    """The objective for each online step, from the acceptance of recent verified blocks (module doc)."""

    def __init__(self, *, weak: str, strong: str, up_at: float, down_at: float, window_blocks: int,
                 min_blocks: int, min_steps_between_switches: int, trial_gates: int = 0,
                 retry_margin: float = 0.1, trial_confidence: float = 0.9) -> None:
        if weak == strong:
            raise ValueError(f"weak and strong objectives must differ, both are {weak!r}")
        if not 0.0 <= down_at < up_at <= 1.0:
            raise ValueError(f"need 0 <= down_at < up_at <= 1, got down_at {down_at}, up_at {up_at}")
        if window_blocks < 1 or not 1 <= min_blocks <= window_blocks:
            raise ValueError(f"need 1 <= min_blocks <= window_blocks, got {min_blocks} and {window_blocks}")
        if min_steps_between_switches < 0:
            raise ValueError(f"min_steps_between_switches must be >= 0, got {min_steps_between_switches}")
        if trial_gates < 0 or not 0.0 <= retry_margin <= 1.0 or not 0.5 <= trial_confidence < 1.0:
            raise ValueError(f"need trial_gates >= 0, 0 <= retry_margin <= 1 and 0.5 <= trial_confidence < 1, "
                             f"got {trial_gates}, {retry_margin}, {trial_confidence}")
        self.weak, self.strong = weak, strong
        self.up_at, self.down_at = float(up_at), float(down_at)
        self.min_blocks = min_blocks
        self.min_steps_between_switches = min_steps_between_switches
        self.trial_gates, self.retry_margin = trial_gates, float(retry_margin)
        self.trial_confidence = float(trial_confidence)
        self._first_accepted: deque[bool] = deque(maxlen=window_blocks)  # per block: r >= 1
        self.current = weak
        self.switches: list[Switch] = []
        self.raised_up_at: float | None = None  # set by a failed trial (> 1: never again)
        self._trial: list[float] = []  # gate tau differences on strong since its last promotion

    @classmethod
    def from_config(cls, cfg: Any) -> "ObjectiveSchedule":
        """From a ``trainer.auto`` section (config_training.AutoObjectiveConfig)."""
        return cls(weak=cfg.weak, strong=cfg.strong, up_at=cfg.up_at, down_at=cfg.down_at,
                   window_blocks=cfg.window_blocks, min_blocks=cfg.min_blocks,
                   min_steps_between_switches=cfg.min_steps_between_switches,
                   trial_gates=cfg.trial_gates, retry_margin=cfg.retry_margin,
                   trial_confidence=cfg.trial_confidence)

    @property
    def up_at_now(self) -> float:
        """The switch-up threshold: ``up_at``, or above it after a failed trial."""
        return self.up_at if self.raised_up_at is None else max(self.up_at, self.raised_up_at)

    @property
    def objectives(self) -> tuple[str, str]:
        return self.weak, self.strong

    @property
    def num_blocks(self) -> int:
        return len(self._first_accepted)

    def observe(self, num_accepted: Iterable[int]) -> None:
        """Add verified blocks (their accepted-token counts r >= 0, oldest first) to the window."""
        for r in num_accepted:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"a block's accepted count must be an int >= 0, got {r!r}")
            self._first_accepted.append(r >= 1)

    def first_position_acceptance(self) -> float | None:
        """a1 over the window; None while it is empty."""
        if not self._first_accepted:
            return None
        return sum(self._first_accepted) / len(self._first_accepted)

    def choose(self, step: int) -> str:
        """The objective for optimizer step ``step`` (1-based, increasing); switches per the rule."""
        a1 = self.first_position_acceptance()
        if a1 is None or self.num_blocks < self.min_blocks:
            return self.current
        if self.switches and step - self.switches[-1].step < self.min_steps_between_switches:
            return self.current
        after = self.current
        if self.current == self.weak and a1 >= self.up_at_now:
            after = self.strong
        elif self.current == self.strong and a1 <= self.down_at:
            after = self.weak
        if after != self.current:
            self.switches.append(Switch(step, self.current, after, round(a1, 4), self.num_blocks))
            self.current = after
            self._trial.clear()
        return self.current

    def gate_outcome(self, step: int, promoted: bool, tau_diff: float) -> bool:
        """One gate's result for a candidate trained with ``current`` (``tau_diff``: candidate minus
        serving tau on the held-out prompts; NaN, no blocks, is not counted). On ``strong`` it may end
        the trial (module docstring): then the schedule is on ``weak`` again, the switch is recorded
        (reason "gate") and True is returned, so that the trainer restarts from the serving version."""
        if self.current != self.strong or self.trial_gates == 0:
            return False
        if promoted:
            self._trial.clear()
            return False
        if math.isfinite(tau_diff):
            self._trial.append(float(tau_diff))
        recent = self._trial[-self.trial_gates:]
        if len(recent) < self.trial_gates or upper_bound(recent, self.trial_confidence) > 0:
            return False
        a1 = self.first_position_acceptance() or 0.0
        tried_at = max([a1] + [s.first_position_acceptance for s in self.switches[-1:] if s.after == self.strong])
        self.raised_up_at = max(self.up_at_now, tried_at + self.retry_margin)
        self.switches.append(Switch(step, self.strong, self.weak, round(a1, 4), self.num_blocks, reason="gate"))
        self.current = self.weak
        self._trial.clear()
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: the current objective, the switches, the window and the trial's figures."""
        return {"current": self.current, "switches": [asdict(s) for s in self.switches],
                "first_accepted": [int(x) for x in self._first_accepted], "raised_up_at": self.raised_up_at,
                "trial": list(self._trial)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state_dict``'s output (a state naming other objectives is refused)."""
        current = state.get("current", self.weak)
        if current not in self.objectives:
            raise ValueError(f"saved objective {current!r} is neither {self.weak!r} nor {self.strong!r}")
        switches = [Switch(**s) for s in state.get("switches", [])]  # all checked before anything changes
        window = [bool(x) for x in state.get("first_accepted", [])]
        raised = state.get("raised_up_at")  # missing in states written before the trial rule
        raised = None if raised is None else float(raised)
        trial = [float(x) for x in state.get("trial", [])]
        self.current, self.switches, self.raised_up_at, self._trial = current, switches, raised, trial
        self._first_accepted.clear()
        self._first_accepted.extend(window)
