"""Which proposer drafts a request's next block: the learned drafter, or prompt lookup (ngram).

Prompt lookup (vLLM's ``ngram`` method: the tokens that followed the longest earlier match of the
context's last 2-4 tokens) needs no training and accepts long runs on copy-heavy text (code edits,
quoting, structured output), where a young drafter accepts little. The hybrid serves both: the drafter
drafts every block, and where the context has a full-length match the match may replace the draft.

``ProposerChooser`` decides per request, from what each proposer's blocks got accepted: a running mean
of accepted tokens per block, per request (a request's own text decides whether it copies), started
from the mean over all requests (a new request's best guess). With a match it picks the proposer whose
mean is higher; ties and a proposer never tried go to the ngram match, so prompt lookup is tried
before it is judged. So that a losing proposer stays measured, every ``explore_every``-th decision a
request makes with a match against ngram picks the match anyway.

Only the drafter's blocks teach the drafter: records tag each block with its proposer, and replay,
per-version acceptance and the live check leave ngram blocks out (they say nothing of the weights).
Output is unchanged either way: the target verifies every block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from online_opd.traces.records import DRAFTER, NGRAM, PROPOSERS

__all__ = ["DRAFTER", "NGRAM", "PROPOSERS", "ProposerChooser"]


@dataclass
class _Mean:
    """Exponential running mean of accepted tokens per block (None until the first block)."""

    alpha: float
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass
class _Request:
    means: dict[str, _Mean]
    declined: int = 0  # decisions with a match that went to the drafter since the last ngram block


@dataclass
class ProposerChooser:
    """Per-request choice between the drafter's block and a prompt-lookup match (module docstring).

    ``global_alpha`` weights a block in the mean over all requests, ``request_alpha`` in a request's
    own; ``explore_every`` >= 1 (1: always take the match)."""

    global_alpha: float = 0.02
    request_alpha: float = 0.3
    explore_every: int = 16
    _global: dict[str, _Mean] = field(default_factory=dict)
    _requests: dict[str, _Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.global_alpha <= 1 or not 0 < self.request_alpha <= 1:
            raise ValueError("global_alpha and request_alpha must be in (0, 1]")
        if self.explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {self.explore_every}")
        self._global = {p: _Mean(self.global_alpha) for p in PROPOSERS}

    def mean(self, proposer: str, request_id: str | None = None) -> float | None:
        """Accepted tokens per block: the request's running mean, else the one over all requests."""
        state = self._requests.get(request_id) if request_id is not None else None
        if state is not None and state.means[proposer].value is not None:
            return state.means[proposer].value
        return self._global[proposer].value

    def choose(self, request_id: str, has_match: bool) -> str:
        """The proposer of the request's next block; the drafter whenever there is no match."""
        if not has_match:
            return DRAFTER
        state = self._state(request_id)
        ngram, drafter = self.mean(NGRAM, request_id), self.mean(DRAFTER, request_id)
        if ngram is None or drafter is None or ngram >= drafter:
            state.declined = 0
            return NGRAM
        state.declined += 1
        if state.declined >= self.explore_every:
            state.declined = 0
            return NGRAM
        return DRAFTER

    def observe(self, request_id: str, proposer: str, num_accepted: int) -> None:
        """A verified block of ``proposer`` for the request: ``num_accepted`` of its drafts accepted."""
        if proposer not in self._global:
            raise ValueError(f"unknown proposer {proposer!r}; expected one of {PROPOSERS}")
        overall = self._global[proposer]
        mean = self._state(request_id).means[proposer]
        if mean.value is None:
            mean.value = overall.value  # start from the mean over all requests (None: this block alone)
        mean.add(num_accepted)
        overall.add(num_accepted)

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget the requests not in ``request_ids`` (finished or preempted ones)."""
        for rid in [r for r in self._requests if r not in request_ids]:
            del self._requests[rid]

    def __len__(self) -> int:
        return len(self._requests)

    def _state(self, request_id: str) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _Request({p: _Mean(self.request_alpha) for p in PROPOSERS})
        return state
