"""The optimisation loop shared by SFT warm-up and Draft-OPD training.

`train(step_fn, drafter, cfg, run_dir)` steps AdamW on `step_fn(step)`'s loss
with a cosine schedule, clips gradients, shows a progress bar, appends
metrics to `metrics.jsonl`, saves a resumable state every
`checkpoint_every` steps (with the step function's sampling `generator`, when
given, so a resumed run picks what an uninterrupted one would), and when the
caller's `stop` event is set (serve/ turns SIGINT/SIGTERM into it) finishes
the current step, saves, and returns. The result drafter is written in vLLM's format to
`run_dir/drafter` by the caller.

Data-parallel: run in every rank of a torch.distributed process group, with a step function that
replays its rank's slice of the global batch (train/distributed.py), the loop sums the gradients over
the ranks before clipping and AdamW, logs the global batch's loss, ends all ranks at the same step,
and writes (metrics, state) on rank 0 only. Every rank resumes from the same `run_dir` state.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from online_opd.config import TrainerConfig
from online_opd.train import distributed as dp
from online_opd.train.optim import build_optimizer, cosine_with_warmup
from online_opd.train.state import load_state, save_state

logger = logging.getLogger(__name__)

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]


def train(
    step_fn: StepFn,
    drafter: torch.nn.Module,
    cfg: TrainerConfig,
    run_dir: Path,
    *,
    progress: bool = True,
    desc: str = "train",
    time_budget_s: float | None = None,
    generator: torch.Generator | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run until cfg.num_steps (resuming from run_dir), until `time_budget_s` seconds of this call
    have passed, or until `stop` is set (checked between steps; the caller owns signals, see
    serve/signals.py); saves the state and returns the last step done. Data-parallel when run in
    every rank of a torch.distributed process group (module docstring)."""
    stop = stop if stop is not None else threading.Event()
    optimizer = build_optimizer(drafter, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    scheduler = cosine_with_warmup(optimizer, num_steps=cfg.num_steps,
                                   warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio)
    state = load_state(run_dir, drafter=drafter, optimizer=optimizer, scheduler=scheduler, generator=generator)
    step = saved = state["step"] if state else 0
    dp.sync_replicas(drafter, step, str(run_dir))
    device, is_main = next(drafter.parameters()).device, dp.is_main_process()

    def save() -> None:
        nonlocal saved
        if is_main and step != saved:
            save_state(run_dir, step=step, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                       generator=generator)
        saved = step

    drafter.train()
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    with _metrics_log(run_dir, is_main) as log, tqdm(
        total=cfg.num_steps, initial=step, desc=desc, unit="step", disable=not (progress and is_main)
    ) as bar:
        while step < cfg.num_steps:
            if dp.any_rank(stop.is_set() or (deadline is not None and time.perf_counter() >= deadline), device):
                break
            start = time.perf_counter()
            loss, stats = step_fn(step)
            grad_norm = apply_update(loss, drafter, optimizer, scheduler, cfg.grad_clip)
            step += 1
            stats = {"step": step, "loss": float(dp.sum_over_ranks(loss.detach())), "grad_norm": float(grad_norm),
                     "lr": scheduler.get_last_lr()[0], "step_s": time.perf_counter() - start, **stats}
            if log is not None:
                log.write(json.dumps(stats) + "\n")
            bar.update(1)
            if step % cfg.log_every == 0:
                if log is not None:
                    log.flush()
                bar.set_postfix({k: f"{v:.3g}" for k, v in stats.items() if k in _SHOWN})
            if step % cfg.checkpoint_every == 0 or step == cfg.num_steps:
                save()
        save()
    drafter.eval()
    return step


def time_steps(make_step_fn: Callable[[torch.nn.Module], StepFn], drafter: torch.nn.Module, cfg: TrainerConfig,
               num_steps: int = 6) -> float:
    """Mean seconds of an optimiser step (``make_step_fn(model)``'s steps plus the update), measured over
    steps 2..num_steps on a copy of ``drafter``: the drafter, and any generator the caller trains with,
    are left as they were. The first step (allocations) is not counted."""
    if num_steps < 2:
        raise ValueError(f"num_steps={num_steps}: the first step is not timed, so at least 2 are needed")
    model = copy.deepcopy(drafter).train()
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    scheduler = cosine_with_warmup(optimizer, num_steps=cfg.num_steps, warmup_ratio=cfg.warmup_ratio,
                                   min_lr_ratio=cfg.min_lr_ratio)
    step_fn, seconds = make_step_fn(model), []
    for step in range(num_steps):
        start = time.perf_counter()
        loss, _ = step_fn(step)
        apply_update(loss, model, optimizer, scheduler, cfg.grad_clip)
        seconds.append(time.perf_counter() - start)
    return sum(seconds[1:]) / (num_steps - 1)


def apply_update(loss: torch.Tensor, drafter: torch.nn.Module, optimizer, scheduler, grad_clip: float) -> torch.Tensor:
    """Backward, gradients summed over the ranks, clipping, AdamW and the schedule; the grad norm."""
    optimizer.zero_grad(set_to_none=True)
    if loss.requires_grad or not dp.is_distributed():  # a rank whose shard was empty adds zeros
        loss.backward()
    dp.all_reduce_gradients(drafter)
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip or float("inf"))
    optimizer.step()
    scheduler.step()
    return grad_norm


def _metrics_log(run_dir: Path, is_main: bool):
    """``run_dir/metrics.jsonl`` open for appending on rank 0; None (nothing written) on the others."""
    if not is_main:
        return contextlib.nullcontext()
    run_dir.mkdir(parents=True, exist_ok=True)
    return open(run_dir / "metrics.jsonl", "a")


_SHOWN = ("loss", "accept_len", "top1_pos1", "accepted", "rejected", "lr")
