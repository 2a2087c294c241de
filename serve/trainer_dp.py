"""Data-parallel offline training on a Ray cluster through Ray Train's ``TorchTrainer``.

``train_on_records_dp`` runs ``trainer.num_workers`` ranks of ``serve.offline_opd.train_rank`` (offline
Draft-OPD, `online-opd train`) and ``bootstrap_dp`` ``bootstrap.num_workers`` ranks of
``serve.pipeline.train_sft`` (the SFT warm-up, `online-opd bootstrap`, on the CPU) as Ray Train
workers: Ray Train sets up the torch.distributed process group (gloo on the CPU, NCCL with
``trainer.device: cuda``, one GPU per worker), and the core loop does the rest
(online_opd/train/distributed.py): every rank draws the same global batch, replays its slice, and the
gradients are summed before AdamW, so N workers train as one process does on the same global batch.
Rank 0 alone writes the trainer state, ``metrics.jsonl`` and the drafter, the same files a one-worker
run writes, so either resumes the other.

Cluster. ``ray start --head`` on one node and ``ray start --address=HEAD:PORT`` on the others, then
``trainer.ray_address: HEAD:PORT`` (or ``auto`` on a cluster node); null starts a local Ray on this
machine sized to the workers. Each worker reserves one CPU (one GPU with cuda) plus
``trainer.worker_resources``. Every rank reads the records, the init drafter, the target and the run
directory's state at the same paths: on several machines they live on shared storage.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import ray
import ray.train.torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from online_opd.config import OnlineOPDConfig, TrainerConfig
from online_opd.train import distributed as dp
from serve.trainer_actor import join_or_start_ray

logger = logging.getLogger(__name__)


def train_on_records_dp(cfg: OnlineOPDConfig, records_dir: Path, init: Path, run_dir: Path) -> dict[str, Any]:
    """``online-opd train`` on ``trainer.num_workers`` Ray Train workers. Returns rank 0's figures:
    ``drafter`` (the folder it wrote), ``num_workers`` and ``worker_node_ids`` (the Ray node of each
    rank, in rank order)."""
    paths = {"records_dir": records_dir, "init": init, "run_dir": run_dir}
    result = fit(cfg, cfg.trainer, _records_worker, {k: str(Path(v).resolve()) for k, v in paths.items()})
    logger.info("data-parallel training done: %d workers on %d nodes", result["num_workers"],
                len(set(result["worker_node_ids"])))
    return result


def bootstrap_dp(cfg: OnlineOPDConfig, run_dir: Path, metrics: dict[str, Any],
                 time_budget_s: float | None = None) -> dict[str, Any]:
    """The bootstrap's SFT on ``bootstrap.num_workers`` Ray Train workers, from the drafter and the
    sequences serve/pipeline.bootstrap saved in ``run_dir``; returns rank 0's figures, as
    ``train_on_records_dp`` does (``metrics`` go into the drafter's manifest). With ``time_budget_s``
    the ranks stop together at that many seconds from now (a wall-clock deadline: they are other
    processes, possibly on other nodes)."""
    deadline = None if time_budget_s is None else time.time() + time_budget_s
    return fit(cfg, cfg.bootstrap, _bootstrap_worker,
               {"run_dir": str(Path(run_dir).resolve()), "metrics": metrics, "deadline_unix": deadline})


def scaling_config(tcfg: TrainerConfig) -> ScalingConfig:
    """One worker per rank: a CPU (and a GPU with device cuda) plus ``worker_resources``."""
    use_gpu = tcfg.device == "cuda"
    resources = {"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {}), **tcfg.worker_resources}
    return ScalingConfig(num_workers=tcfg.num_workers, use_gpu=use_gpu, resources_per_worker=resources)


def fit(cfg: OnlineOPDConfig, tcfg: TrainerConfig, worker: Callable[[dict], dict], worker_args: dict[str, Any],
        ) -> dict:
    """Run ``worker(config)`` on ``tcfg.num_workers`` ranks (``config``: ``worker_args`` plus ``cfg`` as
    JSON; ``tcfg``, the trainer or bootstrap section, says where) and return rank 0's result; a failing
    rank raises Ray Train's ``TrainingFailedError`` here."""
    scaling = scaling_config(tcfg)
    per_worker = scaling.resources_per_worker
    custom = {k: v * tcfg.num_workers for k, v in per_worker.items() if k not in ("CPU", "GPU")}
    join_or_start_ray(tcfg.ray_address, num_cpus=per_worker["CPU"] * tcfg.num_workers,
                      num_gpus=per_worker.get("GPU", 0.0) * tcfg.num_workers, resources=custom)
    run_dir = Path(worker_args["run_dir"])
    trainer = TorchTrainer(
        worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), **worker_args},
        torch_config=TorchConfig(backend="nccl" if scaling.use_gpu else "gloo"),
        scaling_config=scaling,
        run_config=RunConfig(name=f"{run_dir.name}-{uuid.uuid4().hex[:8]}", storage_path=str(run_dir / "ray_train")),
    )
    logger.info("data-parallel training: %d workers (%s backend), each reserving %s", tcfg.num_workers,
                "nccl" if scaling.use_gpu else "gloo", per_worker)
    return trainer.fit().return_value


def _records_worker(config: dict) -> dict:
    """One rank of ``online-opd train`` (runs inside a Ray Train worker)."""
    from serve.offline_opd import read_usable_records, train_rank

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = OnlineOPDConfig.model_validate(config["cfg"])
    records = read_usable_records(Path(config["records_dir"]))
    drafter = train_rank(cfg, records, Path(config["init"]), Path(config["run_dir"]),
                         device=ray.train.torch.get_device(), progress=False)
    return _rank_result(drafter)


def _bootstrap_worker(config: dict) -> dict:
    """One rank of the bootstrap's SFT (runs inside a Ray Train worker)."""
    from serve.pipeline import (
        INIT_DRAFTER,
        SEQUENCES_FILE,
        TEXT_SEQUENCES_FILE,
        load_serving_drafter,
        prepare_sequences,
        prepare_text_sequences,
        resolve_target,
        train_sft,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = OnlineOPDConfig.model_validate(config["cfg"])
    run_dir = Path(config["run_dir"])
    target = resolve_target(cfg, progress=False)
    needed = [run_dir / INIT_DRAFTER, *([run_dir / SEQUENCES_FILE] if cfg.bootstrap.rollouts else []),
              *([run_dir / TEXT_SEQUENCES_FILE] if cfg.bootstrap.text_conversations else [])]
    missing = [str(path) for path in needed if not path.exists()]
    if missing:  # never generate rollouts again inside a worker
        raise FileNotFoundError(f"bootstrap worker on {ray.util.get_node_ip_address()}: {missing} not found; "
                                "the run directory must be on storage every worker shares")
    drafter, _ = load_serving_drafter(run_dir / INIT_DRAFTER, target)
    layer_ids = drafter.target_layer_ids
    sequences = prepare_sequences(cfg, target, run_dir, layer_ids, progress=False) + \
        prepare_text_sequences(cfg, target, run_dir, layer_ids, progress=False)
    deadline = config.get("deadline_unix")
    return _rank_result(train_sft(cfg, drafter, sequences, run_dir, config["metrics"], progress=False,
                                  time_budget_s=None if deadline is None else max(deadline - time.time(), 0.0)))


def _rank_result(drafter: Path) -> dict:
    """What every rank returns (Ray Train keeps rank 0's): the drafter folder and where the ranks ran."""
    node_ids = dp.gather([ray.get_runtime_context().get_node_id()])
    return {"drafter": str(drafter), "worker_node_ids": node_ids, "num_workers": dp.world_size()}
