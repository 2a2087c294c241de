"""The target's signal a record may carry, captured from vLLM's own verification so that replay needs
no target forward for it (docs/architecture.md#block-record).

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

The teacher on the plain steps. A teacher-carrying record may also carry
``SequenceRecord.path_teacher`` (``PathTeacher``): the same top-k rows for the
steps that verified no block for it (a plain step, K = 0: the target's one row
per request), at the sequence position whose next token the step sampled. With
the logged blocks' rows that lie on the sequence (``path_rows``) they give the
target's distribution along the record's own tokens, which is all an objective
reading positions k <= r + 1 only needs (LK, target-rollout KL): a record served
mostly without speculation then replays on simulated blocks with no target
forward at all (online_opd/opd/teacher_rows.py ``path_block_teacher``).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

from online_opd.traces.fields import int_field, is_int, is_number, require_dict, required_field, table_field


@dataclass(frozen=True)
class TeacherTopK:
    """The verifier's top-k next-token log-probabilities on one verified block: Draft-OPD's teacher.

    Row j (j = 0..K_m) is p(. | x_<=anchor, d_1..d_j): rows 0..K_m-1 are the drafted positions
    k = 1..K_m, row K_m the bonus position (the distribution the target's own token after an
    all-accepted block came from; replay does not read it). Values are the log-softmax at temperature
    1 of the target's raw logits as vLLM's verifier computed them, read before sampling (the request's
    temperature, top-p and top-k do not touch them: the teacher is the model, not the sampler), each
    row's k largest in descending order, float32 values (``teacher_rows.top_k_logprobs``: finite, <= 0).
    The rest of the vocabulary's mass is not kept; replay spreads it uniformly
    (``teacher_rows.teacher_logits``). Built by the capture hook without checks; ``from_dict`` (every read)
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
        data = require_dict(data, where)
        token_ids = table_field(data, "token_ids", where)
        logprobs = table_field(data, "logprobs", where)
        k = len(token_ids[0])
        shape = [k] * len(token_ids)
        if k == 0 or [len(row) for row in token_ids] != shape or [len(row) for row in logprobs] != shape:
            raise ValueError(f"{where}: token_ids and logprobs must be the same [rows][k] shape with k >= 1, "
                             f"got {[len(r) for r in token_ids]} and {[len(r) for r in logprobs]}")
        for j, row in enumerate(token_ids):
            if not all(is_int(t) and t >= 0 for t in row) or len(set(row)) != k:
                raise ValueError(f"{where}.token_ids[{j}] must be distinct non-negative ints")
        for j, row in enumerate(logprobs):
            # not `v <= 0.0` alone: nan compares False, so it would pass
            if not all(is_number(v) and -math.inf < v <= 0.0 for v in row):
                raise ValueError(f"{where}.logprobs[{j}] must be finite numbers <= 0, got {list(row)!r}")
        return cls(tuple(tuple(row) for row in token_ids),
                   tuple(tuple(float(v) for v in row) for row in logprobs))

    @classmethod
    def from_tensors(cls, token_ids: Any, logprobs: Any, where: str = "teacher") -> "TeacherTopK":
        """From ``teacher_rows.top_k_logprobs``'s [rows, k] int64 ids and float32 log-probabilities (anything with
        ``tolist()``), validated as ``from_dict``. A float32 tensor's values are exact Python floats, so they
        round-trip unchanged through JSON and the buffer's float32 column."""
        return cls.from_dict({"token_ids": token_ids.tolist(), "logprobs": logprobs.tolist()}, where)


@dataclass(frozen=True)
class PathTeacher:
    """The target's top-k next-token log-probabilities at positions of the record's own sequence.

    Row i is p(. | tokens[:positions[i] + 1]), the distribution the target sampled token
    ``positions[i] + 1`` from in a step that verified no block for the request (raw logits at
    temperature 1, as ``TeacherTopK``'s rows). Positions strictly increase; the record bounds them
    (``SequenceRecord``: at most T - 2)."""

    positions: tuple[int, ...]
    rows: TeacherTopK  # [len(positions)][k]

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.rows.token_ids) or not self.positions:
            raise ValueError(f"path_teacher: {len(self.positions)} positions for {len(self.rows.token_ids)} rows "
                             "(one row per position, at least one)")
        if not all(is_int(p) and p >= 0 for p in self.positions) or \
                any(b <= a for a, b in zip(self.positions, self.positions[1:])):
            raise ValueError("path_teacher.positions must be strictly increasing ints >= 0")

    @classmethod
    def from_rows(cls, rows: dict[int, tuple[tuple[int, ...], tuple[float, ...]]]) -> "PathTeacher | None":
        """From ``{position: (ids, logprobs)}`` (``records.path_rows``' shape), in position order; None when
        empty. Not validated (the capture's rows and rows read from records are)."""
        if not rows:
            return None
        positions = sorted(rows)
        return cls(tuple(positions), TeacherTopK(tuple(rows[p][0] for p in positions),
                                                 tuple(rows[p][1] for p in positions)))

    def to_dict(self) -> dict[str, Any]:
        return {"positions": list(self.positions), **self.rows.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str = "record.path_teacher") -> "PathTeacher":
        """Parse ``to_dict``'s dict; ValueError names the bad field."""
        data = require_dict(data, where)
        positions = required_field(data, "positions", where)
        if not isinstance(positions, (list, tuple)):
            raise ValueError(f"{where}.positions must be a list, got {type(positions).__name__}")
        return cls(tuple(positions), TeacherTopK.from_dict(data, where))


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
        data = require_dict(data, where)
        raw = required_field(data, "data", where)
        if isinstance(raw, str):
            try:
                raw = base64.b64decode(raw, validate=True)
            except ValueError as exc:
                raise ValueError(f"{where}.data is not base64: {exc}") from None
        try:
            return cls(int_field(data, "start", where), int_field(data, "width", where),
                       required_field(data, "dtype", where), raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
