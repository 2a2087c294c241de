"""Per-request draft trimming: verify only the drafted tokens likely enough to be accepted.

On a CPU verification is compute-bound: each drafted token a step verifies costs about the same
whatever its fate, so at batch size 8 or 32 a whole K-block pays only where its tokens are likely
accepted, and one K per batch size (policy.py) must average over confident and hopeless blocks.
The drafter knows which is which: the top softmax probability of each drafted position orders its
acceptance and is close to it (benchmarks/draft_confidence.py, held-out ShareGPT: position-1 bins of
0.1 accept 2-12 points below their mean confidence, which the calibration below learns). So each
request's block is cut to the leading tokens whose estimated probability of all being accepted
exceeds the batch size's threshold r_b:

    L = #{k : prod_{j <= k} p_j > r_b},  p_j = calibrated acceptance of position j at its confidence

(the product is non-increasing, so these are the leading positions). A token kept at position L
adds P(first L accepted) expected output tokens for one more verified token, worth r_b of an
output token at plain cost: with t(b, K) the step cost, r_b = (t(b, K) - t(b, 0)) / (K t(b, 0)),
the marginal cost of one verified token per request, in plain output tokens
(``trim_threshold``; = (break-even tau(K) - 1) / K).

``ConfidenceCalibration`` learns p_j online from the served blocks: per position and confidence
bin, how many blocks reached the position (all earlier tokens accepted) and how many of those
accepted it, started from a prior of ``prior`` blocks at the bin's centre (the raw confidence).
It only learns at positions it keeps, so a bin below every threshold keeps its prior.

``TrimOutlook`` keeps the confidences of recent blocks, untrimmed, to predict what trimming at any
threshold would draft and accept (``expected``): the policy compares that with not speculating.
Trimming never changes a token: a kept prefix is the drafter's own block, verified by the target.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

NUM_BINS = 10
#: thresholds at which ``TrimOutlook.summary`` reports drafted and accepted tokens per block
OUTLOOK_GRID = tuple(round(0.05 * i, 2) for i in range(20))


def confidence_bins(conf: np.ndarray) -> np.ndarray:
    """Bin index of each confidence in [0, 1] (NUM_BINS equal bins)."""
    return np.clip((np.asarray(conf, dtype=np.float64) * NUM_BINS).astype(np.int64), 0, NUM_BINS - 1)


@dataclass
class ConfidenceCalibration:
    """p_j(bin): P(token j accepted | tokens < j accepted, its confidence in bin), learnt online."""

    max_k: int
    prior: float = 4.0
    seen: np.ndarray = field(default=None)  # type: ignore[assignment]  # [max_k, NUM_BINS] blocks reaching j
    hits: np.ndarray = field(default=None)  # type: ignore[assignment]  # [max_k, NUM_BINS] ... accepting j

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k={self.max_k}: calibrate at least one position")
        if self.prior <= 0:
            raise ValueError(f"prior={self.prior} must be > 0")
        shape = (self.max_k, NUM_BINS)
        self.seen = np.zeros(shape) if self.seen is None else np.asarray(self.seen, dtype=np.float64).reshape(shape)
        self.hits = np.zeros(shape) if self.hits is None else np.asarray(self.hits, dtype=np.float64).reshape(shape)

    def rates(self) -> np.ndarray:
        """[max_k, NUM_BINS] calibrated acceptance rates."""
        centre = (np.arange(NUM_BINS) + 0.5) / NUM_BINS
        return (self.hits + self.prior * centre) / (self.seen + self.prior)

    def survival(self, conf: np.ndarray) -> np.ndarray:
        """[R, K] estimated P(first k tokens accepted) for blocks of confidences [R, K] (K <= max_k)."""
        conf = np.atleast_2d(np.asarray(conf, dtype=np.float64))
        k = conf.shape[1]
        if k > self.max_k:
            raise ValueError(f"blocks of {k} tokens, calibrated for {self.max_k}")
        return np.cumprod(self.rates()[np.arange(k)[None, :], confidence_bins(conf)], axis=1)

    def keep_lengths(self, conf: np.ndarray, thresholds: np.ndarray | float) -> np.ndarray:
        """[R] tokens kept per block: the leading positions whose survival exceeds the block's
        threshold (a scalar, or [R])."""
        survival = self.survival(conf)
        limit = np.broadcast_to(np.asarray(thresholds, dtype=np.float64), (survival.shape[0],))
        return (survival > limit[:, None]).sum(axis=1)

    def observe(self, conf: Sequence[float], num_accepted: int) -> None:
        """A verified block whose first ``len(conf)`` tokens (those verified) had these confidences."""
        bins = confidence_bins(np.asarray(conf[: self.max_k]))
        for j, b in enumerate(bins):
            if j > num_accepted:
                break  # an earlier token was rejected: position j was not reached
            self.seen[j, b] += 1
            self.hits[j, b] += num_accepted > j

    def reset(self) -> None:
        """Back to the prior (a new drafter version: its confidences mean something else)."""
        self.seen[:] = 0
        self.hits[:] = 0

    def to_dict(self) -> dict:
        return {"max_k": self.max_k, "prior": self.prior, "seen": self.seen.tolist(), "hits": self.hits.tolist()}


@dataclass
class TrimOutlook:
    """Confidences of the last ``capacity`` untrimmed blocks, for predictions at any threshold."""

    capacity: int = 1024
    blocks: deque = field(default_factory=deque)

    def add(self, conf: np.ndarray) -> None:
        """Blocks [R, K] of confidences, as drafted (before trimming)."""
        for row in np.atleast_2d(np.asarray(conf, dtype=np.float64)):
            self.blocks.append(row)
            if len(self.blocks) > self.capacity:
                self.blocks.popleft()

    def expected(self, calibration: ConfidenceCalibration, threshold: float) -> tuple[float, float] | None:
        """(drafted, accepted) tokens per block when trimming at ``threshold``; None without blocks.
        Accepted = sum of the kept positions' survival (the calibration's expectation)."""
        rows = self._at(calibration, [threshold])
        return (rows[0][1], rows[0][2]) if rows else None

    def summary(self, calibration: ConfidenceCalibration) -> list[list[float]]:
        """``[[threshold, drafted, accepted], ...]`` over OUTLOOK_GRID (empty without blocks)."""
        return [[r, round(drafted, 4), round(accepted, 4)]
                for r, drafted, accepted in self._at(calibration, OUTLOOK_GRID)]

    def _at(self, calibration: ConfidenceCalibration,
            thresholds: Sequence[float]) -> list[tuple[float, float, float]]:
        if not self.blocks:
            return []
        width = min(len(b) for b in self.blocks)
        survival = calibration.survival(np.stack([b[:width] for b in self.blocks]))  # once for every threshold
        out = []
        for r in thresholds:
            kept = survival > r
            out.append((r, float(kept.sum(axis=1).mean()), float((survival * kept).sum(axis=1).mean())))
        return out


def outlook_at(summary: Sequence[Sequence[float]], threshold: float) -> tuple[float, float] | None:
    """(drafted, accepted) per block at ``threshold`` from a ``TrimOutlook.summary``: the row of the
    nearest grid threshold at or above it (trimming at least as much as asked); None if empty."""
    if not summary:
        return None
    above = [row for row in summary if row[0] >= threshold - 1e-9]
    row = min(above, key=lambda r: r[0]) if above else max(summary, key=lambda r: r[0])
    return float(row[1]), float(row[2])


def trim_threshold(plain_seconds: float | None, spec_seconds: float | None, k: int) -> float | None:
    """r_b = (t(b, K) - t(b, 0)) / (K t(b, 0)): one more verified token per request, in plain output
    tokens (module docstring); None when either cost is unknown."""
    if plain_seconds is None or spec_seconds is None or plain_seconds <= 0 or k < 1:
        return None
    return max(spec_seconds - plain_seconds, 0.0) / (k * plain_seconds)
