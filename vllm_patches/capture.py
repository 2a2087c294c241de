"""Capture of verification outcomes inside the vLLM worker (the model runner).

For every drafted block the engine verifies we record the anchor, the drafted
ids and the verifier's accepted count, on the worker side, where the real ids
are (with async scheduling the scheduler only sees placeholder drafts):

- ``_sample`` (before the rejection sampler runs): snapshot, for the requests we
  track, the anchor (= tokens already computed before this step: the index of
  the last verified token, fed first in this step), the drafted ids of this
  step (``spec_decode_metadata.draft_token_ids``, copied to the host without a
  sync: a non-blocking copy on the compute stream, awaited only when the step's
  output is read) and the per-request draft counts.
- ``sample_tokens`` returns the step's output. Its ``sampled_token_ids`` hold,
  per request, the accepted drafts plus the bonus token (rejected slots
  removed), so ``r = len(sampled) - 1``. With async scheduling the output is an
  ``AsyncModelRunnerOutput`` whose ``get_output()`` vLLM calls later, after its
  own host copy; we read the step there, so the capture adds no device sync.
- ``_update_states`` sees new requests (prompt ids, sampling parameters: the
  sample/opt-out decision is made here), the requests scheduled in the step,
  preemptions and finished requests. A finished request's blocks are joined
  with its prompt and output ids into a SequenceRecord and handed to the buffer
  writer's queue (``submit`` never blocks: when the writer falls behind,
  records are dropped and counted).

Preemptions. Async scheduling may read step S's output after step S+1 was
scheduled, i.e. after a preemption decided there. So each step snapshot
carries the request's preemption count, and the chain break is recorded when
the first block of a later count is appended, after the last one before it.

Drafter versions (records.py). The block verified in step S was drafted when
the request last ran, in S' < S; a reload (``set_version``, an RPC between
steps) may fall between. Each request keeps the (version, context purity) of
its last step and each block takes its drafting step's. The drafter's context
K/V stay in the paged KV cache: after a reload a running request's context is
mixed until a preemption recomputes it, and prefix-cache hits are mixed unless
the endpoint reset the cache with the reload (``is_cache_reset``).

Plain steps. The number of drafted tokens may change per step, down to none
(``num_speculative_tokens_per_batch_size`` with k = 0, or an engine without a
drafter at all): a step that verifies no block for a request (no
``spec_decode_metadata``, or ``num_draft_tokens`` 0 for it) still appends its
one sampled token and counts as a plain step; the next block carries the
count (``BlockRecord.num_plain_steps``), so the chain stays checkable. A request
that never speculated yields a record with its tokens and no blocks: the
trainer simulates blocks on it (online_opd/train/online.py).

Output ids are the tokens the worker sampled, cut where vLLM's scheduler cuts
them (``kept_output_ids``): at ``max_tokens`` or after the first stop token id.
Tokens after a *stop string* (matched by the front end on text) stay in the
record: they are still the target's tokens.
Blocks drafted after the last kept token are dropped.

Proposers. With the ngram fallback (ngram_fallback.py) a block may come from
prompt lookup, not the drafter; ``snapshot_step`` tags it (``BlockRecord.proposer``).

The verifier as teacher (``teacher_top_k`` > 0). For a sampled share of the
captured requests (``teacher_sample_rate``), ``_sample`` also takes the top-k
log-probabilities of the verifier's logits at each verified block's rows:
request i's n_i + 1 rows are consecutive in ``logits`` (vLLM's
``_calc_spec_decode_metadata``), drafted positions 1..n_i then the bonus
position, each conditioned on the drafted prefix before it: exactly the
teacher p_{m,k} of Draft-OPD. They are read before the rejection sampler
(which may scale the logits in place), so they are the raw T = 1
distribution whatever the request's temperature; the block carries them as
``BlockRecord.teacher`` and replay then needs no target forward over the
drafted positions (online_opd/opd/replay.py). Same host copy as the draft ids.
A step that verifies no block for such a request (a plain step: K = 0, or its
prefill) has one logits row for it, the distribution its one token is sampled
from: its top-k is kept too, at the position before that token, and the record
carries them as ``SequenceRecord.path_teacher``. With them an objective that
reads positions k <= r + 1 only replays simulated blocks on records served
without speculation with no target forward (online_opd/traces/target_signal.py).

The target's features (``hidden_sample_rate`` > 0, DFlash drafters): a share of the
teacher-carrying requests also keep the aux hidden states the drafter reads
(``SequenceRecord.hidden``); how they are taken and joined: capture_features.py.

Only one rank captures (tensor-parallel rank 0 of the last pipeline stage).
Nothing here raises into vLLM: errors are logged once and counted. The patches
that call into ``Capture`` from vLLM's model runner: capture_hooks.py.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from online_opd.opd.teacher_rows import top_k_logprobs
from online_opd.traces.records import BlockRecord, SequenceRecord
from online_opd.traces.target_signal import PathTeacher, TeacherTopK
from online_opd.traces.writer import BufferWriter
from vllm_patches import draft_trim, ngram_fallback
from vllm_patches.capture_features import HIDDEN_MAX_BYTES, join_hidden
from vllm_patches.request_checks import OPT_OUT_KEY, read_capture_flag

logger = logging.getLogger("online_opd.capture")



class CaptureSettings(BaseModel):
    """Capture settings handed to engine processes as JSON in ``ONLINE_OPD_CAPTURE``."""

    model_config = ConfigDict(extra="forbid")

    buffer_dir: str
    model_id: str = "unknown"
    drafter_version: str = "unknown"
    sample_rate: float = 1.0
    queue_size: int = 4096
    flush_records: int = 256
    flush_interval_s: float = 5.0
    max_bytes: int | None = None
    max_age_s: float | None = None
    retention_interval_s: float = 0.0
    writer_id: str = ""
    replica: str = ""  # the serving replica's name in records; "" = the writer id
    seed: int | None = None
    teacher_top_k: int = Field(0, ge=0)  # the verifier's top-k log-probabilities per verified row; 0 = off
    teacher_sample_rate: float = Field(1.0, ge=0, le=1)  # share of captured requests whose blocks carry them
    hidden_sample_rate: float = Field(0.0, ge=0, le=1)  # share of those that also keep the target's features

    @model_validator(mode="after")
    def _hidden_needs_the_teacher(self) -> "CaptureSettings":
        if self.hidden_sample_rate > 0 and self.teacher_top_k == 0:
            raise ValueError("hidden_sample_rate > 0 needs teacher_top_k > 0: the target's features only spare "
                             "replay's target forward where the blocks carry the teacher too")
        return self

    def to_env(self) -> str:
        return self.model_dump_json()


def opted_out(sampling_params: Any) -> bool:
    """True when the request asked not to be captured (``vllm_xargs={"online_opd_capture": false}``).

    A value that reads neither yes nor no is refused at admission (request_checks.py); should one
    get here all the same (an engine used without the API server), it counts as an opt-out.
    """
    extra = getattr(sampling_params, "extra_args", None) or {}
    return read_capture_flag(extra.get(OPT_OUT_KEY, True)) is not True


def kept_output_ids(sampled: list[int], max_tokens: int | None, stop_ids: frozenset[int]) -> list[int]:
    """The output ids vLLM returns for a request whose worker sampled ``sampled``.

    vLLM's scheduler appends the sampled ids one at a time and ends the request at
    the first one in ``stop_ids`` (eos unless ignore_eos, and stop_token_ids), which
    it keeps, or once ``max_tokens`` are out (v1/core/sched/utils.py ``check_stop``).
    ``min_tokens`` plays no part there: the sampler masks stop ids until then.
    """
    limit = len(sampled) if max_tokens is None else min(len(sampled), max_tokens)
    for j in range(limit):
        if sampled[j] in stop_ids:
            return sampled[: j + 1]
    return sampled[:limit]


@dataclass
class _Tracked:
    prompt: list[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int | None
    stop_ids: frozenset[int]
    version: str
    is_context_pure: bool  # every drafter K/V the request holds was computed by the serving weights
    outputs: list[int] = field(default_factory=list)
    blocks: list[BlockRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    num_preemptions: int = 0
    drafted_by: tuple[str, bool] = ("", True)  # (version, is pure) of the last step that drafted for it
    verifying: tuple[str, bool] = ("", True)  # the same for the block verified in the current step
    preemptions_at_last_block: int = 0
    num_plain_steps: int = 0  # steps that gave it a token without verifying a block, since its last block
    teacher: bool = False  # its blocks carry the verifier's top-k log-probabilities (TeacherTopK)
    # with ``teacher``: its plain steps' rows, by the position whose next token they sampled (PathTeacher)
    path_rows: dict[int, tuple[tuple[int, ...], tuple[float, ...]]] = field(default_factory=dict)
    hidden: list | None = None  # (positions, rows, host-copy events) per step: the target's features; None = off
    hidden_bytes: int = 0

    def append_block(self, block: _Drafted, ids: list[int], num_accepted: int,
                     teacher: TeacherTopK | None = None) -> None:
        """Append a verified block; mark a break after the previous one if a preemption fell between."""
        if self.blocks and block.num_preemptions != self.preemptions_at_last_block:
            self.events.append({"anchor_before": self.blocks[-1].anchor, "kind": "preemption"})
        self.preemptions_at_last_block = block.num_preemptions
        self.blocks.append(BlockRecord(block.anchor, tuple(ids), num_accepted, drafter_version=block.version,
                                       is_context_pure=block.is_context_pure,
                                       num_plain_steps=self.num_plain_steps, proposer=block.proposer,
                                       num_drafted=block.num_drafted, teacher=teacher))
        self.num_plain_steps = 0


class _Drafted(NamedTuple):
    """One tracked request's block in a step snapshot."""

    anchor: int
    offset: int  # into the step's flat draft ids
    count: int
    version: str  # drafted by
    is_context_pure: bool
    num_preemptions: int  # the request's preemptions when the step ran
    proposer: str  # the drafter, or the ngram fallback (ngram_fallback.py)
    num_drafted: int | None = None  # the drafter's block width when fewer were verified (draft_trim.py)
    teacher_row: int | None = None  # its first row in the step's teacher tensors (count + 1 rows)


class _TopK(NamedTuple):
    """The step's top-k log-probabilities for the teacher-tracked blocks, host copies pending."""

    ids: torch.Tensor  # [rows, k] int64
    logprobs: torch.Tensor  # [rows, k] float32
    ready: tuple[Any, Any]  # device events, or None where the copy is done


@dataclass
class _Step:
    """Drafted blocks of one engine step for the tracked requests, host copy pending."""

    blocks: dict[str, _Drafted]  # req_id -> its block
    draft_ids: torch.Tensor  # flat host tensor (may still be in flight)
    ready: Any  # a device event, or None when the copy is already done
    top_k: _TopK | None = None
    plain: dict[str, int] = field(default_factory=dict)  # req_id -> its row in the top-k (a plain step)

    def drafts(self) -> tuple[dict[str, tuple[_Drafted, list[int], TeacherTopK | None]],
                              dict[str, tuple[tuple[int, ...], tuple[float, ...]]]]:
        """(the blocks with their ids and teacher, the plain steps' finite top-k rows by request)."""
        for event in (self.ready, *(self.top_k.ready if self.top_k is not None else ())):
            if event is not None:
                event.synchronize()
        flat = self.draft_ids.tolist() if self.draft_ids is not None else []
        ids = self.top_k.ids.tolist() if self.top_k is not None else []
        logprobs = self.top_k.logprobs.tolist() if self.top_k is not None else []
        finite = self.top_k.logprobs.isfinite().all(dim=1).tolist() if self.top_k is not None else []
        plain = {rid: (tuple(ids[row]), tuple(logprobs[row])) for rid, row in self.plain.items() if finite[row]}

        def teacher(b: _Drafted) -> TeacherTopK | None:
            if b.teacher_row is None:
                return None
            rows = slice(b.teacher_row, b.teacher_row + b.count + 1)
            if not all(finite[rows]):  # NaN logits: no teacher (a reader would refuse the whole segment)
                return None
            return TeacherTopK(tuple(map(tuple, ids[rows])), tuple(map(tuple, logprobs[rows])))

        return {rid: (b, flat[b.offset:b.offset + b.count], teacher(b)) for rid, b in self.blocks.items()}, plain


class Capture:
    """Per-process capture state shared by the patched model-runner methods."""

    def __init__(self, settings: CaptureSettings):
        self.settings = settings
        self.version = settings.drafter_version
        self._is_cache_pure = True  # every K/V in the prefix cache was computed by `version`
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(settings.seed)
        self._writer: BufferWriter | None = None
        self._errors_logged: set[str] = set()
        self.counters = {"requests_seen": 0, "captured": 0, "dropped": 0, "opted_out": 0,
                         "not_sampled": 0, "blocks": 0, "teacher_blocks": 0, "path_teacher_rows": 0,
                         "hidden_records": 0, "hidden_rows": 0, "hidden_over_limit": 0, "errors": 0}
        self.proposing: list[str] | None = None  # the step's request ids while its drafter proposes

    # -- engine events -------------------------------------------------------------------------
    def on_schedule(self, scheduler_output: Any) -> None:
        """New, preempted, scheduled and finished requests of a step (before vLLM updates its state)."""
        with self._lock:
            for new in scheduler_output.scheduled_new_reqs:
                self._start(new)
            for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
                if (t := self._tracked.get(rid)) is not None:  # recomputed on resume, maybe from the cache
                    t.num_preemptions += 1
                    t.is_context_pure = self._is_cache_pure
            for rid in scheduler_output.num_scheduled_tokens:
                if (t := self._tracked.get(rid)) is not None:
                    t.verifying, t.drafted_by = t.drafted_by, (self.version, t.is_context_pure)
            finished = [rid for rid in scheduler_output.finished_req_ids if rid in self._tracked]
            done = [self._tracked.pop(rid) for rid in finished]
        for t in done:
            self._finish(t)

    def snapshot_step(self, input_batch: Any, metadata: Any, logits: torch.Tensor | None = None) -> _Step | None:
        """Anchors and drafted ids of this step for tracked requests (no device sync); with ``logits``
        (the verifier's, [sum of (drafts + 1) per request, vocab], before the rejection sampler, which may
        change them in place) the top-k log-probabilities of the teacher-tracked requests' rows."""
        with self._lock:
            if not self._tracked:
                return None
            blocks: dict[str, _Drafted] = {}
            plain: dict[str, int] = {}  # teacher-tracked requests without a block: their row in ``rows``
            offset = row = 0  # into the flat draft ids; into the logits rows (n + 1 per request)
            rows: list[int] = []  # logits rows of the teacher-tracked blocks and plain steps
            computed = input_batch.num_computed_tokens_cpu
            for i, (rid, n) in enumerate(zip(input_batch.req_ids, metadata.num_draft_tokens)):
                if n == 0 and logits is not None and (t := self._tracked.get(rid)) is not None and t.teacher:
                    plain[rid] = len(rows)
                    rows.append(row)
                elif n > 0 and (t := self._tracked.get(rid)) is not None:
                    width = draft_trim.drafted_width(rid)
                    teacher_row = None
                    if t.teacher and logits is not None:
                        teacher_row = len(rows)
                        rows.extend(range(row, row + n + 1))  # positions 1..n, then the bonus position
                    blocks[rid] = _Drafted(int(computed[i]), offset, int(n), *t.verifying, t.num_preemptions,
                                           ngram_fallback.proposer_of(rid),
                                           width if width is not None and width > n else None, teacher_row)
                offset += n
                row += n + 1
        if not blocks and not plain:
            return None
        draft_ids, ready = _to_host(metadata.draft_token_ids) if blocks else (None, None)
        top_k = None
        if rows:
            selected = logits if len(rows) == logits.shape[0] else \
                logits[torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)]
            ids, logprobs = top_k_logprobs(selected, self.settings.teacher_top_k)
            (ids, ids_ready), (logprobs, logprobs_ready) = _to_host(ids), _to_host(logprobs)
            top_k = _TopK(ids, logprobs, (ids_ready, logprobs_ready))
        return _Step(blocks, draft_ids, ready, top_k, plain)

    def on_context(self, req_ids: list[str], positions: torch.Tensor, query_start_loc: torch.Tensor,
                   hidden: torch.Tensor) -> None:
        """A step's target features ([tokens, width], the drafter's input; request i's rows
        ``query_start_loc[i]:query_start_loc[i + 1]`` at ``positions``) for the requests keeping them."""
        with self._lock:
            picks = [(i, t) for i, rid in enumerate(req_ids)
                     if (t := self._tracked.get(rid)) is not None and t.hidden is not None]
        if not picks:
            return
        bounds = query_start_loc.tolist()
        row_bytes = hidden.shape[1] * hidden.element_size()
        for i, t in picks:
            lo, hi = bounds[i], bounds[i + 1]
            if hi <= lo:
                continue
            t.hidden_bytes += (hi - lo) * row_bytes
            if t.hidden_bytes > HIDDEN_MAX_BYTES:
                t.hidden = None
                self.counters["hidden_over_limit"] += 1
                continue
            (pos, pos_ready), (rows, rows_ready) = _to_host(positions[lo:hi]), _to_host(hidden[lo:hi])
            t.hidden.append((pos, rows, (pos_ready, rows_ready)))

    def on_output(self, step: _Step | None, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Append a step's sampled tokens and verified blocks to the tracked requests."""
        drafts, plain = step.drafts() if step is not None else ({}, {})
        with self._lock:
            for rid, tokens in zip(req_ids, sampled):
                t = self._tracked.get(rid)
                if t is None or not tokens:
                    continue  # not tracked, or a discarded sample (partial prefill)
                block, ids, teacher = drafts.get(rid, (None, [], None))
                if ids and min(ids) >= 0:  # the drafter ran (ids are real, not padding)
                    t.append_block(block, ids, len(tokens) - 1, teacher)
                else:  # a plain step: K = 0 for this request, or no speculation in the step at all
                    t.num_plain_steps += 1
                    if rid in plain and len(tokens) == 1:  # the row its one token was sampled from
                        t.path_rows[len(t.prompt) + len(t.outputs) - 1] = plain[rid]
                t.outputs.extend(tokens)

    def set_version(self, version: str, is_cache_reset: bool = False) -> int:
        """A new drafter serves from the next step on. The context K/V of the requests in flight
        came from the old weights; ``is_cache_reset``: the caller reset the prefix cache (and
        preempted every running request) before loading, so no old K/V can be reused. Returns how
        many tracked requests were in flight (each records a preemption when it drafts again)."""
        with self._lock:
            self.version = version
            self._is_cache_pure = is_cache_reset
            for t in self._tracked.values():
                t.is_context_pure = False
            return len(self._tracked)

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters, in_flight=len(self._tracked), version=self.version)
        if self._writer is not None:
            writer = self._writer.stats()
            out["writer"] = writer
            out["dropped"] += int(writer.get("dropped", 0))
        return out

    def close(self, timeout: float = 10.0) -> None:
        if self._writer is not None:
            self._writer.close(timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Write the records finished so far now (before a shutdown); True when they are written."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def error(self, where: str, exc: BaseException) -> None:
        """Count an internal error; log its first occurrence per place (never raise into vLLM)."""
        self.counters["errors"] += 1
        if where not in self._errors_logged:
            self._errors_logged.add(where)
            logger.exception("online-opd capture error in %s (further ones are counted only): %s",
                             where, exc)

    # -- internals -------------------------------------------------------------------------------
    def _start(self, new: Any) -> None:
        sp = new.sampling_params
        if sp is None or new.prompt_token_ids is None:
            return  # pooling or embeddings input: nothing to record
        self.counters["requests_seen"] += 1
        if opted_out(sp):
            self.counters["opted_out"] += 1
            return
        if self._rng.random() >= self.settings.sample_rate:
            self.counters["not_sampled"] += 1
            return
        stop = set(sp.stop_token_ids or ())
        if not sp.ignore_eos and getattr(sp, "eos_token_id", None) is not None:
            stop.add(sp.eos_token_id)
        is_cache_hit = int(getattr(new, "num_computed_tokens", 0) or 0) > 0
        teacher = self.settings.teacher_top_k > 0 and self._rng.random() < self.settings.teacher_sample_rate
        hidden = teacher and self.settings.hidden_sample_rate > 0 and \
            self._rng.random() < self.settings.hidden_sample_rate
        self._tracked[new.req_id] = _Tracked(
            prompt=list(new.prompt_token_ids), temperature=float(sp.temperature),
            top_p=float(sp.top_p), top_k=max(int(sp.top_k or 0), 0), max_tokens=sp.max_tokens,
            stop_ids=frozenset(stop), version=self.version,
            is_context_pure=self._is_cache_pure or not is_cache_hit, teacher=teacher, hidden=[] if hidden else None)

    def _finish(self, t: _Tracked) -> None:
        outputs = kept_output_ids(t.outputs, t.max_tokens, t.stop_ids)
        if not outputs:
            return
        tokens = t.prompt + outputs
        blocks = tuple(b for b in t.blocks if b.anchor <= len(tokens) - 2)
        hidden = None
        if t.hidden:
            try:
                hidden = join_hidden(t.hidden, len(tokens) - 1)
            except Exception as exc:
                self.error("join_hidden", exc)
        path_teacher = PathTeacher.from_rows({p: row for p, row in t.path_rows.items() if p <= len(tokens) - 2})
        record = SequenceRecord(
            record_id=uuid.uuid4().hex, model_id=self.settings.model_id,
            drafter_version=blocks[0].drafter_version if blocks else t.version,
            temperature=t.temperature, top_p=t.top_p, top_k=t.top_k, tokens=tuple(tokens),
            prompt_len=len(t.prompt), blocks=blocks, events=tuple(t.events), captured_at=time.time(),
            replica=self.settings.replica or self._get_writer().writer_id, hidden=hidden,
            path_teacher=path_teacher)
        if self._get_writer().submit(record):
            self.counters["captured"] += 1
            self.counters["blocks"] += len(blocks)
            self.counters["teacher_blocks"] += sum(b.teacher is not None for b in blocks)
            self.counters["path_teacher_rows"] += len(path_teacher.positions) if path_teacher is not None else 0
            if hidden is not None:
                self.counters["hidden_records"] += 1
                self.counters["hidden_rows"] += hidden.num_rows

    def _get_writer(self) -> BufferWriter:
        if self._writer is None:  # started lazily: only the capturing process runs a writer thread
            s = self.settings
            self._writer = BufferWriter(
                s.buffer_dir, writer_id=s.writer_id or None,
                maxsize=s.queue_size, flush_records=s.flush_records,
                flush_interval_s=s.flush_interval_s, max_bytes=s.max_bytes, max_age_s=s.max_age_s,
                retention_interval_s=s.retention_interval_s)
        return self._writer


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start a host copy of a small device tensor without waiting for it."""
    if t.device.type == "cpu":
        return t.clone(), None
    host = t.to("cpu", non_blocking=True)  # pinned destination: asynchronous on the compute stream
    event = torch.cuda.Event() if t.device.type == "cuda" else None
    if event is not None:
        event.record()
    else:
        torch.accelerator.synchronize()  # other accelerators: correct first, fast later
    return host, event
