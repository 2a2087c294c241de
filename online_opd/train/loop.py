"""The optimisation loop shared by SFT warm-up and Draft-OPD training.

`train(step_fn, drafter, cfg, run_dir)` steps AdamW on `step_fn(step)`'s loss
with a cosine schedule, clips gradients, shows a progress bar, appends
metrics to `metrics.jsonl`, saves a resumable state every
`checkpoint_every` steps, and on SIGINT/SIGTERM finishes the current step,
saves, and returns. The result drafter is written in vLLM's format to
`run_dir/drafter` by the caller.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from online_opd.config import TrainerConfig
from online_opd.train.optim import build_optimizer, cosine_with_warmup
from online_opd.train.state import load_state, save_state

logger = logging.getLogger(__name__)

StepFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]


@contextmanager
def _stop_on_signals():
    """Turn SIGINT/SIGTERM into a flag the loop checks between steps."""
    flag = {"stop": False}

    def handler(signum, _frame):
        logger.warning("signal %d: finishing this step, then saving", signum)
        flag["stop"] = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def train(
    step_fn: StepFn,
    drafter: torch.nn.Module,
    cfg: TrainerConfig,
    run_dir: Path,
    *,
    progress: bool = True,
    desc: str = "train",
    time_budget_s: float | None = None,
) -> int:
    """Run until cfg.num_steps (resuming from run_dir), or until `time_budget_s`
    seconds of this call have passed; returns the last step done."""
    optimizer = build_optimizer(drafter, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    scheduler = cosine_with_warmup(optimizer, num_steps=cfg.num_steps,
                                   warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio)
    state = load_state(run_dir, drafter=drafter, optimizer=optimizer, scheduler=scheduler)
    step = state["step"] if state else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = run_dir / "metrics.jsonl"
    drafter.train()
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    with _stop_on_signals() as flag, open(metrics_file, "a") as log, tqdm(
        total=cfg.num_steps, initial=step, desc=desc, unit="step", disable=not progress
    ) as bar:
        while step < cfg.num_steps and not flag["stop"]:
            if deadline is not None and time.perf_counter() >= deadline:
                save_state(run_dir, step=step, drafter=drafter, optimizer=optimizer, scheduler=scheduler)
                break
            start = time.perf_counter()
            loss, stats = step_fn(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip or float("inf"))
            optimizer.step()
            scheduler.step()
            step += 1
            stats = {"step": step, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                     "lr": scheduler.get_last_lr()[0], "step_s": time.perf_counter() - start, **stats}
            log.write(json.dumps(stats) + "\n")
            bar.update(1)
            if step % cfg.log_every == 0:
                log.flush()
                bar.set_postfix({k: f"{v:.3g}" for k, v in stats.items() if k in _SHOWN})
            if step % cfg.checkpoint_every == 0 or step == cfg.num_steps or flag["stop"]:
                save_state(run_dir, step=step, drafter=drafter, optimizer=optimizer, scheduler=scheduler)
    drafter.eval()
    return step


_SHOWN = ("loss", "accept_len", "top1_pos1", "accepted", "rejected", "lr")
