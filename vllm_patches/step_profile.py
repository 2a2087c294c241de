"""Per-step wall times of vLLM's engine, for diagnosis: ``ONLINE_OPD_STEP_PROFILE=<dir>``.

Where does a server spend its time, step by step, and which kind of step costs what? The policy's
cost table (speculation.py) times only steady decode steps; a step that admits a new request (its
prefill, mixed with the others' decodes) is left out, and so is every step of plain vLLM. With the
variable set (``register`` installs this in every vLLM process, last, so that the hooks installed
before it are inside what it times), each process appends JSON lines to a file of its own in the
directory:

- the engine core (``scheduler-<pid>.jsonl``): per step, its wall time from ``Scheduler.schedule``
  entry (or the previous step's end, if later) to the end of ``update_from_output`` (the worker's
  forward, sampling and drafting included), the requests in the step, the tokens scheduled for
  prefills and for decodes, the drafts verified, K (the drafts to make), the output tokens;
- each worker (``worker-<pid>.jsonl``): per step, the seconds of ``execute_model`` (inputs, the
  target's forward, logits), ``sample_tokens`` (sampling, drafting, bookkeeping) and, inside it,
  ``propose_draft_token_ids`` (the drafter).

Every line carries the wall clock (``time.time()``) at the step's end, so that a benchmark can keep
the steps of its timed windows. The cost is a few clock reads and one line written per step (tens of
microseconds against steps of tens of milliseconds here). ``classify`` (engine core and worker alike) names a step
``decode`` (every request decodes: one token plus its drafts), ``prefill`` (every request prefills:
a new request, a resumed one, or a chunk) or ``mixed``.

Nothing here raises into vLLM: errors are logged once and the step goes unrecorded.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("online_opd.step_profile")


def classify(scheduler_output: Any) -> dict[str, Any]:
    """The step's shape from vLLM's ``SchedulerOutput``: requests, prefill and decode tokens, the
    drafts verified, K, and its kind (``decode``, ``prefill``, ``mixed``; ``idle`` without tokens).

    A request prefills in this step when it is new to the worker or is scheduled more tokens than
    one plus the drafts it verifies (a chunk, a resumed request)."""
    sizes = scheduler_output.num_scheduled_tokens or {}
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    prefill_tokens = decode_tokens = prefill_reqs = verified = 0
    for rid, n in sizes.items():
        drafts = len(spec.get(rid, ()))
        verified += drafts
        if rid in new or n > 1 + drafts:
            prefill_tokens, prefill_reqs = prefill_tokens + n, prefill_reqs + 1
        else:
            decode_tokens += n
    b = len(sizes)
    kind = ("idle" if not b else "decode" if not prefill_reqs else "prefill" if prefill_reqs == b
            else "mixed")
    return {"kind": kind, "b": b, "prefill_reqs": prefill_reqs, "prefill_tokens": prefill_tokens,
            "decode_tokens": decode_tokens, "verified": verified,
            "k": int(getattr(scheduler_output, "num_spec_tokens_to_schedule", 0) or 0)}


class StepLog:
    """One process's JSON-lines file, line-buffered (a process killed at shutdown loses nothing)."""

    def __init__(self, path: Path):
        self.path = path
        self.file: Any = None
        self.lock = threading.Lock()
        self.errors = 0

    def add(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self.lock:
            try:
                if self.file is None:
                    self.file = open(self.path, "a", buffering=1)
                self.file.write(line)
            except OSError as exc:
                self.errors += 1
                if self.errors == 1:
                    logger.warning("online-opd step profile: cannot write %s (further errors are not "
                                   "logged): %s", self.path, exc)


_ERRORS_LOGGED: set[str] = set()


def _error(where: str, exc: BaseException) -> None:
    if where not in _ERRORS_LOGGED:
        _ERRORS_LOGGED.add(where)
        logger.exception("online-opd step profile error in %s (further ones are not logged): %s", where, exc)


_INSTALLED: Path | None = None


def install(directory: str | os.PathLike) -> None:
    """Wrap the scheduler's step (engine core) and the model runner's phases (worker), once per process."""
    global _INSTALLED
    if _INSTALLED is not None:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _INSTALLED = directory
    logs: dict[str, StepLog] = {}

    def log(role: str) -> StepLog:  # made on first use: only the process that runs the role writes a file
        if role not in logs:
            logs[role] = StepLog(directory / f"{role}-{os.getpid()}.jsonl")
        return logs[role]

    pending: dict[int, tuple[float, float, dict[str, Any]]] = {}  # id(scheduler output) -> step start
    last_end = [0.0]
    orig_schedule, orig_update = Scheduler.schedule, Scheduler.update_from_output

    def schedule(self, *args, **kwargs):
        start = time.perf_counter()
        out = orig_schedule(self, *args, **kwargs)
        try:
            shape = classify(out)
            if shape["b"]:
                if len(pending) > 64:  # outputs never handed back (an engine error): forget them
                    pending.clear()
                pending[id(out)] = (start, time.perf_counter() - start, shape)
        except Exception as exc:
            _error("schedule", exc)
        return out

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        result = orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        try:
            entry = pending.pop(id(scheduler_output), None)
            if entry is not None:
                start, schedule_s, shape = entry
                end = time.perf_counter()
                sampled = model_runner_output.sampled_token_ids or []
                log("scheduler").add({
                    **shape, "seconds": round(end - max(start, last_end[0]), 6),
                    "schedule_s": round(schedule_s, 6), "output_tokens": sum(len(s) for s in sampled),
                    "time": round(time.time(), 4)})
                last_end[0] = end
        except Exception as exc:
            _error("update_from_output", exc)
        return result

    orig_execute, orig_sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    orig_propose = GPUModelRunner.propose_draft_token_ids
    current: dict[str, Any] = {}  # the worker's step in progress

    def execute_model(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        out = orig_execute(self, scheduler_output, *args, **kwargs)
        try:
            if scheduler_output.total_num_scheduled_tokens:
                current.clear()
                current.update(classify(scheduler_output), execute_s=time.perf_counter() - start, propose_s=0.0)
        except Exception as exc:
            _error("execute_model", exc)
        return out

    def propose_draft_token_ids(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return orig_propose(self, *args, **kwargs)
        finally:
            if current:
                current["propose_s"] += time.perf_counter() - start

    def sample_tokens(self, *args, **kwargs):
        start = time.perf_counter()
        out = orig_sample(self, *args, **kwargs)
        try:
            if current:
                record = {**current, "sample_s": time.perf_counter() - start, "time": round(time.time(), 4)}
                current.clear()
                for key in ("execute_s", "propose_s", "sample_s"):
                    record[key] = round(record[key], 6)
                log("worker").add(record)
        except Exception as exc:
            _error("sample_tokens", exc)
        return out

    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output
    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = execute_model, sample_tokens
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    logger.info("online-opd step profile: per-step times into %s", directory)


def read(directory: str | os.PathLike, role: str) -> list[dict[str, Any]]:
    """Every ``role`` (``scheduler`` or ``worker``) record in the directory, by time (torn last lines of a
    killed process are skipped)."""
    records = []
    for path in sorted(Path(directory).glob(f"{role}-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(records, key=lambda r: r.get("time", 0.0))


def summarise(records: list[dict[str, Any]], keys: tuple[str, ...] = ("seconds",)) -> dict[str, Any]:
    """Per kind of step: count, and the sum and mean of each timed key, the mean requests, prefill
    tokens and output tokens."""
    out: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in records}):
        rows = [r for r in records if r["kind"] == kind]
        n = len(rows)
        entry: dict[str, Any] = {"steps": n}
        for key in keys:
            total = sum(r.get(key, 0.0) for r in rows)
            entry[f"{key}_total"], entry[f"{key}_mean"] = round(total, 4), round(total / n, 6)
        for key in ("b", "prefill_tokens", "output_tokens", "verified"):
            if key in rows[0]:
                entry[f"{key}_mean"] = round(sum(r[key] for r in rows) / n, 3)
        out[kind] = entry
    return out


def decode_by_shape(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decode steps by (requests, K drafted): steps, mean seconds and output tokens, and seconds per
    output token: the cost table's view (speculation.py), for any server, plain vLLM's too."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == "decode":
            groups.setdefault((r["b"], r["k"]), []).append(r)
    out = []
    for (b, k), rows in sorted(groups.items()):
        seconds, tokens = sum(r["seconds"] for r in rows), sum(r["output_tokens"] for r in rows)
        out.append({"b": b, "k": k, "steps": len(rows), "seconds_mean": round(seconds / len(rows), 6),
                    "output_tokens_mean": round(tokens / len(rows), 3),
                    "seconds_per_output_token": round(seconds / tokens, 6) if tokens else None})
    return out
