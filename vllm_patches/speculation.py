"""The speculation schedule inside vLLM's engine core: swapped at runtime, step costs, exploration.

vLLM 0.32's scheduler reads ``self.dynamic_sd_lookup`` (a dense list: batch size
-> K, built from ``speculative_config.num_speculative_tokens_per_batch_size``) at
every ``schedule()`` and hands the K to the worker (``num_spec_tokens_to_schedule``).
``online-opd serve --speculation auto`` starts the engine with a schedule (so the
lookup exists) and sets ``ONLINE_OPD_SPECULATION``; then ``install`` (called by
``register`` in the engine-core process, before the scheduler is built):

- adds two methods to ``EngineCore``, reached from the API server through the
  engine client's utility call, the path ``reset_prefix_cache`` takes
  (``engine_client.engine_core.call_utility_async(name, *args)``; the engine core
  runs it between steps): ``online_opd_set_speculation(schedule)`` builds the dense
  lookup with vLLM's own ``build_dynamic_sd_schedule_lookup`` and replaces the
  scheduler's list in one assignment; ``online_opd_speculation_status()``.
- wraps ``Scheduler.schedule`` and ``update_from_output`` to time steps (from
  schedule() entry, or the previous step's end if later, to the end of
  update_from_output: the step's wall time, the worker's forward, drafting and
  sampling included) and bucket them by (b = requests in the step, K), with
  the draft tokens verified (n). Only steady decode steps are timed: no
  prefill, and every request verifies exactly K drafts while K more are
  drafted (the first and last step of a change of K are left out); with draft
  trimming on (``time_trimmed_steps``, draft_trim.py) every request verifies at
  most K, fewer where its block was trimmed, and the bucket's mean n tells the
  cost model what was verified. From the same two calls it counts, per verified block, its
  length and accepted count (``AcceptanceCounts``). The steps not timed are summed by
  whether they drafted (``untimed`` in the status: steps, seconds, output tokens):
  the policy's predictions do not cover them.
- skips, after a step that drafted nothing (K = 0), the engine core's request
  for the step's drafts (``post_step``: a round trip to the worker that would
  return empty lists; each request's drafts were already cleared when it was
  scheduled);
- explores: when the policy's schedule says K = 0, the cost of speculating is
  never measured, and where it says K > 0, the cost of a plain step stops being
  measured (its bucket then keeps a cost from another time: in one domain-shift
  run t(4-7, 0) stayed 0.228 s, measured only while the schedule served K = 0
  there, against 0.127 s measured through another run, and the two runs served
  b = 4 at K = 3 and K = 0). So a bounded share of steps (``explore_share``)
  runs in short bursts of ``explore_steps`` steps at K in 0..K_max, cycled (0
  left out while the schedule is K = 0 everywhere), for every batch size. The
  policy loop may change the share with the schedule (a higher one
  while the serving version's acceptance is not measured yet); each share is
  budgeted over the steps since it was set. Output stays lossless (the target verifies); the burst's steady steps
  feed the cost table and the acceptance counts.

K = 0 steps still run the drafter's context pass (DFlash and EAGLE proposers keep
their K/V for every token: llm_base_proposer.py returns before sampling when
``num_speculative_tokens == 0``; for DFlash only the context K/V are computed,
dflash_context.py), so turning K back on drafts from a complete context.
Nothing here raises into vLLM: errors are logged once and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from online_opd.speculation.acceptance import AcceptanceCounts
from online_opd.speculation.costs import StepCosts
from vllm_patches import SPECULATION_ENV, dflash_context, settings_from_env

logger = logging.getLogger("online_opd.speculation")

SET_METHOD = "online_opd_set_speculation"
STATUS_METHOD = "online_opd_speculation_status"


class SpeculationSettings(BaseModel):
    """Engine-side settings, handed over as JSON in ``ONLINE_OPD_SPECULATION``."""

    model_config = ConfigDict(extra="forbid")

    explore_share: float = Field(0.01, ge=0, le=0.5)
    explore_steps: int = Field(3, ge=2)
    cost_alpha: float = Field(0.05, gt=0, le=1)  # the step-cost table's speed factor (costs.py)
    cost_relative_alpha: float = Field(0.01, gt=0, le=1)  # its buckets' relative costs
    # draft trimming on (draft_trim.py): also time decode steps whose requests verify fewer than K drafts
    time_trimmed_steps: bool = False

    def to_env(self) -> str:
        return self.model_dump_json()


class SpeculationControl:
    """Per-scheduler state: the policy's lookup, exploration bursts, step costs, acceptance counts."""

    def __init__(self, settings: SpeculationSettings, lookup: list[int], max_k: int):
        self.settings = settings
        self.max_k = max_k
        self.policy_lookup = list(lookup)
        self.costs = StepCosts(settings.cost_alpha, settings.cost_relative_alpha)
        self.acceptance = AcceptanceCounts()
        self.counters = {"steps": 0, "explored_steps": 0, "timed_steps": 0, "errors": 0}
        # steps the cost table does not time (prefill chunks, mixed, first steps after a K change), by
        # whether they drafted: [steps, seconds, output tokens]. The policy never sees their cost.
        self.untimed = {"plain": [0, 0.0, 0], "drafting": [0, 0.0, 0]}
        self.explore_share = settings.explore_share  # the policy loop raises it while acceptance is unmeasured
        self._budget_from = (0, 0)  # (steps, explored steps) when the share last changed
        self._explore_k: int | None = None  # K of the burst in progress
        self._explore_left = 0
        self._next_k = max_k
        self._pending: dict[int, tuple[float, int, int, bool]] = {}  # id(output) -> (start, b, K, steady)
        self._last_end = 0.0
        self.last_k: int | None = None  # K drafted by the last step that ran

    def lookup_for_step(self) -> list[int] | None:
        """The lookup the next schedule() uses: the policy's, or a burst's K for every batch size
        (None: an engine without a schedule, timed only)."""
        if not self.policy_lookup:
            return None
        if self._explore_k is None and self._is_exploration_due():
            if self._next_k == 0 and not any(self.policy_lookup):
                self._next_k = 1  # K = 0 is what the schedule serves everywhere: measured already
            self._explore_k, self._explore_left = self._next_k, self.settings.explore_steps
            self._next_k = (self._next_k + 1) % (self.max_k + 1)  # cycle K_max, 0, 1, ..., K_max - 1
        if self._explore_k is None:
            return self.policy_lookup
        return [0] + [self._explore_k] * (len(self.policy_lookup) - 1)

    def set_explore_share(self, share: float) -> None:
        """A new exploration share, budgeted over the steps from now on (not over all steps: a share
        lowered after a high one would otherwise stop exploring until the total caught up)."""
        if share != self.explore_share:
            self.explore_share = share
            self._budget_from = (self.counters["steps"], self.counters["explored_steps"])

    def _is_exploration_due(self) -> bool:
        s, c, share = self.settings, self.counters, self.explore_share
        if share <= 0 or self.max_k <= 0:
            return False
        steps, explored = c["steps"] - self._budget_from[0], c["explored_steps"] - self._budget_from[1]
        # a burst starts only if, counted in, explored steps stay within the share of the steps
        return explored + s.explore_steps <= share * (steps + s.explore_steps)

    def on_scheduled(self, out: Any, start: float) -> None:
        sizes = out.num_scheduled_tokens
        if not sizes:
            return
        self.counters["steps"] += 1
        if self._explore_k is not None:
            self.counters["explored_steps"] += 1
            self._explore_left -= 1
            if self._explore_left <= 0:
                self._explore_k = None
        k = self.last_k = out.num_spec_tokens_to_schedule
        spec = out.scheduled_spec_decode_tokens
        verified = {rid: len(spec.get(rid, ())) for rid in sizes}
        whole = not self.settings.time_trimmed_steps
        is_steady = not out.scheduled_new_reqs and all(
            n == 1 + verified[rid] and (verified[rid] == k if whole else verified[rid] <= k)
            for rid, n in sizes.items())
        if len(self._pending) > 64:  # outputs never handed back (an engine error): forget them
            self._pending.clear()
        self._pending[id(out)] = (start, len(sizes), k, is_steady, sum(verified.values()))

    def on_output(self, out: Any, model_output: Any, end: float) -> None:
        pending = self._pending.pop(id(out), None)
        if pending is None:
            return
        start, b, k, is_steady, num_drafted = pending
        seconds, self._last_end = end - max(start, self._last_end), end
        index, sampled = model_output.req_id_to_index, model_output.sampled_token_ids
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            if drafts and i is not None and i < len(sampled) and len(sampled[i]) > 0:
                self.acceptance.observe(len(drafts), len(sampled[i]) - 1)
        tokens = sum(len(sampled[i]) for i in index.values() if i < len(sampled))
        if is_steady:
            self.counters["timed_steps"] += 1
            self.costs.observe(b, k, seconds, tokens, num_drafted)
        else:
            kind = self.untimed["drafting" if k > 0 else "plain"]
            kind[0], kind[1], kind[2] = kind[0] + 1, kind[1] + seconds, kind[2] + tokens

    def status(self, serving_lookup: list[int] | None) -> dict:
        return {"max_k": self.max_k, "max_batch_size": max(len(self.policy_lookup) - 1, 0),
                "lookup": list(self.policy_lookup), "serving_lookup": list(serving_lookup or []),
                "exploring_k": self._explore_k, "costs": self.costs.to_rows(),
                "cost_speed": self.costs.speed,
                "acceptance": self.acceptance.to_dict(), "settings": self.settings.model_dump(),
                "explore_share": self.explore_share, "untimed": {k: list(v) for k, v in self.untimed.items()},
                **self.counters}


_ERRORS_LOGGED: set[str] = set()


def _error(control: SpeculationControl | None, where: str, exc: BaseException) -> None:
    if control is not None:
        control.counters["errors"] += 1
    if where not in _ERRORS_LOGGED:
        _ERRORS_LOGGED.add(where)
        logger.exception("online-opd speculation error in %s (further ones are counted only): %s", where, exc)


def _control(scheduler: Any, settings: SpeculationSettings) -> SpeculationControl:
    """The scheduler's control, made on first use (an engine without a dynamic schedule is only timed)."""
    control = getattr(scheduler, "_online_opd_speculation", None)
    if control is None:
        control = scheduler._online_opd_speculation = SpeculationControl(
            settings, getattr(scheduler, "dynamic_sd_lookup", None) or [], scheduler.num_spec_tokens)
    return control


def set_speculation(engine_core: Any, schedule: list, explore_share: float | None = None) -> dict:
    """``EngineCore.online_opd_set_speculation``: the new schedule (and, if given, exploration share)
    serve from the next step on."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    scheduler = engine_core.scheduler
    control = _control(scheduler, _INSTALLED or SpeculationSettings())
    if not control.policy_lookup:
        return {"ok": False, "error": "this engine has no dynamic speculation schedule (serve --speculation auto)"}
    if explore_share is not None and not (isinstance(explore_share, (int, float)) and 0 <= explore_share <= 0.5):
        return {"ok": False, "error": f"explore_share {explore_share!r} refused: a share in [0, 0.5]"}
    try:
        lookup = build_dynamic_sd_schedule_lookup(
            [tuple(r) for r in schedule], vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
            vllm_num_speculative_tokens=scheduler.num_spec_tokens)
    except (ValueError, TypeError) as exc:
        return {"ok": False, "error": f"schedule {schedule!r} refused: {exc}"}
    control.policy_lookup = lookup
    if explore_share is not None:
        control.set_explore_share(float(explore_share))
    if control._explore_k is None:
        scheduler.dynamic_sd_lookup = lookup  # one assignment: schedule() reads either list whole
    return {"ok": True, "lookup": lookup, "explore_share": control.explore_share}


def speculation_status(engine_core: Any) -> dict | None:
    """``EngineCore.online_opd_speculation_status``: schedule, step costs, acceptance, exploration."""
    scheduler = engine_core.scheduler
    return _control(scheduler, _INSTALLED or SpeculationSettings()).status(scheduler.dynamic_sd_lookup)


_INSTALLED: SpeculationSettings | None = None


def install(settings: SpeculationSettings) -> None:
    """Wrap the scheduler and add the engine-core methods, once per process."""
    global _INSTALLED
    if _INSTALLED is not None:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    _INSTALLED = settings
    orig_schedule, orig_update = Scheduler.schedule, Scheduler.update_from_output

    def schedule(self, *args, **kwargs):
        control = None
        try:
            control = _control(self, settings)
            lookup = control.lookup_for_step()
            if lookup is not None:
                self.dynamic_sd_lookup = lookup
        except Exception as exc:
            _error(control, "schedule", exc)
        start = time.perf_counter()
        out = orig_schedule(self, *args, **kwargs)
        if control is not None:
            try:
                control.on_scheduled(out, start)
            except Exception as exc:
                _error(control, "on_scheduled", exc)
        return out

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        result = orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        control = getattr(self, "_online_opd_speculation", None)
        if control is not None:
            try:
                control.on_output(scheduler_output, model_runner_output, time.perf_counter())
            except Exception as exc:
                _error(control, "update_from_output", exc)
        return result

    orig_post_step = EngineCore.post_step

    def post_step(self, model_executed: bool) -> None:
        control = getattr(self.scheduler, "_online_opd_speculation", None)
        if control is not None and control.policy_lookup and control.last_k == 0:
            return  # nothing was drafted: taking the (empty) drafts would only cost a worker round trip
        orig_post_step(self, model_executed)

    Scheduler.schedule = schedule
    Scheduler.update_from_output = update_from_output
    EngineCore.post_step = post_step
    setattr(EngineCore, SET_METHOD, set_speculation)  # methods: the engine core is the first argument
    setattr(EngineCore, STATUS_METHOD, speculation_status)
    dflash_context.install()
    logger.info("online-opd speculation control installed: exploration %.1f%% of steps in bursts of %d",
                100 * settings.explore_share, settings.explore_steps)


def install_from_env() -> None:
    settings = settings_from_env(SPECULATION_ENV, SpeculationSettings, "speculation")
    if settings is not None:
        install(settings)
