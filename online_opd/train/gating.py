"""The online trainer's gate, publishing and restarts: the half of ``OnlineTrainer`` (train/online.py)
that talks to the registry.

Every ``gate.every_steps`` steps (``gate_and_checkpoint``; deferred while the gate's seconds would pass
``gate.max_time_share`` of the trainer's working seconds) the candidate, the moving average of the trained
weights (``online.ema_decay``, train/ema.py; the weights themselves at 0), is compared with the registry's
current drafter on the held-out pool (``release.gate.evaluate_gate``), published as a new registry version
whose parent is the serving version, then promoted when the gate passed or rejected with the gate's reason.
With ``trainer.objective: auto`` each outcome goes to the objective schedule, which may end a trial of its
strong objective: training then restarts from the serving version (``_restart_from``).

``sync_with_registry`` restarts the same way when the registry's CURRENT is not the version these weights
descend from (a rollback by the reloader, a promote by hand).

A mixin, not a class of its own: it reads and writes the trainer's drafter, optimizer, average, schedule,
pools, counters (``_stats`` under ``_lock``) and registry, all set up by ``OnlineTrainer.__init__``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from online_opd.release.gate import evaluate_gate
from online_opd.train.ema import WeightAverage

logger = logging.getLogger(__name__)


class GateAndPublish:
    """``gate``, ``gate_and_checkpoint``, ``sync_with_registry`` and restarts, for ``OnlineTrainer``."""

    def gate(self) -> dict[str, Any]:
        """Compare with the serving drafter on held-out records, publish, promote or reject.

        Returns the gate's figures plus the published ``version`` and its ``status``.
        """
        current = self.registry.current()
        if current is None:
            raise RuntimeError(f"registry {self.registry.root} has no current drafter to gate against")
        serving = self._load_drafter(current.path)
        with self._lock:
            last_step = {k: self._stats[k] for k in ("loss", "loss_accepted", "loss_rejected", "lr")}
            objective = self._stats["objective"]
        metrics = {"objective": self.cfg.trainer.objective, "train": last_step,
                   "average": {"decay": self.average.decay, "updates": self.average.num_updates}}
        if self.schedule is not None:  # which of the two trained last, and on what acceptance
            metrics["objective_schedule"] = {"current": objective, "switches": len(self.schedule.switches),
                                             "first_position_acceptance": self.schedule.first_position_acceptance()}
        with self.average.applied_to(self.drafter) as candidate:
            candidate.eval()
            try:
                result = evaluate_gate(self.target, candidate, serving, list(self.pools.held_out), self.cfg.gate)
                info = self.registry.publish(candidate, parent=current.version, step=self.step_count,
                                             metrics={"gate": result.to_dict(), **metrics})
            finally:
                candidate.train()
        figures = (f"tau {result.tau_candidate:.3f} vs {result.tau_serving:.3f} ({current.version}) "
                   f"over {result.n_blocks} blocks")
        if result.passed:
            self.registry.promote(info.version, reason=f"gate passed at step {self.step_count}: "
                                                       f"{result.reason}; {figures}")
            status = "promoted"
        else:
            self.registry.reject(info.version, f"{result.reason}; {figures}")
            status = "rejected"
        summary = {**result.to_dict(), "version": info.version, "status": status, "step": self.step_count,
                   "serving": current.version}
        logger.info("online gate at step %d: %s %s (%s; %s)", self.step_count, info.version, status,
                    result.reason, figures)
        with self._lock:
            self._stats["gates"] += 1
            self._stats["promotions" if result.passed else "rejections"] += 1
            self._stats["last_gate"] = summary
            self._stats["last_published"] = info.version
            if result.passed:  # the served weights are this trainer's own now
                self._stats["trained_from"] = info.version
        if self.schedule is not None and self.schedule.gate_outcome(self.step_count, result.passed,
                                                                    result.tau_candidate - result.tau_serving):
            logger.warning("online trainer: %d gates on %s promoted nothing and its candidates scored no better "
                           "than %s; back to %s from %s's weights", self.schedule.trial_gates,
                           self.schedule.strong, current.version, self.schedule.weak, current.version)
            self._restart_from(current)
        return summary

    def sync_with_registry(self) -> bool:
        """Start again from the registry's CURRENT when it is not the version these weights descend
        from (``trained_from``): a rollback, or a promote by hand. The drafter is reloaded from CURRENT
        and the optimizer and schedule start fresh; returns whether that happened."""
        current = self.registry.current()
        with self._lock:
            trained_from = self._stats["trained_from"]
        if current is None or current.version == trained_from:
            return False
        self._restart_from(current)
        with self._lock:
            self._stats["resyncs"] += 1
        logger.warning("online trainer: the registry serves %s, not %s that these weights came from; "
                       "reloaded %s with a fresh optimizer", current.version, trained_from, current.version)
        return True

    def _restart_from(self, version) -> None:
        """Train on from registry ``version``'s weights with a fresh optimizer, schedule and average."""
        self.drafter = self._load_drafter(version.path)
        self.block_size = self.drafter.cfg.block_size
        self.optimizer, self.scheduler = self._new_optimizer()
        self.average = WeightAverage(self.drafter, self.cfg.online.ema_decay)
        self._weights_replaced = True
        with self._lock:
            self._stats["trained_from"] = version.version

    def take_weights_replaced(self) -> bool:
        """Whether the weights were replaced (a resync, a trial ended by the gate) since the last call:
        data-parallel replicas must then receive them (train/online_dp.py)."""
        replaced, self._weights_replaced = self._weights_replaced, False
        return replaced

    def gate_and_checkpoint(self) -> None:
        """After a step: the gate every ``gate.every_steps`` steps, or at the first step after that where it
        keeps within ``gate.max_time_share`` (``gate_within_budget``); a save every ``online.checkpoint_every``."""
        within = self.gate_within_budget()
        if self.step_count % self.cfg.gate.every_steps == 0:
            self._gate_due = True
            if not within:  # a due point passed without a gate (counted once, however many follow)
                with self._lock:
                    self._stats["gates_deferred"] += 1
        if self._gate_due and within:
            self._gate_due = False
            start = time.perf_counter()
            try:
                try:
                    self.gate()
                finally:
                    with self._lock:
                        self._stats["gate_seconds"] += time.perf_counter() - start
                self.save()
            except Exception as exc:
                self.record_error("gate", exc)
        if self.step_count % self.cfg.online.checkpoint_every == 0 and self._saved_step != self.step_count:
            self.save()

    def gate_within_budget(self) -> bool:
        """Whether the gate's seconds so far are at most ``gate.max_time_share`` of the trainer's working
        seconds (optimizer steps plus gates, this process)."""
        with self._lock:
            gate_s, train_s = self._stats["gate_seconds"], self._stats["train_seconds"]
        return gate_s <= self.cfg.gate.max_time_share * (train_s + gate_s)
