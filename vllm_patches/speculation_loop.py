"""The speculation policy loop in vLLM's API server (started by endpoint.OnlineOPDService).

From the service's first worker status on (before it the serving drafter's checkpoint,
and with it the manifest's acceptance, is unknown), every ``interval_s`` seconds and
right after each drafter reload (``wake``), it:

1. reads the engine core's speculation status (vllm_patches/speculation.py: step
   costs by (b, K), acceptance counts, the schedule serving, exploration);
2. estimates the serving drafter's per-position acceptance a_k from the blocks
   verified since that version started serving, else its manifest (a live
   check's or the gate's tau, `online-opd eval --record`'s served acceptance:
   online_opd/speculation/acceptance.py ``estimate_acceptance``);
3. decides the schedule (online_opd/speculation/policy.py) and, when it differs
   from the one serving, applies it through the engine core's
   ``online_opd_set_speculation`` and logs the change with the figures behind it;
   with it the exploration share: ``explore_share_unmeasured`` while the
   serving version's acceptance is not measured live yet (a fresh server, and
   after each reload until ``min_drafts`` blocks were verified), else
   ``explore_share`` (both 1% by default: raised to 5%, a server with the ngram
   fallback learnt within a minute of c=1 traffic that speculating paid, but a
   fresh server without it served 0.84x of plain vLLM at c=1 instead of 0.96x
   while it explored, README figures);
4. compares, over the steady steps of the last interval, the measured output
   tokens per second with the cost model's prediction for the same steps.

With ``costs_file`` set (``serve.policy_costs_file``), the cost model reads the live
table completed with the one an earlier server saved for the same setup
(online_opd/speculation/cost_store.py, ``costs.with_prior``: a stored bucket counts as
at most ``stored_cost_steps`` steps, so live steps take over), and the loop saves the
merged table every ``costs_save_s`` seconds while steps are timed, and when the server
stops (endpoint.py's shutdown reads the engine's table once more: ``save_before_shutdown``).

With draft trimming on (``serve.draft_trim``, draft_trim.py) it reads the worker's
outlook before deciding (``online_opd_trim`` through ``collective_rpc``) and sends
it the decision's per-batch-size thresholds when they changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from online_opd.speculation import cost_store
from online_opd.speculation.acceptance import AcceptanceCounts, estimate_acceptance
from online_opd.speculation.costs import CostModel, StepCosts, with_prior
from online_opd.speculation.policy import break_even_taus, compress, decide, expected_tokens
from vllm_patches.speculation import SET_METHOD, STATUS_METHOD

logger = logging.getLogger("online_opd.speculation")


class PolicySettings(BaseModel):
    """API-server side of ``serve.speculation: auto`` (from ``serve.policy_*`` in the config)."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(10.0, gt=0)
    margin: float = Field(0.05, ge=0)
    min_drafts: int = Field(32, ge=1)
    min_steps: int = Field(8, ge=1)
    prior_steps: int = Field(32, ge=0)  # pseudo-steps of the fit a measured bucket is shrunk with (costs.py)
    explore_share: float = Field(0.01, ge=0, le=0.5)
    # while the serving version's acceptance is not measured live (a fresh server, after each reload)
    explore_share_unmeasured: float = Field(0.01, ge=0, le=0.5)
    # serve.draft_trim.enabled: read the worker's trimming outlook and send it thresholds (one worker RPC
    # per update; none without trimming)
    draft_trim: bool = False
    # step costs kept across restarts (cost_store.py): the file, this server's setup, the weight of a
    # stored bucket in live steps, and seconds between saves
    costs_file: str | None = None
    costs_setup: dict[str, Any] | None = None
    stored_cost_steps: int = Field(16, ge=0)
    costs_save_s: float = Field(60.0, gt=0)

    def explore_share_for(self, is_measured: bool) -> float:
        """The exploration share: the configured one once acceptance is measured live, else the higher
        of it and ``explore_share_unmeasured`` (learn sooner whether speculating pays)."""
        return self.explore_share if is_measured else max(self.explore_share, self.explore_share_unmeasured)


def window_rates(before: list[list[float]] | None, after: list[list[float]], model: CostModel,
                 acceptance: list[float]) -> tuple[float | None, float | None]:
    """(measured, predicted) output tokens/s over the steady steps between two status polls."""
    old = {(int(r[0]), int(r[1])): r for r in before or []}
    tokens = seconds = predicted_tokens = predicted_seconds = 0.0
    for row in after:
        b, k = int(row[0]), int(row[1])
        prev = old.get((b, k), [b, k, 0.0, 0, 0.0, 0])
        steps = row[3] - prev[3]
        if steps <= 0:
            continue
        seconds += row[4] - prev[4]
        tokens += row[5] - prev[5]
        t = model.seconds(b, k)
        if t is not None:
            predicted_tokens += steps * b * expected_tokens(acceptance, k)
            predicted_seconds += steps * t
    measured = tokens / seconds if seconds > 0 else None
    predicted = predicted_tokens / predicted_seconds if predicted_seconds > 0 else None
    return measured, predicted


class SpeculationPolicyLoop:
    """Owns the policy task; ``latest`` holds the figures /metrics exposes."""

    def __init__(self, engine_client: Any, settings: PolicySettings,
                 serving: Callable[[], tuple[str | None, str | None]], ready: asyncio.Event | None = None):
        self.engine = engine_client
        self.settings = settings
        self.serving = serving  # () -> (drafter version, checkpoint path) serving now
        # set once ``serving`` can answer (the service's first worker status): the first update waits
        # for it, else it could read no manifest and turn off the starting schedule's speculation
        self.ready = ready
        self.latest: dict | None = None
        self.num_changes = 0
        self._wake = asyncio.Event()
        self._version: str | None = None
        self._version_start = AcceptanceCounts()
        self._last_costs: list[list[float]] | None = None
        self._stored: cost_store.StoredCosts | None = None  # loaded on the first update
        self._merged: StepCosts | None = None  # live + stored, what the last update's cost model read
        self._timed = 0  # the engine's timed steps at the last update
        self._saved = (float("-inf"), -1)  # (monotonic time, timed steps) of the last save

    def wake(self) -> None:
        """Recompute now (after a reload)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Update every ``interval_s`` (or when woken) until cancelled, or until the engine has stopped
        (shutdown, or a dead engine core: the server is going down, so there is nothing left to steer)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.ready is not None:
            await self.ready.wait()
        while True:
            try:
                await self.update()
            except asyncio.CancelledError:
                self._save_costs()
                raise
            except EngineDeadError:
                logger.info("speculation policy stopped: the engine core is gone")
                self._save_costs()
                return
            except Exception:
                logger.exception("speculation policy update failed (the schedule serving stays)")
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def update(self) -> dict | None:
        status = await self.engine.engine_core.call_utility_async(STATUS_METHOD)
        if not status or not status["lookup"]:
            return None  # no engine-core control, or an engine without a dynamic schedule
        version, path = self.serving()
        counts = AcceptanceCounts.from_dict(status["acceptance"])
        if version != self._version:  # a reload: count the new version's blocks from here
            if self._version is not None:
                self._version_start = counts
            self._version = version
        acceptance, source = estimate_acceptance(counts - self._version_start, await _manifest(path),
                                                 max_k=status["max_k"], min_drafts=self.settings.min_drafts)
        costs = await self._merge_costs(status)
        if self._remembers() and time.monotonic() - self._saved[0] >= self.settings.costs_save_s:
            await asyncio.to_thread(self._save_costs)
        model = CostModel(costs, min_steps=self.settings.min_steps, prior_steps=self.settings.prior_steps)
        trim = await self._trim_status() if self.settings.draft_trim else None
        decision = decide(model, acceptance, max_k=status["max_k"], max_batch_size=status["max_batch_size"],
                          current=status["lookup"], margin=self.settings.margin,
                          trim_outlook=trim.get("outlook") if trim is not None else None)
        if trim is not None and decision.thresholds != trim.get("thresholds"):
            trim = await self._trim_status(decision.thresholds) or trim
        share = self.settings.explore_share_for(is_measured=source.startswith("live"))
        if decision.lookup != status["lookup"] or share != status.get("explore_share", share):
            result = await self.engine.engine_core.call_utility_async(
                SET_METHOD, [list(r) for r in decision.schedule], share)
            if not result.get("ok"):
                logger.error("speculation schedule not applied: %s", result.get("error"))
            elif decision.lookup != status["lookup"]:
                self.num_changes += 1
                self._log_change(status, decision, model, acceptance, source)
            if result.get("ok") and share != status.get("explore_share", share):
                logger.info("speculation exploration: %.1f%% of steps (%s)", 100 * share,
                            "acceptance measured live" if source.startswith("live")
                            else "until the serving version's acceptance is measured live")
        measured, predicted = window_rates(self._last_costs, status["costs"], model, acceptance)
        self._last_costs = status["costs"]
        self.latest = {**status, "schedule": decision.schedule, "acceptance_used": acceptance,
                       "acceptance_source": source, "measured_tokens_per_s": measured,
                       "predicted_tokens_per_s": predicted, "num_changes": self.num_changes,
                       "cost_model": model.describe(), "version": version, "draft_trim": trim,
                       "stored_costs": self._stored_summary()}
        return self.latest

    def _remembers(self) -> bool:
        return bool(self.settings.costs_file) and self.settings.costs_setup is not None

    async def _merge_costs(self, status: dict) -> StepCosts:
        """The engine's live table, merged with the stored one (loaded on the first call) when the
        server remembers step costs; kept as what the next save writes."""
        costs = StepCosts.from_rows(status["costs"])
        if self._remembers():
            if self._stored is None:
                self._stored = await asyncio.to_thread(self._load_costs)
            if self._stored.costs is not None:
                costs = with_prior(costs, self._stored.costs, self.settings.stored_cost_steps)
            self._merged, self._timed = costs, status.get("timed_steps", 0)
        return costs

    async def save_before_shutdown(self, timeout_s: float) -> None:
        """The server is stopping: vLLM's signal handling stops the engine without cancelling this
        task, so the steps timed since the last periodic save would be lost. Read the engine's table
        once more (at most ``timeout_s``; the engine may already be going) and store it."""
        if not self._remembers():
            return
        if self._stored is None:  # no update ran yet; file work stays on this thread from here: a
            self._stored = self._load_costs()  # stopping server may have shut its default executor down
        try:
            status = await asyncio.wait_for(self.engine.engine_core.call_utility_async(STATUS_METHOD),
                                            timeout_s)
            if status and status.get("costs") is not None:
                await self._merge_costs(status)
        except Exception as exc:  # a stopping engine: store what the last update read
            logger.info("speculation step costs: the engine did not answer before shutdown (%r); storing "
                        "the table read %s", exc, "at the last update" if self._merged else "(none yet)")
        self._save_costs()

    def _load_costs(self) -> cost_store.StoredCosts:
        stored = cost_store.load(self.settings.costs_file, self.settings.costs_setup)
        if stored.costs is not None:
            logger.info("speculation step costs: %s, saved %s; each counts as at most %d steps until live "
                        "steps replace it", stored.reason, _age(stored.saved_at), self.settings.stored_cost_steps)
        else:
            logger.info("speculation step costs: starting from an empty table (%s)", stored.reason)
        return stored

    def _save_costs(self) -> None:
        """Store the merged table when steps were timed since the last save (cost_store.py); a failure
        is logged, retried after ``costs_save_s``, and serving goes on."""
        if self._merged is None or not self._merged.buckets or self._timed in (0, self._saved[1]):
            return
        self._saved = (time.monotonic(), self._timed)
        try:
            cost_store.save(self.settings.costs_file, self.settings.costs_setup, self._merged)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("speculation step costs not saved to %s: %s", self.settings.costs_file, exc)

    def _stored_summary(self) -> dict | None:
        if self._stored is None:
            return None
        return {"file": self.settings.costs_file, "used": self._stored.costs is not None,
                "buckets": len(self._stored.costs.buckets) if self._stored.costs is not None else 0,
                "reason": self._stored.reason}

    async def _trim_status(self, thresholds: list[float] | None = None) -> dict | None:
        """The worker's draft-trimming figures (draft_trim.py), setting its thresholds when given; None
        when trimming is off. Engine 0's first worker: with data parallelism the others keep theirs."""
        results = await self.engine.collective_rpc("online_opd_trim", args=(thresholds,))
        return next((r for r in results or [] if r is not None), None)

    def _log_change(self, status: dict, decision, model: CostModel, acceptance: list[float],
                    source: str) -> None:
        figures = []
        for first, last, k in decision.schedule:
            plain = model.seconds(first, 0)
            even = break_even_taus(model, first, status["max_k"])
            figures.append(f"b {first}-{last}: K={k} (at b={first}: t(b,0)={_ms(plain)}, "
                           f"t(b,K)={_ms(model.seconds(first, k))}, tau(K)={expected_tokens(acceptance, k):.3f}, "
                           f"break-even tau(K=1..{status['max_k']})={_taus(even)}"
                           + (f", trim r_b={decision.thresholds[first]:.2f}" if decision.thresholds else "") + ")")
        logger.info("speculation schedule %s -> %s%s; acceptance a_k=%s from %s; %s",
                    compress(status["lookup"]), decision.schedule,
                    " (conservative: no step with K > 0 measured yet)" if decision.is_conservative else "",
                    [round(a, 3) for a in acceptance], source, "; ".join(figures))


def _age(saved_at: float | None) -> str:
    return "at an unknown time" if saved_at is None else f"{(time.time() - saved_at) / 60:.0f} min ago"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{1e3 * seconds:.1f}ms"


def _taus(taus: list[float | None]) -> str:
    return "[" + ", ".join("?" if t is None else f"{t:.2f}" for t in taus) + "]"


async def _manifest(path: str | None) -> dict:
    if not path:
        return {}
    from online_opd.models.drafters.checkpoint import read_manifest

    try:
        return await asyncio.to_thread(read_manifest, path)
    except (OSError, ValueError):
        return {}
