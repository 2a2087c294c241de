"""Record schema: what the serving engine captures per finished request.

A ``SequenceRecord`` holds the token ids of one request (prompt + output),
its sampling parameters, the drafter version that drafted it, and one
``BlockRecord`` per drafted block the target verified (see
docs/architecture.md#block-record and #sequence-record). ``check_fidelity``
tests the capture-fidelity contract (docs/architecture.md#capture-fidelity)
that every record must satisfy before it is trained on.

Scheduler events (``SequenceRecord.events``) are JSON dicts that mark a break
in the block chain. Shape::

    {"anchor_before": int,   # required: anchor of the last block before the break
     "kind": str,            # optional: "preemption", "end", ...
     ...}                    # any other JSON-friendly keys, kept as they are

Across a marked break (between the block whose anchor is ``anchor_before`` and
the block after it) anchors must still strictly increase, but the next anchor
need not be ``a + r + 1 + g``.

Block lengths and plain steps. The server may draft a different number of
tokens K at every step, down to none (vLLM num_speculative_tokens_per_batch_size
with k = 0, or speculation off): blocks are 1..K tokens long, and a step that
drafts nothing for a request is a *plain* step, which feeds the last verified
token, and the target adds exactly one token of its own. ``num_plain_steps`` g
of a block counts the plain steps since the previous block (for the first block:
since the request started, its prefill step included), so after a block
(a, r) the next block's anchor is exactly ``a + r + 1 + g``: the g tokens in
between are the target's own, one per plain step, and a block lost by capture
shows as a broken chain. A request that never speculated has no blocks at all,
only its tokens. Records captured before the field existed read g = 0.

Drafter versions. A hot reload can land while a request runs, so each block
names the version whose weights drafted it (``BlockRecord.drafter_version``;
None in records written before the field existed: the record's
``drafter_version``, which is its first block's) and whether its drafter
context was pure: every context K/V the drafter attended to (they live in
vLLM's paged KV cache, computed once per token, shared through the prefix
cache) was computed by those same weights. A mixed block (new weights over K/V
the old ones computed) is still a valid training example, since replay
recomputes q from the target's features, but it measures neither version:
per-version acceptance figures count ``pure_blocks_by_version`` only.

Proposers. With the ngram fallback (online_opd/speculation/hybrid.py) a block may
have been drafted by prompt lookup instead of the drafter (``BlockRecord.proposer``
"ngram"; "drafter" in records written before the field existed). Such a block
keeps the chain and the fidelity contract like any other, but replay and the
per-version figures leave it out: it says nothing of the drafter's weights.

The target's signal. A block may carry the verifier's top-k log-probabilities
(``BlockRecord.teacher``) and a record the target's auxiliary hidden states
(``SequenceRecord.hidden``), captured while serving so that replay needs no target
forward for them: online_opd/traces/target_signal.py.

What lives elsewhere: capture (vllm_patches/), storage (online_opd/traces/buffer),
replay of records into training tensors (online_opd/opd/replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from online_opd.traces.fields import (
    count_field,
    events_field,
    float_field,
    int_field,
    optional_float,
    optional_str,
    require_dict,
    required_field,
    str_field,
    token_tuple,
)
from online_opd.traces.target_signal import PathTeacher, TargetHidden, TeacherTopK

DRAFTER, NGRAM = "drafter", "ngram"  # BlockRecord.proposer (speculation/hybrid.py uses the same names)
PROPOSERS = (DRAFTER, NGRAM)


@dataclass(frozen=True)
class BlockRecord:
    """One drafted block: drafted at ``anchor``, verified by the target."""

    anchor: int  # index of the last verified token when the block was drafted
    draft_tokens: tuple[int, ...]  # [K] proposed ids for positions anchor+1 .. anchor+K, K >= 1
    num_accepted: int  # r, 0 <= r <= K, as decided by the verifier
    drafter_version: str | None = None  # version whose weights drafted it; None = the record's
    is_context_pure: bool = True  # the drafter's context K/V were all computed by those weights
    num_plain_steps: int = 0  # steps without a draft since the previous block (module docstring)
    proposer: str = DRAFTER  # who drafted it: the drafter, or prompt lookup ("ngram", speculation/hybrid.py)
    # tokens the drafter drafted when the server verified fewer (draft trimming, speculation/trim.py:
    # ``draft_tokens`` are the first of them); None = every drafted token was verified
    num_drafted: int | None = None
    # the verifier's top-k log-probabilities at its K + 1 rows (TeacherTopK); None = not captured: replay
    # recomputes the teacher with a target forward
    teacher: TeacherTopK | None = None

    def __post_init__(self) -> None:
        # checked here, not only when read: a wrong row count would make the whole segment unreadable
        if self.teacher is not None and len(self.teacher.token_ids) != len(self.draft_tokens) + 1:
            raise ValueError(f"teacher has {len(self.teacher.token_ids)} rows; a block of "
                             f"{len(self.draft_tokens)} draft tokens has {len(self.draft_tokens) + 1}")

    @property
    def is_drafters(self) -> bool:
        """Drafted by the drafter's weights (not by the ngram fallback): a block that speaks of them."""
        return self.proposer == DRAFTER

    @property
    def drafted_width(self) -> int:
        """K' the drafter drafted this block with (a DFlash K'-block is not the first rows of a K-block)."""
        return len(self.draft_tokens) if self.num_drafted is None else self.num_drafted

    @property
    def is_whole(self) -> bool:
        """A drafter's block verified whole: what replay, per-version acceptance and the live check read
        (a trimmed block's tokens are the first of a wider block, and its acceptance is the trimmed one's)."""
        return self.is_drafters and self.num_drafted is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "anchor": self.anchor,
            "draft_tokens": list(self.draft_tokens),
            "num_accepted": self.num_accepted,
            "drafter_version": self.drafter_version,
            "is_context_pure": self.is_context_pure,
            "num_plain_steps": self.num_plain_steps,
            "proposer": self.proposer,
            **({"num_drafted": self.num_drafted} if self.num_drafted is not None else {}),
            **({"teacher": self.teacher.to_dict()} if self.teacher is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "block") -> "BlockRecord":
        """Parse a dict from ``to_dict``; ValueError names the bad field. The version, purity and
        plain-step, proposer and teacher fields may be missing or null (records captured before they
        existed): None, True, 0, "drafter" and None. A teacher has exactly K + 1 rows."""
        data = require_dict(data, where)
        version = data.get("drafter_version")
        if version is not None and not isinstance(version, str):
            raise ValueError(f"{where}.drafter_version must be a str or null, got {version!r}")
        proposer = data.get("proposer")
        if proposer is not None and proposer not in PROPOSERS:
            raise ValueError(f"{where}.proposer must be one of {PROPOSERS} or null, got {proposer!r}")
        is_pure = data.get("is_context_pure")
        if is_pure is not None and not isinstance(is_pure, bool):
            raise ValueError(f"{where}.is_context_pure must be a bool or null, got {is_pure!r}")
        draft_tokens = token_tuple(data, "draft_tokens", where)
        num_drafted = data.get("num_drafted")
        if num_drafted is not None and (isinstance(num_drafted, bool) or not isinstance(num_drafted, int)
                                        or num_drafted <= len(draft_tokens)):
            raise ValueError(f"{where}.num_drafted must be null or an int above the {len(draft_tokens)} "
                             f"verified draft tokens, got {num_drafted!r}")
        teacher = data.get("teacher")
        if teacher is not None:
            teacher = TeacherTopK.from_dict(teacher, f"{where}.teacher")
            if len(teacher.token_ids) != len(draft_tokens) + 1:
                raise ValueError(f"{where}.teacher has {len(teacher.token_ids)} rows; a block of "
                                 f"{len(draft_tokens)} draft tokens has {len(draft_tokens) + 1} "
                                 f"(drafted positions + bonus)")
        return cls(
            anchor=int_field(data, "anchor", where),
            draft_tokens=draft_tokens,
            num_accepted=int_field(data, "num_accepted", where),
            drafter_version=version,
            is_context_pure=True if is_pure is None else is_pure,
            num_plain_steps=count_field(data, "num_plain_steps", where),
            proposer=DRAFTER if proposer is None else proposer,
            num_drafted=num_drafted,
            teacher=teacher,
        )


@dataclass(frozen=True)
class SequenceRecord:
    """One finished request sampled for logging: token ids only, no text."""

    record_id: str
    model_id: str
    drafter_version: str
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    tokens: tuple[int, ...]  # [T] prompt + output ids
    prompt_len: int
    blocks: tuple[BlockRecord, ...]  # in drafting order
    events: tuple[dict, ...] = ()  # chain breaks, see the module docstring
    captured_at: float = 0.0  # unix seconds when the request finished (0 = unknown)
    replica: str = ""  # the serving replica that captured it (host_pid of its server; "" = unknown, older records)
    # the target's aux hidden states at positions hidden.start .. len(tokens) - 2 (TargetHidden); None = not
    # captured: replay recomputes them with a target forward
    hidden: TargetHidden | None = None
    # the verifier's top-k rows of the steps that verified no block for it, at the positions whose next token
    # they sampled (PathTeacher); None = not captured
    path_teacher: PathTeacher | None = None

    def __post_init__(self) -> None:
        if self.hidden is not None and self.hidden.end > len(self.tokens) - 1:
            raise ValueError(f"hidden rows reach position {self.hidden.end - 1}; a record of {len(self.tokens)} "
                             f"tokens has features up to position {len(self.tokens) - 2}")
        if self.path_teacher is not None and self.path_teacher.positions[-1] > len(self.tokens) - 2:
            raise ValueError(f"path_teacher has a row at position {self.path_teacher.positions[-1]}; a record of "
                             f"{len(self.tokens)} tokens has next-token rows up to position {len(self.tokens) - 2}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "record_id": self.record_id,
            "model_id": self.model_id,
            "drafter_version": self.drafter_version,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "tokens": list(self.tokens),
            "prompt_len": self.prompt_len,
            "blocks": [b.to_dict() for b in self.blocks],
            "events": [dict(e) for e in self.events],
            "captured_at": self.captured_at,
            "replica": self.replica,
            **({"hidden": self.hidden.to_dict()} if self.hidden is not None else {}),
            **({"path_teacher": self.path_teacher.to_dict()} if self.path_teacher is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> "SequenceRecord":
        """Parse a dict from ``to_dict``; ValueError names the bad field."""
        data = require_dict(data, "record")
        blocks = required_field(data, "blocks", "record")
        if not isinstance(blocks, (list, tuple)):
            raise ValueError(f"record.blocks must be a list, got {type(blocks).__name__}")
        return cls(
            record_id=str_field(data, "record_id"),
            model_id=str_field(data, "model_id"),
            drafter_version=str_field(data, "drafter_version"),
            temperature=float_field(data, "temperature"),
            top_p=float_field(data, "top_p"),
            top_k=int_field(data, "top_k", "record"),
            tokens=token_tuple(data, "tokens", "record"),
            prompt_len=int_field(data, "prompt_len", "record"),
            blocks=tuple(BlockRecord.from_dict(b, f"record.blocks[{i}]") for i, b in enumerate(blocks)),
            events=events_field(data.get("events", ())),
            captured_at=optional_float(data, "captured_at"),
            replica=optional_str(data, "replica"),
            hidden=None if data.get("hidden") is None else TargetHidden.from_dict(data["hidden"]),
            path_teacher=None if data.get("path_teacher") is None else PathTeacher.from_dict(data["path_teacher"]),
        )


def acceptance_length(num_accepted: float, num_drafts: float) -> float | None:
    """tau = 1 + accepted / drafts: tokens per target forward, vLLM's definition.

    Each verified draft (block) yields its r accepted tokens plus the one the
    target adds itself. Counts may be floats (counter deltas, expected accepted
    counts). None when there are no drafts: there is no tau to report, and
    None stays valid JSON where NaN would not.
    """
    if num_drafts <= 0:
        return None
    return 1.0 + num_accepted / num_drafts


def pure_blocks_by_version(record: SequenceRecord) -> dict[str, list[BlockRecord]]:
    """The record's pure blocks grouped by the version that drafted them, in drafting order (the
    drafter's whole blocks only: an ngram-fallback block says nothing of a version's weights, and a
    trimmed block's acceptance is the trimming's as much as theirs)."""
    out: dict[str, list[BlockRecord]] = {}
    for block in record.blocks:
        if block.is_context_pure and block.is_whole:
            version = record.drafter_version if block.drafter_version is None else block.drafter_version
            out.setdefault(version, []).append(block)
    return out


def path_rows(record: SequenceRecord) -> dict[int, tuple[tuple[int, ...], tuple[float, ...]]]:
    """The target's captured top-k next-token rows along the record's own tokens, by position p (the row
    of p is p(. | tokens[:p + 1])): the plain steps' (``SequenceRecord.path_teacher``) and those of the
    logged blocks' teachers that lie on the sequence: a block (a, d, r) verified row j at a + j
    conditioned on d_<=j, which are the sequence's own tokens for j <= r (its bonus row too when every
    draft was accepted). Rows of one k only: the plain steps' k, else the first teacher's."""
    rows: dict[int, tuple[tuple[int, ...], tuple[float, ...]]] = {}
    last = len(record.tokens) - 2
    k = record.path_teacher.rows.top_k if record.path_teacher is not None else None
    for block in record.blocks:
        teacher = block.teacher
        if teacher is None or (k is not None and teacher.top_k != k):
            continue
        k = teacher.top_k
        for j in range(min(block.num_accepted, len(block.draft_tokens)) + 1):  # the bonus row when r = K_m
            if block.anchor + j <= last:
                rows[block.anchor + j] = (teacher.token_ids[j], teacher.logprobs[j])
    if record.path_teacher is not None:
        teacher = record.path_teacher.rows
        rows.update(zip(record.path_teacher.positions, zip(teacher.token_ids, teacher.logprobs)))
    return rows


def check_fidelity(record: SequenceRecord) -> list[str]:
    """Violations of the capture-fidelity contract; an empty list means OK.

    Per block (a = anchor, d = draft_tokens, r = num_accepted, K = len(d)):
    prompt_len - 1 <= a < len(tokens); 0 <= r <= K; the accepted drafts are
    the tokens that follow the anchor, ``tokens[a+1 : a+1+r] == d[:r]``
    (compared where the sequence still has tokens: a request that stops on
    eos or max_tokens drops the rest of its last block); at temperature 0
    and r < K the token after them is the target's correction,
    ``tokens[a+1+r] != d[r]`` (when that position exists); K >= 1. Between
    blocks: anchors strictly increase and the next anchor is
    ``a + r + 1 + g`` with g the next block's ``num_plain_steps`` (each plain
    step adds the target's one token), except across a break marked in
    ``events``.
    """
    errors: list[str] = []
    for i, block in enumerate(record.blocks):
        errors += [f"blocks[{i}]: {e}" for e in _block_errors(record, block)]
    breaks = {event["anchor_before"] for event in record.events}
    for i, (prev, block) in enumerate(zip(record.blocks, record.blocks[1:]), start=1):
        if block.anchor <= prev.anchor:
            errors.append(f"blocks[{i}]: anchor {block.anchor} does not exceed previous anchor {prev.anchor}")
        elif prev.anchor not in breaks and block.anchor != prev.anchor + prev.num_accepted + 1 + block.num_plain_steps:
            errors.append(
                f"blocks[{i}]: anchor {block.anchor} != previous anchor + r + 1 + num_plain_steps = "
                f"{prev.anchor} + {prev.num_accepted} + 1 + {block.num_plain_steps}"
            )
    return errors


def _block_errors(record: SequenceRecord, block: BlockRecord) -> list[str]:
    """Violations within one block (see ``check_fidelity``)."""
    tokens, a, r, draft = record.tokens, block.anchor, block.num_accepted, block.draft_tokens
    if not (record.prompt_len - 1 <= a < len(tokens)):
        return [f"anchor {a} outside [prompt_len - 1, len(tokens)) = [{record.prompt_len - 1}, {len(tokens)})"]
    if not draft:
        return ["no draft tokens: a block drafts at least one"]
    if block.num_plain_steps < 0:
        return [f"num_plain_steps {block.num_plain_steps} is negative"]
    if not (0 <= r <= len(draft)):
        return [f"num_accepted {r} outside 0..K={len(draft)}"]
    errors = []
    accepted = tokens[a + 1 : a + 1 + r]  # shorter than r only when the sequence ended
    if accepted != draft[: len(accepted)]:
        errors.append(f"accepted tokens {list(accepted)} != draft_tokens[:{r}] {list(draft[: len(accepted)])}")
    if record.temperature == 0 and r < len(draft) and a + 1 + r < len(tokens):
        if tokens[a + 1 + r] == draft[r]:
            errors.append(f"greedy: token after {r} accepted equals the rejected draft token {draft[r]}")
    return errors
