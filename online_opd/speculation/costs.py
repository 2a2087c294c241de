"""Engine step costs t(b, K): seconds per step for b running requests and K speculative tokens.

``StepCosts`` keeps one bucket per (b, K) measured on the running engine (K = 0:
a step without drafts). Only steady decode steps are observed (the engine hook
decides which: vllm_patches/speculation.py). The machine's speed drifts (a
trainer starting on the same cores, other tenants, longer contexts), and the
buckets are fed at different times: the serving K's every step, the others only
by exploration bursts (1% of steps). Comparing a bucket's recent mean with one
measured minutes earlier compares two machine states, not two K. So the table
separates the two:

    t(b, K, now) = speed(now) x m(b, K)

``speed`` is one factor for every bucket, an exponentially weighted mean (weight
``alpha``) of t_step / m(b, K) over the steps of buckets with at least
``reference_steps`` steps (the serving K's, mostly); m(b, K) is the bucket's
cost in the units of speed 1, the mean of t_step / speed over its first
``1/relative_alpha`` steps, then an exponentially weighted mean (weight
``relative_alpha``) that follows slow changes of relative cost. A step is
winsorised at [1/1.5, 1.5] x its bucket's prediction first, once the bucket has
4 steps (a 0.5 s pause moved the speed factor 45% in one step, and a bucket
that first ran just then took its level at the wrong speed). The rows
(``to_rows``) give speed x m: every bucket at today's speed, their ratios
drift-free. Replayed from the step profiles of five benchmark runs
(benchmarks/step_cost_drift.py, benchmarks/results/step_cost_drift.json), the
ratio t(b, K) / t(b, 0) the policy compares wandered with a standard deviation
of 0.03-0.14 under the former per-bucket EMA (weight 0.05) and 0.01-0.02 with
the speed factor; against the ratio of the two buckets' medians within 15 s
windows, its root-mean-square error was 4.6% on average over seven (b, K) pairs
(1-9%) against 11% (6-24%), lower in six of the seven. In one c = 4 run the EMA
put t(4, 2) at 1.09 t(4, 0) while the two measured 1.42 apart in the same 15 s.
What the split cannot tell apart is a change of speed seen through one bucket
alone: the serving bucket takes a share of it (a 30% slowdown seen only through
K = 1 steps left t(1, 1) / t(1, 0) at 1.26 instead of 1.20, the former EMA at
1.56; tests/test_speculation_policy.py), until steps of the other buckets come.

``CostModel`` predicts t(b, K) everywhere from those buckets. A bucket with at
least ``min_steps`` steps is used as measured, shrunk toward the fit below by
``prior_steps`` pseudo-steps: (n t_measured + n0 t_fit) / (n + n0). A bucket of a
rare batch size is noisy, and the policy compares it with the other K at the
same b: t(7, 0) measured 0.043 s from 12 steps (t(8, 0) 0.030 s from 523), in
the bootstrapped-drafter benchmark, put the fitted t(7, 1) and t(7, 2) at 1.02
and 1.05 t(7, 0) and served K = 2 at b = 7 alone. A bucket of thousands of steps stays as measured.
Elsewhere the model

    t(b, K, n) = c0 + c1 b + c2 K + c3 b K + c4 n

fitted by least squares over the buckets (weight: the bucket's step count,
capped), every coefficient non-negative (where the plain fit gives one below 0,
the non-negative least-squares fit: the first buckets of a fresh c = 8 server,
t(1, 0) 115 ms at warm-up against t(7, 0) 73 ms, gave c1 < 0, predicted
t(31, 0) = 0 and scheduled K = 1 at b = 31-32 alone): a fixed part per step,
a part per request (the target's token and the drafter's context for it), a
part per speculative token that does not depend on b, a part per drafted token
(the drafter's block query: b K tokens) and a part per verified token (the
target's forward over the n drafts the step verified).
Without draft trimming n = b K and the last two cannot be told apart: the fit
then drops c4 and predicts whole blocks (a trimmed step costs as much as a whole
one: trimming is never credited with savings nobody measured). With trimmed steps
measured (trim.py; a bucket keeps the mean n of its steps) c4 is identified, and
kept only when c3 and c4 come out non-negative. On the 2-core CPU the drafting
part is large: the bootstrapped drafter's trimmed K = 4 steps at b = 32, with few
tokens verified, cost 1.7 plain steps. A measured bucket predicts other n through
the fit's slope: t(b, K, n) = fit(b, K, n) + w (measured - fit(b, K, n_bucket)),
w = steps / (steps + prior_steps). When the buckets cannot identify the
coefficients (e.g. no step with K > 0 measured yet at two batch sizes) the model
drops terms in the order c4, c2, then c3; without a K term it only predicts
K = 0 and returns None for K > 0: the cost of speculating is then unknown.

A step with K drafts does strictly more work than one without (the draft
forward and K more verified tokens per request), so no prediction of t(b, K)
goes below t(b, 0) (1 + ``MIN_DRAFT_COST`` K). Without that floor, two noisy
K = 4 steps (or a fit with c2 < 0) made speculating look cheaper than plain
decoding, and a drafter with acceptance 0 was served at K = 4 (measured: t(1, 4)
0.055 s from 2 steps vs t(1, 0) 0.059 s from 500).

Nor does a prediction for a bucket not measured itself go below the relative cost
measured at a smaller or equal batch size and a smaller or equal K: t(b, K) >=
t(b, 0) t(b', K') / t(b', 0) for every measured whole-block (b', K') with
b' <= b, 0 < K' <= K (``ratio_floor``). Drafting more tokens, or verifying them
for more requests, is never relatively cheaper: a speculative step at K = 4 cost
1.5 plain steps at b = 1 on the 2-core CPU, 2.3 at b = 8, 3.3 at b = 16. The fit
alone extrapolates past the measured batch sizes badly: with K = 1 measured at
b = 4 at 1.34 plain steps (a fresh server at c = 4, float32), it put t(6, 3) at
the 1.06 floor and the policy scheduled K = 3 for b >= 6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

#: basis terms of t(b, K), in the order the fit drops them from the end of each candidate list
_BASES = (("1", "b", "k", "bk", "n"), ("1", "b", "k", "bk"), ("1", "b", "bk"), ("1", "b"), ("1",))
#: a bucket verified whole blocks when its mean draft tokens reach this share of b K (fits without n)
_WHOLE = 0.9
_MIN_SECONDS = 1e-6
#: least relative cost of one speculative token: t(b, K) >= t(b, 0) (1 + MIN_DRAFT_COST K)
MIN_DRAFT_COST = 0.02


@dataclass
class CostBucket:
    seconds: float  # mean seconds per step at speed 1 (running mean, then EWMA: StepCosts)
    num_steps: int
    total_seconds: float = 0.0  # every observed step, for measured rates over a window
    total_tokens: int = 0  # output tokens those steps produced
    drafted: float = 0.0  # mean draft tokens verified per step (same weights as ``seconds``)


#: a step is winsorised at [1/WINSOR, WINSOR] x its bucket's prediction before it updates anything
WINSOR = 1.5
WINSOR_AFTER = 4


class StepCosts:
    """Measured seconds per engine step by (batch size, K), with a common speed factor (module docstring).

    ``track_speed=False`` keeps the former estimator: per-bucket means of the raw seconds, weight ``alpha``
    (benchmarks/step_cost_drift.py compares the two)."""

    def __init__(self, alpha: float = 0.05, relative_alpha: float = 0.01, reference_steps: int = 20,
                 track_speed: bool = True):
        for name, value in (("alpha", alpha), ("relative_alpha", relative_alpha)):
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value}: an EWMA weight must be in (0, 1]")
        if reference_steps < 1:
            raise ValueError(f"reference_steps={reference_steps}: a number of steps, >= 1")
        self.alpha, self.relative_alpha, self.reference_steps = alpha, relative_alpha, reference_steps
        self.track_speed = track_speed
        self.speed = 1.0  # today's seconds per step over the buckets' (``seconds`` are at speed 1)
        self.buckets: dict[tuple[int, int], CostBucket] = {}

    def observe(self, batch_size: int, k: int, seconds: float, num_tokens: int = 0,
                num_drafted: int | None = None) -> None:
        """One step of ``batch_size`` requests at ``k`` that took ``seconds``, output ``num_tokens`` and
        verified ``num_drafted`` draft tokens (default ``batch_size * k``: no block trimmed)."""
        drafted = batch_size * k if num_drafted is None else num_drafted
        bucket = self.buckets.get((batch_size, k))
        if bucket is None:
            at_unit_speed = seconds / self.speed if self.track_speed else seconds
            self.buckets[(batch_size, k)] = CostBucket(at_unit_speed, 1, seconds, num_tokens, float(drafted))
            return
        bucket.num_steps += 1
        bucket.total_seconds += seconds
        bucket.total_tokens += num_tokens
        if self.track_speed:
            x = seconds
            if bucket.num_steps > WINSOR_AFTER:  # the prediction rests on a few steps at least
                predicted = self.speed * bucket.seconds
                x = min(max(seconds, predicted / WINSOR), predicted * WINSOR)
            if bucket.num_steps > self.reference_steps:
                self.speed += self.alpha * (x / bucket.seconds - self.speed)
            x, alpha = x / self.speed, self.relative_alpha
        else:
            x, alpha = seconds, self.alpha
        weight = max(alpha, 1.0 / bucket.num_steps)  # the plain mean until 1/alpha steps
        bucket.seconds += weight * (x - bucket.seconds)
        bucket.drafted += weight * (drafted - bucket.drafted)

    def to_rows(self) -> list[list[float]]:
        """JSON-safe ``[[b, K, seconds, num_steps, total_seconds, total_tokens, drafted], ...]`` sorted by
        (b, K); ``seconds`` at today's speed."""
        return [[b, k, self.speed * v.seconds, v.num_steps, v.total_seconds, v.total_tokens, v.drafted]
                for (b, k), v in sorted(self.buckets.items())]

    @classmethod
    def from_rows(cls, rows: list[list[float]], alpha: float = 0.05) -> StepCosts:
        """The inverse of ``to_rows`` (at speed 1); a row without ``drafted`` (six columns) verified b K per
        step."""
        costs = cls(alpha)
        for b, k, seconds, n, total_seconds, total_tokens, *drafted in rows:
            costs.buckets[(int(b), int(k))] = CostBucket(float(seconds), int(n), float(total_seconds),
                                                         int(total_tokens),
                                                         float(drafted[0]) if drafted else float(b * k))
        return costs


def with_prior(live: StepCosts, prior: StepCosts, max_prior_steps: int) -> StepCosts:
    """Live buckets completed with stored ones (cost_store.py: a table an earlier server measured on the
    same setup). A stored bucket counts as ``w = min(its steps, max_prior_steps)`` steps: alone it is
    used as measured once ``w`` reaches the cost model's ``min_steps``; beside a live bucket of ``n``
    steps the seconds (and draft tokens) are ``(n t_live + w t_stored) / (n + w)``, so live steps
    take over (after 16 live steps at ``w = 16`` they weigh half, after 300 they weigh 95%). The
    totals (measured rates over a window) stay the live ones."""
    if max_prior_steps < 0:
        raise ValueError(f"max_prior_steps={max_prior_steps}: a number of steps, >= 0")
    merged = StepCosts(live.alpha)
    live, prior = StepCosts.from_rows(live.to_rows(), live.alpha), StepCosts.from_rows(prior.to_rows())
    for key in sorted(set(live.buckets) | set(prior.buckets)):
        now, stored = live.buckets.get(key), prior.buckets.get(key)
        w = min(stored.num_steps, max_prior_steps) if stored is not None else 0
        if now is None:
            if w > 0:
                merged.buckets[key] = CostBucket(stored.seconds, w, 0.0, 0, stored.drafted)
            continue
        n = now.num_steps
        if w == 0:
            merged.buckets[key] = CostBucket(now.seconds, n, now.total_seconds, now.total_tokens, now.drafted)
            continue
        merged.buckets[key] = CostBucket((n * now.seconds + w * stored.seconds) / (n + w), n + w,
                                         now.total_seconds, now.total_tokens,
                                         (n * now.drafted + w * stored.drafted) / (n + w))
    return merged


def _features(terms: tuple[str, ...], b: np.ndarray, k: np.ndarray, n: np.ndarray) -> np.ndarray:
    columns = {"1": np.ones_like(b), "b": b, "k": k, "bk": b * k, "n": n}
    return np.stack([columns[t] for t in terms], axis=1)


class CostModel:
    """t(b, K) from measured buckets: measured where well sampled, fitted elsewhere (module docstring)."""

    def __init__(self, costs: StepCosts, *, min_steps: int = 8, max_weight: int = 50, prior_steps: int = 32):
        self.measured = {key: costs.speed * v.seconds for key, v in costs.buckets.items() if v.num_steps >= min_steps}
        self.num_steps = {key: costs.buckets[key].num_steps for key in self.measured}
        self.drafted = {key: costs.buckets[key].drafted for key in self.measured}
        self.prior_steps = prior_steps
        self.terms: tuple[str, ...] = ()
        self.coefficients = np.zeros(0)
        rows = [(b, k, v.drafted, costs.speed * v.seconds, min(v.num_steps, max_weight))
                for (b, k), v in costs.buckets.items()]
        for terms in _BASES:
            if "n" in terms:  # needs trimmed buckets at two (b, K) at least, else n is b K all over
                trimmed = sum(1 for r in rows if r[1] > 0 and r[2] < _WHOLE * r[0] * r[1])
                usable = rows if trimmed >= 2 else []
            elif "k" in terms or "bk" in terms:  # whole blocks only: these fits read n as b K
                usable = [r for r in rows if r[1] == 0 or r[2] >= _WHOLE * r[0] * r[1]]
            else:
                usable = [r for r in rows if r[1] == 0]
            if self._fit(terms, usable):
                break

    def _fit(self, terms: tuple[str, ...], rows: list[tuple[int, int, float, float, int]]) -> bool:
        if len(rows) < len(terms):
            return False
        b, k, n, y, w = (np.array(c, dtype=np.float64) for c in zip(*rows))
        x = _features(terms, b, k, n)
        if np.linalg.matrix_rank(x) < len(terms):
            return False
        root = np.sqrt(w)[:, None]
        coefficients = np.linalg.lstsq(x * root, y * root[:, 0], rcond=None)[0]
        if "n" in terms and min(coefficients[terms.index("bk")], coefficients[terms.index("n")]) < 0:
            return False  # drafting and verifying cannot cost less than nothing: too little trimmed data
        if coefficients.min() < 0:  # no part of a step costs less than nothing: the non-negative fit
            coefficients = nnls(x * root, y * root[:, 0])[0]
        self.coefficients, self.terms = coefficients, terms
        return True

    @property
    def knows_speculation(self) -> bool:
        """Whether t(b, K > 0) can be predicted (some K term is identified)."""
        return "k" in self.terms or "bk" in self.terms

    def seconds(self, batch_size: int, k: int, drafted: float | None = None) -> float | None:
        """Predicted seconds per step with ``drafted`` draft tokens verified (default b K: no block
        trimmed), never below the plain step's floors (module docstring); None when nothing measured
        supports it."""
        n = float(batch_size * k) if drafted is None else float(drafted)
        t = self._predict(batch_size, k, n)
        plain = self._predict(batch_size, 0, 0.0) if k > 0 and t is not None else None
        if plain is None:
            return t
        floor = 1.0 + MIN_DRAFT_COST * n / batch_size
        if (batch_size, k) not in self.measured and n >= _WHOLE * batch_size * k:
            floor = max(floor, self.ratio_floor(batch_size, k))
        return max(t, plain * floor)

    def ratio_floor(self, batch_size: int, k: int) -> float:
        """The largest measured t(b', K') / t(b', 0) over whole-block buckets with b' <= ``batch_size`` and
        0 < K' <= ``k`` (1.0 when there is none): the least relative cost of a step at (b, K)."""
        ratios = [seconds / self.measured[(b, 0)] for (b, kk), seconds in self.measured.items()
                  if 0 < kk <= k and b <= batch_size and (b, 0) in self.measured
                  and self.drafted[(b, kk)] >= _WHOLE * b * kk]
        return max(ratios, default=1.0)

    def _predict(self, batch_size: int, k: int, n: float) -> float | None:
        fitted = self._fitted(batch_size, k, n)
        if (batch_size, k) not in self.measured:
            return fitted
        measured, steps = self.measured[(batch_size, k)], self.num_steps[(batch_size, k)]
        if "n" not in self.terms and k > 0 and self.drafted[(batch_size, k)] < _WHOLE * batch_size * k:
            return fitted  # a trimmed bucket says nothing of whole blocks, and n is not in the fit
        if fitted is None:
            return measured
        at_bucket = self._fitted(batch_size, k, self.drafted[(batch_size, k)])
        return max(fitted + steps / (steps + self.prior_steps) * (measured - at_bucket), _MIN_SECONDS)

    def _fitted(self, batch_size: int, k: int, n: float | None = None) -> float | None:
        if not self.terms or (k > 0 and not self.knows_speculation):
            return None
        n = float(batch_size * k) if n is None else n
        x = _features(self.terms, np.array([float(batch_size)]), np.array([float(k)]), np.array([n]))
        return max(float((x @ self.coefficients)[0]), _MIN_SECONDS)

    def describe(self) -> dict[str, float]:
        """The fitted coefficients by term (``{"1": c0, "b": c1, ...}``), for logs and benchmarks."""
        return {t: float(c) for t, c in zip(self.terms, self.coefficients)}
