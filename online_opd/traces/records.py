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

The verifier as teacher. A block may carry ``BlockRecord.teacher`` (``TeacherTopK``):
the top-k log-probabilities vLLM's verifier computed at each of its K drafted
positions and at the bonus position, which is exactly Draft-OPD's teacher
p_{m,k}; replay then needs no target forward over the drafted positions
(online_opd/opd/replay.py). None (records written before the field existed, or a
request not sampled for it): replay recomputes p.

The target's features. A record may also carry ``SequenceRecord.hidden``
(``TargetHidden``): the auxiliary hidden states the target computed while serving
it, the rows a DFlash drafter reads as its context, for the sequence positions
``start`` .. T - 2 (T = len(tokens); the last token is never fed to the target;
positions below ``start`` came from the prefix cache or fell in a step whose rows
were not kept). With them and every replayed block's teacher, replay runs no
target forward past ``start`` (online_opd/opd/replay.py).

What lives elsewhere: capture (vllm_patches/), storage (online_opd/traces/buffer),
replay of records into training tensors (online_opd/opd/replay.py).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

DRAFTER, NGRAM = "drafter", "ngram"  # BlockRecord.proposer (speculation/hybrid.py uses the same names)
PROPOSERS = (DRAFTER, NGRAM)


@dataclass(frozen=True)
class TeacherTopK:
    """The verifier's top-k next-token log-probabilities on one verified block: Draft-OPD's teacher.

    Row j (j = 0..K_m) is p(. | x_<=anchor, d_1..d_j): rows 0..K_m-1 are the drafted positions
    k = 1..K_m, row K_m the bonus position (the distribution the target's own token after an
    all-accepted block came from; replay does not read it). Values are the log-softmax at temperature
    1 of the target's raw logits as vLLM's verifier computed them, read before sampling (the request's
    temperature, top-p and top-k do not touch them: the teacher is the model, not the sampler), each
    row's k largest in descending order, float32 values (``replay.top_k_logprobs``: finite, <= 0).
    The rest of the vocabulary's mass is not kept; replay spreads it uniformly
    (``replay.teacher_logits``). Built by the capture hook without checks; ``from_dict`` (every read)
    and ``from_tensors`` validate."""

    token_ids: tuple[tuple[int, ...], ...]  # [K_m + 1][k] distinct target-vocabulary ids per row
    logprobs: tuple[tuple[float, ...], ...]  # [K_m + 1][k] log p of those ids, descending

    @property
    def top_k(self) -> int:
        """k, the ids kept per row."""
        return len(self.token_ids[0]) if self.token_ids else 0

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": [list(row) for row in self.token_ids],
                "logprobs": [list(row) for row in self.logprobs]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "teacher") -> "TeacherTopK":
        """Parse a dict from ``to_dict``; ValueError names the bad field. At least one row, every row
        the same k >= 1 (ids and logprobs alike), distinct ids >= 0 per row (replay scatters them),
        finite logprobs <= 0."""
        data = _require_dict(data, where)
        token_ids = _rows(data, "token_ids", where)
        logprobs = _rows(data, "logprobs", where)
        k = len(token_ids[0])
        shape = [k] * len(token_ids)
        if k == 0 or [len(row) for row in token_ids] != shape or [len(row) for row in logprobs] != shape:
            raise ValueError(f"{where}: token_ids and logprobs must be the same [rows][k] shape with k >= 1, "
                             f"got {[len(r) for r in token_ids]} and {[len(r) for r in logprobs]}")
        for j, row in enumerate(token_ids):
            if not all(_is_int(t) and t >= 0 for t in row) or len(set(row)) != k:
                raise ValueError(f"{where}.token_ids[{j}] must be distinct non-negative ints")
        for j, row in enumerate(logprobs):
            # not `v <= 0.0` alone: nan compares False, so it would pass
            if not all(_is_number(v) and -math.inf < v <= 0.0 for v in row):
                raise ValueError(f"{where}.logprobs[{j}] must be finite numbers <= 0, got {list(row)!r}")
        return cls(tuple(tuple(row) for row in token_ids),
                   tuple(tuple(float(v) for v in row) for row in logprobs))

    @classmethod
    def from_tensors(cls, token_ids: Any, logprobs: Any, where: str = "teacher") -> "TeacherTopK":
        """From ``replay.top_k_logprobs``'s [rows, k] int64 ids and float32 log-probabilities (anything with
        ``tolist()``), validated as ``from_dict``. A float32 tensor's values are exact Python floats, so they
        round-trip unchanged through JSON and the buffer's float32 column."""
        return cls.from_dict({"token_ids": token_ids.tolist(), "logprobs": logprobs.tolist()}, where)


HIDDEN_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # TargetHidden.dtype -> bytes per value


@dataclass(frozen=True)
class TargetHidden:
    """The target's auxiliary hidden states at sequence positions ``start`` .. ``start`` + n - 1, as the
    serving engine computed them (vLLM's ``target_hidden_states``: the drafter's target layers
    concatenated, ``width`` = layers x hidden size), row-major raw values of ``dtype`` (the serving
    dtype; bfloat16 on this CPU). The capture keeps finite rows only; ``to_tensor`` checks again."""

    start: int  # first sequence position with a row
    width: int  # values per row
    dtype: str  # one of HIDDEN_DTYPES
    data: bytes  # n x width values

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"hidden.start must be an int >= 0, got {self.start!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"hidden.width must be an int >= 1, got {self.width!r}")
        if self.dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden.dtype must be one of {sorted(HIDDEN_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.data, bytes):
            raise ValueError(f"hidden.data must be bytes, got {type(self.data).__name__}")
        row = self.width * HIDDEN_DTYPES[self.dtype]
        if not self.data or len(self.data) % row:
            raise ValueError(f"hidden.data holds {len(self.data)} bytes: not a positive whole number of "
                             f"{self.width}-value {self.dtype} rows ({row} bytes each)")

    @property
    def num_rows(self) -> int:
        return len(self.data) // (self.width * HIDDEN_DTYPES[self.dtype])

    @property
    def end(self) -> int:
        """One past the last position with a row."""
        return self.start + self.num_rows

    def to_tensor(self):
        """[num_rows, width] torch tensor of ``dtype`` (a copy); ValueError on a non-finite value."""
        import torch

        rows = torch.frombuffer(bytearray(self.data), dtype=getattr(torch, self.dtype)).view(-1, self.width)
        if not bool(rows.isfinite().all()):
            raise ValueError("hidden: non-finite values")
        return rows

    @classmethod
    def from_tensor(cls, start: int, rows) -> "TargetHidden":
        """From a [n, width] torch tensor of a ``HIDDEN_DTYPES`` dtype (copied to the host)."""
        import torch

        dtype = str(rows.dtype).removeprefix("torch.")
        if rows.dim() != 2 or dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden rows must be 2-D of {sorted(HIDDEN_DTYPES)}, got {tuple(rows.shape)} {dtype}")
        host = rows.detach().to("cpu").contiguous()
        raw = host.view(-1).view(torch.uint8).numpy().tobytes()
        return cls(int(start), int(rows.shape[1]), dtype, raw)

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "width": self.width, "dtype": self.dtype,
                "data": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_dict(cls, data: Any, where: str = "record.hidden") -> "TargetHidden":
        """Parse ``to_dict``'s dict (``data`` base64, or raw bytes as the buffer stores it)."""
        data = _require_dict(data, where)
        raw = _field(data, "data", where)
        if isinstance(raw, str):
            try:
                raw = base64.b64decode(raw, validate=True)
            except ValueError as exc:
                raise ValueError(f"{where}.data is not base64: {exc}") from None
        try:
            return cls(_int_field(data, "start", where), _int_field(data, "width", where),
                       _field(data, "dtype", where), raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


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
        data = _require_dict(data, where)
        version = data.get("drafter_version")
        if version is not None and not isinstance(version, str):
            raise ValueError(f"{where}.drafter_version must be a str or null, got {version!r}")
        proposer = data.get("proposer")
        if proposer is not None and proposer not in PROPOSERS:
            raise ValueError(f"{where}.proposer must be one of {PROPOSERS} or null, got {proposer!r}")
        is_pure = data.get("is_context_pure")
        if is_pure is not None and not isinstance(is_pure, bool):
            raise ValueError(f"{where}.is_context_pure must be a bool or null, got {is_pure!r}")
        draft_tokens = _token_tuple(data, "draft_tokens", where)
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
            anchor=_int_field(data, "anchor", where),
            draft_tokens=draft_tokens,
            num_accepted=_int_field(data, "num_accepted", where),
            drafter_version=version,
            is_context_pure=True if is_pure is None else is_pure,
            num_plain_steps=_count_field(data, "num_plain_steps", where),
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

    def __post_init__(self) -> None:
        if self.hidden is not None and self.hidden.end > len(self.tokens) - 1:
            raise ValueError(f"hidden rows reach position {self.hidden.end - 1}; a record of {len(self.tokens)} "
                             f"tokens has features up to position {len(self.tokens) - 2}")

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
        }

    @classmethod
    def from_dict(cls, data: Any) -> "SequenceRecord":
        """Parse a dict from ``to_dict``; ValueError names the bad field."""
        data = _require_dict(data, "record")
        blocks = _field(data, "blocks", "record")
        if not isinstance(blocks, (list, tuple)):
            raise ValueError(f"record.blocks must be a list, got {type(blocks).__name__}")
        return cls(
            record_id=_str_field(data, "record_id"),
            model_id=_str_field(data, "model_id"),
            drafter_version=_str_field(data, "drafter_version"),
            temperature=_float_field(data, "temperature"),
            top_p=_float_field(data, "top_p"),
            top_k=_int_field(data, "top_k", "record"),
            tokens=_token_tuple(data, "tokens", "record"),
            prompt_len=_int_field(data, "prompt_len", "record"),
            blocks=tuple(BlockRecord.from_dict(b, f"record.blocks[{i}]") for i, b in enumerate(blocks)),
            events=_events(data.get("events", ())),
            captured_at=_optional_float(data, "captured_at"),
            replica=_optional_str(data, "replica"),
            hidden=None if data.get("hidden") is None else TargetHidden.from_dict(data["hidden"]),
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


def _require_dict(data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
    return data


def _field(data: dict, name: str, where: str) -> Any:
    if name not in data:
        raise ValueError(f"{where}.{name} is missing")
    return data[name]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rows(data: dict, name: str, where: str) -> list:
    """A non-empty list of lists (a [rows][k] table)."""
    value = _field(data, name, where)
    if not isinstance(value, (list, tuple)) or not value \
            or not all(isinstance(row, (list, tuple)) for row in value):
        raise ValueError(f"{where}.{name} must be a non-empty list of lists")
    return list(value)


def _int_field(data: dict, name: str, where: str) -> int:
    value = _field(data, name, where)
    if not _is_int(value):
        raise ValueError(f"{where}.{name} must be an int, got {value!r}")
    return value


def _count_field(data: dict, name: str, where: str) -> int:
    """An optional non-negative int: 0 when missing or null."""
    value = data.get(name)
    if value is None:
        return 0
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where}.{name} must be a non-negative int or null, got {value!r}")
    return value


def _str_field(data: dict, name: str) -> str:
    value = _field(data, name, "record")
    if not isinstance(value, str):
        raise ValueError(f"record.{name} must be a str, got {value!r}")
    return value


def _float_field(data: dict, name: str) -> float:
    value = _field(data, name, "record")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"record.{name} must be a number, got {value!r}")
    return float(value)


def _optional_float(data: dict, name: str) -> float:
    return _float_field(data, name) if name in data else 0.0


def _optional_str(data: dict, name: str) -> str:
    return "" if data.get(name) is None else _str_field(data, name)


def _token_tuple(data: dict, name: str, where: str) -> tuple[int, ...]:
    value = _field(data, name, where)
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise ValueError(f"{where}.{name} must be a list of non-negative ints")
    return tuple(value)


def _events(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"record.events must be a list, got {type(value).__name__}")
    for i, event in enumerate(value):
        if not isinstance(event, dict) or not _is_int(event.get("anchor_before")):
            raise ValueError(f"record.events[{i}] must be a dict with an int 'anchor_before'")
    return tuple(dict(e) for e in value)


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
