"""The online trainer on ``trainer.num_workers`` Ray Train workers (serve/trainer_actor.py runs it).

``DataParallelOnlineTrainer`` has ``OnlineTrainer``'s ``run(stop)`` and ``stats()``, so the
TrainerActor runs either alike: ``run`` starts Ray Train's ``TorchTrainer`` (serve/trainer_dp.py's
``fit``: gloo on the CPU, NCCL with ``online.device: cuda``, one GPU per worker) whose rank 0 is an
``OnlineTrainer`` running ``online_dp.run_main`` and whose other ranks are ``online_dp.Replica``s
(online_opd/train/online_dp.py: one control object per iteration, the same step on every rank).

Figures and stop. Rank 0 reports its ``stats()`` every ``REPORT_S`` seconds to a ``StatsBox``, a
small actor this object creates and passes to the workers; ``stats()`` reads the box, and the
answer to a report carries the stop request that ``run``'s ``stop`` event raised, so rank 0 ends the
loop, sends stop to the other ranks and saves the state, as ``OnlineTrainer.run`` does. It also
carries whether the serving engines are idle (the box keeps their load reports,
``note_engine_load``), which rank 0's rest follows (``OnlineTrainer.rest``).

Placement. The workers join the TrainerActor's Ray (``online.ray_address``; a local Ray is sized
for them by ``start_trainer``); each reserves one CPU (one GPU with cuda) plus
``trainer.worker_resources``. Rank 0 reads and writes the buffer, the registry and ``state_dir``;
the other ranks read the target and, on a resync, the registry's drafter: on several machines
those live on shared storage.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import ray
import torch

from online_opd.config import OnlineOPDConfig, TrainerConfig
from online_opd.train import distributed as dp
from online_opd.train import online_dp
from online_opd.train.load import EngineLoad
from online_opd.train.online import OnlineTrainer
from serve.trainer_dp import fit, scaling_config

logger = logging.getLogger(__name__)

REPORT_S = 1.0  # seconds between rank 0's stats reports (and its checks for a stop request)


class _ReportedLoad:
    """Rank 0's ``OnlineTrainer.load``: the box's answer to its latest report (``EngineLoad.idle``)."""

    is_idle = False

    def idle(self) -> bool:
        return self.is_idle


class StatsBox:
    """Ray actor body: rank 0's latest figures, and whether the trainer was asked to stop."""

    def __init__(self, num_workers: int, idle_after_s: float) -> None:
        self._stats: dict[str, Any] = {"status": "starting", "num_workers": num_workers}
        self._is_stopping = False
        self._load = EngineLoad(idle_after_s)

    def report(self, stats: dict[str, Any]) -> tuple[bool, bool]:
        """Keep rank 0's ``stats``; returns whether to stop and whether the engines are idle."""
        self._stats = stats
        return self._is_stopping, self._load.idle()

    def note_engine_load(self, source: str, busy: bool | None) -> None:
        self._load.report(source, busy)

    def request_stop(self) -> None:
        self._is_stopping = True

    def latest(self) -> dict[str, Any]:
        return self._stats


def worker_trainer_config(cfg: OnlineOPDConfig) -> TrainerConfig:
    """The trainer section with the online trainer's device type (``fit`` places the workers by it)."""
    return cfg.trainer.model_copy(update={"device": torch.device(cfg.online.device).type})


def worker_resources(cfg: OnlineOPDConfig) -> dict[str, float]:
    """What the ``trainer.num_workers`` workers reserve in all (``scaling_config``, times the workers)."""
    per_worker = scaling_config(worker_trainer_config(cfg)).resources_per_worker
    return {name: amount * cfg.trainer.num_workers for name, amount in per_worker.items()}


class DataParallelOnlineTrainer:
    """``OnlineTrainer``'s ``run`` and ``stats`` over ``trainer.num_workers`` Ray Train workers."""

    def __init__(self, cfg: OnlineOPDConfig, *, target_path: Path, buffer_dir: Path | str, registry_dir: Path,
                 state_dir: Path) -> None:
        self.cfg = cfg
        self._paths = {"target_path": str(Path(target_path).resolve()), "buffer_dir": str(buffer_dir),
                       "registry_dir": str(Path(registry_dir).resolve()),
                       "state_dir": str(Path(state_dir).resolve())}
        self._box = ray.remote(num_cpus=0)(StatsBox).remote(cfg.trainer.num_workers, cfg.online.idle_after_s)
        self._final: dict[str, Any] | None = None

    def run(self, stop: threading.Event) -> dict[str, Any]:
        """Train on the workers until ``stop`` is set or ``online.max_steps``; returns rank 0's final stats."""
        done = threading.Event()

        def forward_stop() -> None:
            while not done.is_set():
                if stop.wait(REPORT_S):
                    self._box.request_stop.remote()
                    return

        threading.Thread(target=forward_stop, name="online-opd-dp-stop", daemon=True).start()
        try:
            args = {**self._paths, "run_dir": self._paths["state_dir"], "stats_box": self._box}
            self._final = fit(self.cfg, worker_trainer_config(self.cfg), _online_worker, args)
        finally:
            done.set()
        return self.stats()

    def note_engine_load(self, source: str, busy: bool | None) -> None:
        """A serving replica's load, kept by the box for rank 0 (``OnlineTrainer.note_engine_load``)."""
        self._box.note_engine_load.remote(source, busy)

    def stats(self) -> dict[str, Any]:
        """Rank 0's latest figures (its final ones once ``run`` returned), plus ``num_workers``."""
        stats = self._final if self._final is not None else ray.get(self._box.latest.remote(), timeout=10)
        return {**stats, "num_workers": self.cfg.trainer.num_workers}


def _online_worker(config: dict) -> dict:
    """One rank of the online trainer (runs inside a Ray Train worker): rank 0 decides, the others follow."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = OnlineOPDConfig.model_validate(config["cfg"])
    if not dp.is_main_process():
        online_dp.Replica(cfg, Path(config["target_path"])).run()
        return {}
    trainer = OnlineTrainer(cfg, target_path=Path(config["target_path"]), buffer_dir=config["buffer_dir"],
                            registry_dir=Path(config["registry_dir"]), state_dir=Path(config["state_dir"]))
    box, stop, done = config["stats_box"], threading.Event(), threading.Event()
    trainer.load = _ReportedLoad()

    def report() -> None:
        while not done.wait(REPORT_S):
            try:
                is_stopping, trainer.load.is_idle = ray.get(box.report.remote(trainer.stats()), timeout=30)
                if is_stopping:
                    stop.set()
            except Exception as exc:  # the box is the actor's: without it nobody reads the figures
                logger.warning("online trainer rank 0: stats report failed: %r", exc)

    threading.Thread(target=report, name="online-opd-dp-report", daemon=True).start()
    try:
        final = online_dp.run_main(trainer, stop)
    finally:
        done.set()
    ray.get(box.report.remote(final), timeout=30)
    return final
