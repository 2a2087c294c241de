"""Per-position acceptance a_k = P(at least k drafts of a block accepted).

With a fixed K, vLLM's counters give a_k = accepted_per_pos[k-1] / num_drafts.
When K changes from step to step, a block of L < k tokens cannot reach position
k, so dividing by every draft would bias a_k down. ``AcceptanceCounts`` counts,
per position k, the blocks that reached it (L >= k) and those whose first k
drafts were all accepted (r >= k):

    a_k = num_accepted[k] / num_reaching[k]

``geometric_profile`` turns a single tau measured at block size K (the gate's
simulated figure, a live check's) into a profile a_k = alpha^k with
1 + sum_{k<=K} alpha^k = tau: i.i.d. per-token acceptance, the usual model.
``estimate_acceptance`` picks the best of those for the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scipy.optimize import brentq


@dataclass
class AcceptanceCounts:
    """Blocks reaching each position and blocks accepted through it (index k-1 for position k)."""

    num_reaching: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One verified block of ``num_drafted`` tokens, ``num_accepted`` of them accepted."""
        if num_drafted > len(self.num_reaching):
            grow = num_drafted - len(self.num_reaching)
            self.num_reaching += [0] * grow
            self.num_accepted += [0] * grow
        for j in range(num_drafted):
            self.num_reaching[j] += 1
            self.num_accepted[j] += int(num_accepted > j)

    def __sub__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        def minus(a: list[int], b: list[int]) -> list[int]:
            return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]

        return AcceptanceCounts(minus(self.num_reaching, other.num_reaching),
                                minus(self.num_accepted, other.num_accepted))

    @property
    def num_drafts(self) -> int:
        """Blocks observed (every block reaches position 1)."""
        return self.num_reaching[0] if self.num_reaching else 0

    def profile(self, min_blocks: int) -> list[float | None]:
        """a_k per position; None where fewer than ``min_blocks`` blocks reached position k."""
        return [acc / n if n >= min_blocks else None for acc, n in zip(self.num_accepted, self.num_reaching)]

    def to_dict(self) -> dict[str, list[int]]:
        return {"num_reaching": list(self.num_reaching), "num_accepted": list(self.num_accepted)}

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceCounts:
        return cls(list(data.get("num_reaching", [])), list(data.get("num_accepted", [])))


def geometric_profile(tau: float, block_size: int, max_k: int) -> list[float]:
    """a_k = alpha^k for k = 1..max_k, with 1 + sum_{k<=block_size} alpha^k = tau (alpha in [0, 1])."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: a tau is measured on blocks of at least one token")
    target = min(max(tau - 1.0, 0.0), float(block_size))  # 0 <= E[r] <= K

    def excess(alpha: float) -> float:
        return sum(alpha ** k for k in range(1, block_size + 1)) - target

    if target <= 0.0:
        alpha = 0.0
    elif target >= block_size:
        alpha = 1.0
    else:
        alpha = brentq(excess, 0.0, 1.0, xtol=1e-12)
    return [alpha ** k for k in range(1, max_k + 1)]


def estimate_acceptance(live: AcceptanceCounts, manifest: dict, *, max_k: int,
                        min_drafts: int) -> tuple[list[float], str]:
    """a_1..a_max_k for a drafter and where they came from.

    Live blocks first: the positions at least ``min_drafts`` blocks reached, and
    beyond the last such position a geometric extension of it. With no position
    known live, the drafter's manifest: the live check's served tau or the gate's
    simulated tau, as a geometric profile; else the per-position acceptance that
    `online-opd eval --record` measured on vLLM (``metrics.eval``, held-out prompts,
    extended like the live one when it drafted fewer than ``max_k`` tokens). With
    none, 0 everywhere: an unproven drafter is assumed not to pay until exploration
    or the gate shows it does.
    """
    profile = live.profile(min_drafts)[:max_k]
    known = 0
    while known < len(profile) and profile[known] is not None:
        known += 1
    if known:
        return _extend(profile[:known], max_k), f"live: {live.num_drafts} blocks since this version started serving"
    metrics = manifest.get("metrics") or {}
    for key, name in (("live_check", "tau"), ("gate", "tau_candidate")):
        tau = (metrics.get(key) or {}).get(name)
        if isinstance(tau, (int, float)) and tau >= 1.0:
            return geometric_profile(float(tau), max_k, max_k), f"manifest {key} tau {tau:.3f} (geometric)"
    served = eval_profile(metrics.get("eval"), min_drafts)
    if served:
        return (_extend(served, max_k),
                f"manifest eval: {metrics['eval']['num_drafts']} blocks served on {metrics['eval'].get('prompts')}")
    return [0.0] * max_k, f"none yet ({live.num_drafts} live blocks < {min_drafts}): assumed not to pay"


def eval_profile(figures: dict | None, min_drafts: int) -> list[float]:
    """The per-position acceptance an `online-opd eval --record` stored, if it rests on at least
    ``min_drafts`` blocks and is a profile (values in [0, 1]); else []."""
    if not isinstance(figures, dict):
        return []
    rates, drafts = figures.get("acceptance_rate_per_position"), figures.get("num_drafts")
    if not isinstance(drafts, int) or drafts < min_drafts or not isinstance(rates, list) or not rates:
        return []
    if not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in rates):
        return []
    return [float(a) for a in rates]


def _extend(known: list[float], max_k: int) -> list[float]:
    """``known`` (a_1..a_n) cut or extended to max_k positions: a_{n+j} = a_n alpha^j, alpha = a_n^(1/n)."""
    n = len(known)
    alpha = known[-1] ** (1.0 / n)
    return [float(a) for a in [*known[:max_k], *(known[-1] * alpha ** (j + 1) for j in range(max_k - n))]]
