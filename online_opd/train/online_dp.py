"""The online trainer over several ranks: rank 0 decides, every rank takes the same step.

Rank 0 is ``OnlineTrainer`` in full (it polls the buffer, keeps the pools, samples, gates,
publishes, syncs with the registry, saves the state and answers ``stats``); a rank > 0 is a
``Replica``: the target, a drafter replica, its AdamW and schedule, nothing else. Each iteration
rank 0 broadcasts one control object, and every rank acts on it alike, so no rank waits in a
collective that the others never reach:

    {"stop": bool,                          all ranks leave the loop
     "records": [SequenceRecord] | None,    this step's records as replayed (sampled, planned); None: no step
     "objective": str | None,               this step's objective (trainer.objective, or auto's choice)
     "generator": ByteTensor | None,        rank 0's sampling generator after sampling (anchor draws)
     "reload_weights": str | None}          a drafter folder: load its architecture, then take rank 0's state

A step is then ``replay_update`` on every rank: ``replay_records`` replays the rank's slice with the
same anchor draws (train/distributed.py), the gradients are summed over the ranks and every replica
takes the same AdamW step, the single-process update up to float rounding. Whenever rank 0's weights
change outside a step (start or resume, a resync after a rollback, a trial the gate ended: the
trainer's ``take_weights_replaced``) ``broadcast_state`` sends its parameters, AdamW moments and
schedule, so the replicas never drift; ``parameter_digests`` lets a test check that they have not. Who starts the ranks (serve/trainer_online_dp.py through Ray Train, tests
through torch.multiprocessing) sets up the process group; this module never imports ray.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import get_constant_schedule_with_warmup

from online_opd.config import OnlineOPDConfig, TrainerConfig
from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.models.target_model import TargetModel
from online_opd.traces.records import SequenceRecord
from online_opd.train import distributed as dp
from online_opd.train.loop import apply_update
from online_opd.train.opd import ReplayedLoss, objective_fn, replay_records
from online_opd.train.optim import build_optimizer

if TYPE_CHECKING:
    from online_opd.train.online import OnlineTrainer

logger = logging.getLogger(__name__)


def new_optimizer(drafter: torch.nn.Module, tcfg: TrainerConfig,
                  ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and the online schedule: linear warm-up over round(warmup_ratio * num_steps), then constant."""
    optimizer = build_optimizer(drafter, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=tcfg.betas)
    warmup = round(tcfg.warmup_ratio * tcfg.num_steps) if tcfg.warmup_ratio > 0 else 0
    return optimizer, get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)


def replay_update(target, drafter, records: list[SequenceRecord], objective, optimizer, scheduler,
                  tcfg: TrainerConfig, *, generator: torch.Generator, device: torch.device,
                  ) -> tuple[ReplayedLoss, float, float]:
    """One optimizer step on ``records`` (the global batch, the same on every rank): returns the replay,
    the global batch's loss and the gradient norm. A non-finite loss raises FloatingPointError on every
    rank alike (it is summed over the ranks first) before any weight changes."""
    replayed = replay_records(target, drafter, records, objective, anchors_per_sequence=tcfg.anchors_per_sequence,
                              generator=generator, pooling=tcfg.loss_pooling, device=device,
                              use_teacher=tcfg.captured_teacher, widen_share=tcfg.widen_share)
    loss = float(dp.sum_over_ranks(replayed.loss.detach()))
    if not math.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss}")
    grad_norm = apply_update(replayed.loss, drafter, optimizer, scheduler, tcfg.grad_clip)
    return replayed, loss, float(grad_norm)


def broadcast_state(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make every rank's parameters, AdamW state and schedule rank 0's (parameters by
    ``dist.broadcast``; the optimizer and schedule state as one object, on the CPU: ``load_state_dict``
    moves it to the parameters' device). Every rank must hold a drafter of rank 0's architecture."""
    if not dp.is_distributed():
        return
    with torch.no_grad():
        for param in drafter.parameters():
            dist.broadcast(param, src=0)
    state = [{"optimizer": _to_cpu(optimizer.state_dict()), "scheduler": scheduler.state_dict()}
             if dp.is_main_process() else None]
    dist.broadcast_object_list(state, src=0)
    if not dp.is_main_process():
        optimizer.load_state_dict(state[0]["optimizer"])
        scheduler.load_state_dict(state[0]["scheduler"])


def parameter_digests(drafter: torch.nn.Module) -> list[str]:
    """Every rank's sha256 of its drafter's parameters, in rank order (on every rank): equal digests
    mean bit-equal replicas."""
    digest = hashlib.sha256()
    for param in drafter.parameters():
        digest.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return dp.gather([digest.hexdigest()])


def exchange_control(control: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's ``control`` on every rank (the others pass None)."""
    box = [control]
    if dp.is_distributed():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


class Replica:
    """A rank > 0: the target, a drafter replica, its AdamW and schedule; it steps on what rank 0 sends."""

    def __init__(self, cfg: OnlineOPDConfig, target_path: Path) -> None:
        torch.set_num_threads(cfg.online.num_threads)
        self.cfg = cfg
        self.device = torch.device(cfg.online.device)
        self.target = TargetModel.from_pretrained(target_path, dtype=torch.float32)
        self.target.model.to(self.device)
        self.objectives: dict[str, Any] = {}  # by name, as rank 0 names each step's (objective: auto)
        self.generator = torch.Generator()
        self.drafter: torch.nn.Module | None = None
        self.optimizer = self.scheduler = None
        self.step_count = 0

    def load(self, path: str) -> None:
        """Take the architecture of the drafter at ``path`` (its weights come from rank 0 next)."""
        drafter = load_drafter(path)
        drafter.attach_target(self.target.embed_weight, self.target.lm_head_weight)
        self.drafter = drafter.to(self.device)
        self.optimizer, self.scheduler = new_optimizer(self.drafter, self.cfg.trainer)

    def run(self) -> int:
        """Follow rank 0's control objects until it says stop; returns the number of steps taken."""
        while True:
            control = exchange_control(None)
            if control["reload_weights"] is not None:
                self.load(control["reload_weights"])
                broadcast_state(self.drafter, self.optimizer, self.scheduler)
            if control["stop"]:
                return self.step_count
            if control["records"] is None:
                continue
            self.generator.set_state(control["generator"])
            self.drafter.train()
            name = control["objective"]
            if name not in self.objectives:
                self.objectives[name] = objective_fn(self.cfg.trainer, name)
            try:
                replay_update(self.target, self.drafter, control["records"], self.objectives[name], self.optimizer,
                              self.scheduler, self.cfg.trainer, generator=self.generator, device=self.device)
            except FloatingPointError:  # raised on every rank alike: rank 0 counts it
                continue
            self.step_count += 1


def run_main(trainer: OnlineTrainer, stop: threading.Event) -> dict[str, Any]:
    """Rank 0: ``OnlineTrainer.run``'s loop with one control object sent to the other ranks per
    iteration (module docstring). The replicas start from rank 0's weights (resumed, or the registry's).

    A failing poll, sync or sample is counted and the loop goes on, as in ``run`` (nothing was sent
    yet). A step that fails other than with a non-finite loss (which every rank sees alike) ends the
    loop, the state saved: the ranks may stand at different collectives, so only a restart of the
    group (Ray Train failing, the actor restarted by Ray) brings them back in step."""
    ocfg = trainer.cfg.online
    last_poll = -math.inf
    reload = True
    try:
        while True:
            is_stop = stop.is_set() or (ocfg.max_steps is not None and trainer.step_count >= ocfg.max_steps)
            records = None
            started = time.monotonic()
            if not is_stop:
                try:
                    if time.monotonic() - last_poll >= ocfg.poll_s:
                        trainer.sync_with_registry()
                        trainer.poll()
                        last_poll = time.monotonic()
                    start = time.perf_counter()
                    records = trainer.next_records() if trainer.may_step() else None  # the status says which
                except Exception as exc:
                    trainer.record_error("step", exc)
            # new weights on rank 0 (a resync after a rollback, a trial the gate ended): the replicas take them
            reload = trainer.take_weights_replaced() or reload
            send_control(trainer, is_stop, records, reload)
            reload = False
            if is_stop:
                break
            if records is None:
                trainer.note_waiting()
                stop.wait(ocfg.poll_s)
                continue
            try:
                trainer.train_step(records, start)
            except FloatingPointError as exc:  # every rank skipped this step alike
                trainer.record_error("step", exc)
                stop.wait(ocfg.poll_s)
                continue
            trainer.gate_and_checkpoint()
            trainer.rest(stop, started)  # the replicas wait in the next exchange
    finally:
        trainer.finish()
    return trainer.stats()


def send_control(trainer: OnlineTrainer, is_stop: bool, records: list[SequenceRecord] | None,
                 reload: bool) -> None:
    """Rank 0's half of one iteration's exchange: the control object, then its state when ``reload``."""
    version = trainer.stats()["trained_from"]
    exchange_control({"stop": is_stop, "records": records,
                      "objective": trainer.objective_name() if records is not None else None,
                      "generator": trainer.generator.get_state() if records is not None else None,
                      "reload_weights": str(trainer.registry.get(version).path) if reload else None})
    if reload:
        broadcast_state(trainer.drafter, trainer.optimizer, trainer.scheduler)
