"""The online trainer: tail the trace buffer, replay recent records with Draft-OPD, gate, publish.

``OnlineTrainer`` is the whole trainer as plain Python; serve/trainer_actor.py runs it as a Ray actor (this
module imports neither ray nor vllm).

Data and sampling (the replay ratio): train/record_pools.py (``RecordPools``, held as ``pools``). Each
sampled record contributes up to ``trainer.anchors_per_sequence`` random blocks, replayed in one packed pass
(replay.py) and scored with ``trainer.objective`` exactly as the offline ``opd_step_fn`` does.

Blocks of any length (``opd.plan_replay``): logged blocks of 1..K tokens replay as they are; a record served
mostly without speculation (coverage below ``online.simulate_below_coverage``) replays, at any temperature,
on the blocks the *current* drafter would have drafted over it (``records_simulated``).

Objective. ``trainer.objective``, or with ``auto`` the objective schedule's choice
(opd/objective_schedule.py): every polled record's verified blocks feed its window of position-1 acceptance,
and each step asks it which of ``trainer.auto.weak`` / ``strong`` to train with (``objective_name``); its
state (window, switches) is saved with the trainer's. A switch to ``strong`` is a trial: ``gate`` reports
each outcome to the schedule (``gate_outcome``), which may end it, and the trainer then restarts from the
serving version.

Schedule. AdamW (train/optim.py) with a linear warm-up over ``round(trainer.warmup_ratio *
trainer.num_steps)`` steps, then a constant ``trainer.lr``: an endless run has no horizon to decay over,
and a decayed rate would stop the drafter from following drift in the traffic; the gate guards the servers.

Gate and publish (train/gating.py, ``GateAndPublish``). Every ``gate.every_steps`` steps the moving average of
the trained weights (``online.ema_decay``) is gated against the registry's current drafter on the held-out pool,
published, and promoted or rejected; training goes on from the trained weights either way. When the registry's
CURRENT is anything but the version the weights descend from (``trained_from``), because the reloader rolled
back or someone promoted by hand, ``sync_with_registry`` (at start-up and before every buffer poll) reloads the
drafter from CURRENT with a fresh optimizer, schedule and average.

State. ``save`` writes the drafter, its average, AdamW, schedule, step, RNG, the buffer cursor and the counters to
``state_dir`` (train/state.py: tmp + fsync + rename). A new ``OnlineTrainer`` on the same ``state_dir``
resumes from it: the weights come from the state, not from the registry, and the pools are rebuilt up to the
saved cursor (``RecordPools.resume``: those records count as trained on). The counters go on; ``max_steps``
counts resumed steps too.

Data-parallel (``trainer.num_workers > 1``): this trainer is rank 0, the one that decides;
train/online_dp.py runs its loop and the replicas of the other ranks. ``online.num_threads`` bounds the
process's intra-op threads (the engine keeps the other cores).

Sharing the engine's cores. After each step the trainer rests so that it computes ``online.duty_cycle`` of
its wall time while the engines serve, and ``online.idle_duty_cycle`` once they have been idle for
``online.idle_after_s`` (``EngineLoad``: each serving replica's trainer process reports its server's load,
read from /metrics, through ``note_engine_load``). No report, or an unknown load, counts as serving.
``duty_cycle`` 0: no step starts while the engines serve (``may_step``; status "waiting_for_idle_engines"),
the buffer is still tailed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from online_opd.config import OnlineOPDConfig
from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.models.target_model import TargetModel
from online_opd.opd.losses import LOSSES
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.records import SequenceRecord
from online_opd.train.ema import WeightAverage
from online_opd.train.gating import GateAndPublish
from online_opd.train.load import EngineLoad
from online_opd.train.online_dp import new_optimizer, replay_update
from online_opd.train.opd import objective_fn, objective_schedule, plan_replay, replayable_blocks
from online_opd.train.record_pools import RecordPools
from online_opd.train.state import STATE_FILE, load_state, save_state

logger = logging.getLogger(__name__)

_COUNTERS = ("steps", "replayed_tokens", "trained_tokens", "records_seen", "records_invalid", "records_unusable",
             "records_simulated", "blocks_widened", "gates", "promotions", "rejections", "errors", "resyncs")


class OnlineTrainer(GateAndPublish):
    """Draft-OPD on live traffic: ``poll`` the buffer, ``step``, ``gate`` and publish, ``save``; or ``run``.
    The gate, the registry and restarts from a served version are train/gating.py's ``GateAndPublish``.

    Not thread-safe except ``stats``, which another thread may call while ``run`` trains.
    """

    def __init__(self, cfg: OnlineOPDConfig, *, target_path: Path, buffer_dir: Path | str, registry_dir: Path,
                 state_dir: Path) -> None:
        if cfg.trainer.objective not in (*LOSSES, "auto"):
            raise ValueError(f"online training replays recorded blocks: trainer.objective must be one of "
                             f"{sorted(LOSSES)} or auto, got {cfg.trainer.objective!r} (SFT is the offline "
                             "bootstrap)")
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        torch.set_num_threads(cfg.online.num_threads)
        self.device = torch.device(cfg.online.device)
        self.target = TargetModel.from_pretrained(target_path, dtype=torch.float32)
        self.target.model.to(self.device)
        self.registry = DrafterRegistry(registry_dir, keep_unpromoted=cfg.serve.registry_keep_unpromoted)
        current = self.registry.current()
        if current is None:
            raise RuntimeError(f"registry {registry_dir} has no current drafter to train: "
                               "bootstrap one and promote it first")
        self.drafter = self._load_drafter(current.path)
        self.block_size = self.drafter.cfg.block_size
        tcfg = cfg.trainer
        self.optimizer, self.scheduler = self._new_optimizer()
        self.average = WeightAverage(self.drafter, cfg.online.ema_decay)
        self.schedule = objective_schedule(tcfg)  # None: the fixed trainer.objective
        self._objectives: dict[str, Callable] = {}
        self._logged_switches = 0
        self._weights_replaced = False
        self.generator = torch.Generator().manual_seed(tcfg.seed)
        self.pools = RecordPools(cfg, buffer_dir)
        self.step_count = 0
        self._lock = threading.Lock()
        self.load = EngineLoad(cfg.online.idle_after_s)
        self._saved_step = -1
        self._gate_due = False
        self._stats: dict[str, Any] = {
            "status": "waiting_for_data", **{k: 0 for k in _COUNTERS}, "loss": None, "loss_accepted": None,
            "loss_rejected": None, "lr": None, "grad_norm": None, "step_seconds": None, "train_seconds": 0.0,
            "rest_seconds": 0.0, "gate_seconds": 0.0, "gates_deferred": 0, "last_gate": None, "last_published": None, "last_error": None,
            "trained_from": current.version, "objective": self.schedule.current if self.schedule else tcfg.objective,
            "objective_switches": 0, "first_position_acceptance": None,
        }
        self._resume()
        self.sync_with_registry()

    # ---- data -------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Read new buffer records into the pools (``RecordPools.poll``) and add them to the counters;
        returns how many were kept (train + held-out). With ``objective: auto`` their verified blocks
        feed the objective schedule (held-out ones too: they are live traffic as well)."""
        kept, counts = self.pools.poll(self.block_size)
        if self.schedule is not None:
            for record in kept:
                self.schedule.observe(b.num_accepted for b in replayable_blocks(record, self.block_size))
        with self._lock:
            for key, value in counts.items():
                self._stats[key] += value
            if self.schedule is not None:
                self._stats["first_position_acceptance"] = self.schedule.first_position_acceptance()
        return len(kept)

    def objective_name(self) -> str:
        """The objective of the next step: ``trainer.objective``, or the schedule's choice for it (which
        may switch here; asking again before the step changes nothing)."""
        if self.schedule is None:
            return self.cfg.trainer.objective
        name = self.schedule.choose(self.step_count + 1)
        with self._lock:
            self._stats["objective"] = name
            self._stats["objective_switches"] = len(self.schedule.switches)
        for switch in self.schedule.switches[self._logged_switches:]:  # each once (rank 0 asks twice a step)
            logger.info("online trainer: objective %s -> %s at step %d (position-1 acceptance %.3f over %d "
                        "blocks; by %s)", switch.before, switch.after, switch.step, switch.first_position_acceptance,
                        switch.num_blocks, switch.reason)
        self._logged_switches = len(self.schedule.switches)
        return name

    def objective(self, name: str) -> Callable:
        """Objective ``name`` with the trainer section's hyper-parameters (``opd.objective_fn``), cached."""
        if name not in self._objectives:
            self._objectives[name] = objective_fn(self.cfg.trainer, name)
        return self._objectives[name]

    def replay_plan(self, record: SequenceRecord) -> SequenceRecord | None:
        """The record as this step replays it (``opd.plan_replay``); counts simulated ones."""
        planned, is_simulated = plan_replay(self.target, self.drafter, record,
                                            self.cfg.online.simulate_below_coverage,
                                            captured_features=self.cfg.trainer.captured_teacher)
        if is_simulated:
            with self._lock:
                self._stats["records_simulated"] += 1
        return planned

    # ---- training ---------------------------------------------------------------------------------

    def step(self) -> dict[str, Any] | None:
        """One optimizer step on sampled records; None (nothing done) below ``online.min_records``."""
        start = time.perf_counter()
        records = self.next_records()
        return None if records is None else self.train_step(records, start)

    def next_records(self) -> list[SequenceRecord] | None:
        """This step's records as replayed (``pools.sample``, then ``replay_plan``); None below
        ``online.min_records`` or when every pick was too short to simulate a settled block on."""
        if len(self.pools.window) < self.cfg.online.min_records:
            return None
        self.drafter.train()
        return [r for r in map(self.replay_plan, self.pools.sample(self.generator)) if r is not None] or None

    def train_step(self, records: list[SequenceRecord], start: float | None = None) -> dict[str, Any]:
        """One optimizer step on ``records`` (online_dp.replay_update: every rank of a data-parallel
        trainer calls it with the same records and generator state); a non-finite loss raises
        FloatingPointError before any weight changes."""
        start = time.perf_counter() if start is None else start
        self.drafter.train()
        objective = self.objective_name()
        try:
            replayed, loss, grad_norm = replay_update(
                self.target, self.drafter, records, self.objective(objective), self.optimizer, self.scheduler,
                self.cfg.trainer, generator=self.generator, device=self.device)
        except FloatingPointError as exc:  # never step into NaN weights
            raise FloatingPointError(f"{exc} at step {self.step_count + 1}") from exc
        self.average.update(self.drafter)
        num_tokens = replayed.num_replayed_tokens
        # the served tokens this step learnt from, those its replayed blocks emitted (sum of r + 1): against
        # the server's generated tokens, whether the trainer keeps up with the traffic
        trained_tokens = replayed.block_tokens
        self.step_count += 1
        stats = {"step": self.step_count, "loss": loss, "objective": objective,
                 "loss_accepted": replayed.accepted, "loss_rejected": replayed.rejected,
                 "replayed_tokens": num_tokens, "trained_tokens": trained_tokens, "grad_norm": grad_norm,
                 "lr": self.scheduler.get_last_lr()[0], "seconds": time.perf_counter() - start}
        with self._lock:
            self._stats.update(status="training", steps=self.step_count, step_seconds=stats["seconds"],
                               **{k: stats[k] for k in ("loss", "loss_accepted", "loss_rejected", "lr",
                                                        "grad_norm")})
            self._stats["replayed_tokens"] += num_tokens
            self._stats["trained_tokens"] += trained_tokens
            self._stats["blocks_widened"] += replayed.num_widened
            self._stats["train_seconds"] += stats["seconds"]  # optimizer-step time (compute budget)
        if self.step_count % self.cfg.trainer.log_every == 0:
            logger.info("online step %d: loss %.4f (accepted %.4f, rejected %.4f), %d tokens, %.2fs",
                        self.step_count, stats["loss"], stats["loss_accepted"], stats["loss_rejected"],
                        num_tokens, stats["seconds"])
        return stats

    def _new_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        return new_optimizer(self.drafter, self.cfg.trainer)

    # ---- state ------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Write the resumable state (module docstring) to ``state_dir``."""
        with self._lock:
            kept = (*_COUNTERS, "last_gate", "last_published", "trained_from")
            counters = {k: self._stats[k] for k in kept}
        extra = {"cursor": self.pools.cursor, "counters": counters, "average": self.average.state_dict()}
        if self.schedule is not None:
            extra["objective_schedule"] = self.schedule.state_dict()
        path = save_state(self.state_dir, step=self.step_count, drafter=self.drafter,
                          optimizer=self.optimizer, scheduler=self.scheduler, extra=extra,
                          generator=self.generator)
        self._saved_step = self.step_count
        return path

    def _resume(self) -> None:
        if not (self.state_dir / STATE_FILE).exists():
            return
        try:
            state = load_state(self.state_dir, drafter=self.drafter, optimizer=self.optimizer,
                               scheduler=self.scheduler, generator=self.generator)
        except Exception as exc:  # torn file, or a drafter of another shape is current now
            raise RuntimeError(f"{self.state_dir}: cannot resume the online trainer ({exc}); "
                               "remove the state to start from the registry's current drafter") from exc
        extra = state.get("extra", {})
        self.step_count = int(state["step"])
        self._resume_average(extra.get("average"))
        with self._lock:
            self._stats.update(extra.get("counters", {}), steps=self.step_count)
            if self.step_count:
                self._stats["status"] = "training"
        resumed = self.pools.resume(extra.get("cursor"), self.block_size)
        if self.schedule is not None:
            self._resume_schedule(extra.get("objective_schedule"), resumed)
        self._saved_step = self.step_count
        logger.info("online trainer resumed at step %d (%d train, %d held-out records)",
                    self.step_count, len(self.pools.window), len(self.pools.held_out))

    def _resume_average(self, state: dict | None) -> None:
        """The saved moving average; from a state without one (or of other parameters), or with
        ``online.ema_decay`` 0 now, it starts over from the resumed weights."""
        self.average.reset(self.drafter)
        if state is None or self.average.decay == 0:
            return
        try:
            self.average.load_state_dict(state)
        except (ValueError, KeyError) as exc:
            logger.warning("online trainer: saved weight average not resumed (%s); it starts over", exc)

    def _resume_schedule(self, state: dict | None, records: list[SequenceRecord]) -> None:
        """The objective schedule from the state file; from a state without one (saved with a fixed
        objective), its window is rebuilt from the resumed pools' ``records`` (oldest first)."""
        if state is not None:
            try:
                self.schedule.load_state_dict(state)
            except (ValueError, TypeError) as exc:  # trainer.auto changed its objectives since
                logger.warning("online trainer: saved objective schedule not resumed (%s); it starts over", exc)
                state = None
        if state is None:
            for record in records:
                self.schedule.observe(b.num_accepted for b in replayable_blocks(record, self.block_size))
        self._logged_switches = len(self.schedule.switches)  # logged by the run that made them
        with self._lock:
            self._stats.update(objective=self.schedule.current, objective_switches=len(self.schedule.switches),
                               first_position_acceptance=self.schedule.first_position_acceptance())

    # ---- loop -------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> dict[str, Any]:
        """Poll, step, gate and checkpoint until ``stop`` is set or ``online.max_steps`` is reached.

        A failing step or gate is logged and counted, and the loop goes on after ``poll_s``; the
        state is saved on the way out. Returns the final ``stats``.
        """
        ocfg = self.cfg.online
        last_poll = -math.inf
        try:
            while not stop.is_set() and (ocfg.max_steps is None or self.step_count < ocfg.max_steps):
                started = time.monotonic()
                try:
                    if time.monotonic() - last_poll >= ocfg.poll_s:
                        self.sync_with_registry()
                        self.poll()
                        last_poll = time.monotonic()
                    if not self.may_step():
                        stop.wait(min(ocfg.poll_s, 1.0))
                        continue
                    if self.step() is None:
                        self.note_waiting()
                        stop.wait(ocfg.poll_s)
                        continue
                except Exception as exc:
                    self.record_error("step", exc)
                    stop.wait(ocfg.poll_s)
                    continue
                self.gate_and_checkpoint()
                self.rest(stop, started)
        finally:
            self.finish()
        return self.stats()

    def rest(self, stop: threading.Event, started: float, check_s: float = 1.0) -> float:
        """Keep the trainer's compute to its duty cycle d of its wall time: after work that began at
        ``started`` (monotonic) and took t seconds, wait until t*(1-d)/d has passed, d being
        ``online.duty_cycle`` while the engines serve and ``online.idle_duty_cycle`` while ``load``
        says they are idle, looked at again every ``check_s`` (so a rest ends early when the engines
        turn idle). A set ``stop`` ends it, and so does a duty cycle of 0 (``may_step`` holds the next
        step then, while the loop goes on tailing the buffer). Returns the pause."""
        work = time.monotonic() - started
        rested = 0.0
        while not stop.is_set():
            idle = self.load.idle()
            duty = self.cfg.online.idle_duty_cycle if idle else self.cfg.online.duty_cycle
            if duty == 0 or work * (1 - duty) / duty - rested <= 0:
                break
            left = work * (1 - duty) / duty - rested
            begun = time.monotonic()
            stop.wait(min(left, check_s))
            rested += time.monotonic() - begun
        with self._lock:
            self._stats["rest_seconds"] += rested
        return rested

    def may_step(self) -> bool:
        """False while ``online.duty_cycle`` is 0 and the engines serve (status "waiting_for_idle_engines",
        unless it is "error"): such a trainer trains only while they are idle."""
        allowed = self.cfg.online.duty_cycle > 0 or self.load.idle()
        with self._lock:
            if not allowed and self._stats["status"] != "error":
                self._stats["status"] = "waiting_for_idle_engines"
            elif allowed and self._stats["status"] == "waiting_for_idle_engines":
                self._stats["status"] = "waiting_for_data"  # until the next step says "training"
        return allowed

    def note_engine_load(self, source: str, busy: bool | None) -> None:
        """A serving replica's load (``EngineLoad.report``), as its trainer process read it."""
        self.load.report(source, busy)

    def note_waiting(self) -> None:
        """Status "waiting_for_data" after a loop iteration without a step (an error status stays, and
        so does "waiting_for_idle_engines", which ``may_step`` sets and clears)."""
        with self._lock:
            if self._stats["status"] not in ("error", "waiting_for_idle_engines"):
                self._stats["status"] = "waiting_for_data"

    def finish(self) -> None:
        """Save the state on the way out of the loop; status "stopped"."""
        try:
            self.save()
        except Exception as exc:
            self.record_error("save", exc)
        with self._lock:
            self._stats["status"] = "stopped"

    def record_error(self, where: str, exc: Exception) -> None:
        """Count a failure; log it with its traceback once, not again while the same one repeats
        with no step in between (e.g. CURRENT on a broken version until the reloader rolls it back)."""
        error = f"{where}: {exc!r}"
        with self._lock:
            is_repeat = self._stats["status"] == "error" and self._stats["last_error"] == error
            self._stats["errors"] += 1
            self._stats["last_error"] = error
            self._stats["status"] = "error"
        if is_repeat:
            logger.debug("online trainer: %s failed again at step %d: %r", where, self.step_count, exc)
        else:
            logger.exception("online trainer: %s failed at step %d (repeats are counted, not logged)", where,
                             self.step_count)

    def stats(self) -> dict[str, Any]:
        """Figures for /metrics and the admin surface (JSON-safe; safe to call from another thread)."""
        with self._lock:
            out = dict(self._stats)
        out.update(train_pool=len(self.pools.window), fresh_records=len(self.pools.fresh),
                   held_out_pool=len(self.pools.held_out), engines_idle=self.load.idle())
        return out

    def _load_drafter(self, path: Path):
        """A registry checkpoint with the target's embeddings and LM head attached, on our device."""
        drafter = load_drafter(path)
        drafter.attach_target(self.target.embed_weight, self.target.lm_head_weight)
        return drafter.to(self.device)
