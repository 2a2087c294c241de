"""The speculation policy: K per batch size that maximises expected output tokens per second.

With per-position acceptance a_k = P(at least k drafts accepted) (acceptance.py),
a request gains in one step with K drafts

    tau(K) = 1 + sum_{k<=K} a_k

tokens (the target always adds one), so a step of b requests yields

    goodput(b, K) = b tau(K) / t(b, K)

tokens per second, t(b, K) being the step cost (costs.py). For each b the
policy takes the K in 0..K_max with the highest goodput (ties: the smaller K),
and moves there from the K serving now only when it beats it by more than
``margin`` (relative): goodput(b, K*) > (1 + margin) goodput(b, K_now). At exact
break-even the serving K stays. Speculating K tokens at b pays exactly when
tau(K) > t(b, K) / t(b, 0): the break-even tau (``break_even_taus``).

The margin guards switching speculation on or up, never staying slower than
plain: a serving K > 0 whose goodput is predicted below plain decoding's is left
at once, for a larger K only if that beats plain by the margin, else for the
best K not above it (often 0). Plain decoding is the product's
floor, and the first K > 0 is often chosen on few explored steps and a fitted
cost: a fresh server at c = 4 (float32 CPU) chose K = 1 at b = 4 that way, then
measured t(4, 1) at 1.34 t(4, 0) with tau(1) = 1.32, a predicted 1.1% loss, and
the symmetric margin kept it for 339 steps (a 9% loss measured in its steps).

Monotone in acceptance: for K2 > K1, goodput(K2) / goodput(K1) =
[tau(K2) / tau(K1)] [t(K1) / t(K2)]: the costs do not depend on acceptance,
and the first factor grows whenever acceptance improves in the sense that
tau(K2) / tau(K1) does not fall for any K2 > K1. That holds for geometric
profiles a_k = alpha^k as alpha grows (sum of alpha^j over K1 < j <= K2 against
the lower powers) and for a profile scaled up, a_k -> c a_k with c > 1. So such
better acceptance never lowers the chosen K (with or without the margin): the
serving K's goodput relative to plain only grows, so better acceptance never
forces it down, and where a move is forced its target is monotone too (a larger
K's lead over plain grows with acceptance; the best K <= K_now is monotone).

Without a cost model for K > 0 (nothing speculative measured yet) the schedule
is conservative: K = 0 for b > 1, and at b = 1 the K the policy picks with the
costs measured at b = 1 and, for the K not measured there, a prior cost ratio
t(1, K) / t(1, 0) = 1 + ``prior_cost_per_token`` K (0.125: a K = 4 step cost 1.5
plain steps on the 2-core CPU), or the largest ratio measured at a smaller K when
that is higher (a c=1 server measured K = 1 at 1.32 plain steps and moved to an
unmeasured K = 2 priced at 1.25); it speculates only when acceptance is known to
pay by the margin.

With draft trimming (trim.py: each request verifies only the leading drafted
tokens whose calibrated probability of being accepted exceeds r_b, the marginal
cost of a verified token at batch size b), a step at K_max drafts a block per
request and verifies what its confidence says pays. Given the drafter's recent
blocks (``trim_outlook``: drafted tokens L(r) and expected accepted tokens A(r)
per block at threshold r), the policy compares, at each b,

    b (1 + A(r_b)) / t(b, K_max, n = b L(r_b))   against   b / t(b, 0)

and serves K_max (trimmed at r_b) or 0, with the same margin (switching on only:
serving K_max, it stops as soon as plain is predicted faster). ``Decision.thresholds``
carries r_b for every b (0: no trimming where the costs are unknown, so explored
steps there measure whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from online_opd.speculation.costs import MIN_DRAFT_COST, CostModel
from online_opd.speculation.trim import outlook_at, trim_threshold

#: vLLM's ``num_speculative_tokens_per_batch_size``: inclusive batch-size ranges with their K
Schedule = list[tuple[int, int, int]]

PRIOR_COST_PER_TOKEN = 0.125


def clean_profile(acceptance: Sequence[float | None], max_k: int) -> list[float]:
    """a_1..a_max_k clipped to [0, 1] and non-increasing (P(r >= k) cannot grow with k); unknown = 0."""
    out: list[float] = []
    previous = 1.0
    for k in range(max_k):
        a = acceptance[k] if k < len(acceptance) and acceptance[k] is not None else 0.0
        previous = min(max(float(a), 0.0), previous)
        out.append(previous)
    return out


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """tau(K) = 1 + sum_{j<=K} a_j: output tokens per request in a step with K drafts."""
    return 1.0 + sum(acceptance[:k])


def choose_k(step_seconds: Sequence[float | None], acceptance: Sequence[float], *, current_k: int = 0,
             margin: float = 0.0) -> int:
    """The K for one batch size: ``step_seconds[K]`` = t(b, K) (None: unknown, never chosen)."""
    goodput = [expected_tokens(acceptance, k) / t if t is not None else None
               for k, t in enumerate(step_seconds)]
    known = [k for k, g in enumerate(goodput) if g is not None]
    if not known:
        return current_k
    best = max(known, key=lambda k: (goodput[k], -k))  # ties: the smaller K
    now = goodput[current_k] if current_k < len(goodput) else None
    if now is None:
        return best
    if current_k > 0 and goodput[0] is not None and now < goodput[0]:  # never stay slower than plain
        if goodput[best] > (1.0 + margin) * goodput[0]:  # up only where it beats plain by the margin
            return best
        return max((k for k in known if k <= current_k), key=lambda k: (goodput[k], -k))
    if goodput[best] > (1.0 + margin) * now:
        return best
    return current_k


def compress(lookup: Sequence[int]) -> Schedule:
    """Dense ``lookup[b]`` (index 0 unused) -> vLLM's ranges ``[(first_b, last_b, K), ...]``."""
    ranges: Schedule = []
    for b in range(1, len(lookup)):
        if ranges and ranges[-1][2] == lookup[b]:
            ranges[-1] = (ranges[-1][0], b, lookup[b])
        else:
            ranges.append((b, b, lookup[b]))
    return ranges


def break_even_taus(model: CostModel, batch_size: int, max_k: int) -> list[float | None]:
    """t(b, K) / t(b, 0) for K = 1..max_k: the tau(K) speculating K tokens must exceed to pay."""
    plain = model.seconds(batch_size, 0)
    out: list[float | None] = []
    for k in range(1, max_k + 1):
        t = model.seconds(batch_size, k)
        out.append(t / plain if t is not None and plain else None)
    return out


@dataclass
class Decision:
    """A schedule and the figures that decided it."""

    schedule: Schedule
    lookup: list[int]  # [max_batch_size + 1] K by batch size (index 0 unused)
    predicted_goodput: list[float | None] = field(default_factory=list)  # [max_batch_size + 1] tokens/s
    is_conservative: bool = False  # no measured cost for K > 0: the prior decided b = 1, b > 1 got K = 0
    thresholds: list[float] | None = None  # [max_batch_size + 1] trimming threshold r_b (with a trim outlook)


def decide(model: CostModel | None, acceptance: Sequence[float | None], *, max_k: int, max_batch_size: int,
           current: Sequence[int] | None = None, margin: float = 0.05,
           prior_cost_per_token: float = PRIOR_COST_PER_TOKEN,
           trim_outlook: Sequence[Sequence[float]] | None = None) -> Decision:
    """The schedule for batch sizes 1..max_batch_size (module docstring); ``current[b]``: K serving now.
    ``trim_outlook``: the worker's ``TrimOutlook.summary`` when draft trimming is on (None: off)."""
    profile = clean_profile(acceptance, max_k)
    is_conservative = model is None or not model.knows_speculation
    lookup, goodput = [0], [None]
    thresholds: list[float] | None = [0.0] if trim_outlook is not None else None
    for b in range(1, max_batch_size + 1):
        now = min(current[b], max_k) if current is not None and b < len(current) else 0
        seconds = _step_seconds(model, b, max_k, is_conservative, prior_cost_per_token)
        r = trim_threshold(seconds[0], seconds[max_k], max_k) if seconds else None
        if thresholds is not None:
            thresholds.append(min(r, 1.0) if r is not None else 0.0)
        trimmed = outlook_at(trim_outlook, r) if trim_outlook and r is not None and not is_conservative else None
        if trimmed is not None:
            drafted, accepted = trimmed
            t_spec = model.seconds(b, max_k, drafted=b * drafted)
            options = [b / seconds[0], b * (1.0 + accepted) / t_spec if t_spec else None]
            serving = 1 if now > 0 else 0
            best = 1 if options[1] is not None and options[1] > options[0] else 0
            if (best != serving and options[best] <= (1.0 + margin) * (options[serving] or 0.0)
                    and (serving == 0 or options[1] >= options[0])):  # speculating: never below plain
                best = serving
            lookup.append(max_k if best else 0)
            goodput.append(options[best])
            continue
        k = choose_k(seconds, profile, current_k=now, margin=margin) if seconds else 0
        lookup.append(k)
        t = seconds[k] if seconds else None
        goodput.append(b * expected_tokens(profile, k) / t if t is not None else None)
    return Decision(compress(lookup), lookup, goodput, is_conservative, thresholds)


def _step_seconds(model: CostModel | None, b: int, max_k: int, is_conservative: bool,
                  prior: float) -> list[float | None] | None:
    """t(b, 0..max_k); when conservative, at b = 1 the measured buckets and the prior ratio for the
    others; None where nothing is known."""
    if is_conservative:
        if b > 1:
            return None
        measured = model.measured if model is not None else {}
        plain = measured.get((1, 0)) or (model.seconds(1, 0) if model is not None else None) or 1.0
        seconds, least = [plain], 1.0  # least: the largest ratio t(1, K') / t(1, 0) measured below K
        for k in range(1, max_k + 1):
            t = measured.get((1, k))
            if t is not None:
                least = max(least, t / plain)
            else:  # an unmeasured K is never relatively cheaper than a measured smaller one
                t = plain * max(1.0 + prior * k, least)
            seconds.append(max(t, plain * (1.0 + MIN_DRAFT_COST * k)))
        return seconds
    return [model.seconds(b, k) for k in range(max_k + 1)]
