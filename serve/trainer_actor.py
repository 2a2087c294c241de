"""The online trainer as a Ray actor (docs/architecture.md#data-flow: buffer -> trainer).

``start_trainer`` joins (or starts) Ray and creates one named actor wrapping
``online_opd.train.online.OnlineTrainer``; the actor trains in a background
thread, so ``stats`` and ``stop`` are answered while a step runs
(``max_concurrency=4``: a threaded actor). Resources come from the ``online``
config section: ``num_cpus``/``num_gpus`` are what the actor reserves, and on
a local Ray the node is sized to them, so Ray never claims the whole machine
that the serving engine runs on.

Crashes. Training starts in ``__init__``, not only in ``start``, so when Ray
restarts a dead actor (``online.max_restarts``) it trains again by itself,
resuming from its state directory. An exception that escapes the trainer's
own loop (which already survives failing steps) ends the process, so that
Ray restarts it rather than leaving an actor that answers but never trains.
`online-opd serve` calls this from a child process (serve/trainer_process.py), so
that Ray ending its driver when the head is lost never ends the server.

The config crosses the process boundary as ``cfg.model_dump(mode="json")``
and is validated again inside the actor.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from online_opd.config import OnlineOPDConfig
from online_opd.traces.storage import canonical_location
from online_opd.train.online import OnlineTrainer

logger = logging.getLogger("online_opd.trainer_actor")

ACTOR_NAME = "online-opd-trainer"
#: Ray namespace of the shared trainer: replicas joining one cluster find it there by name.
NAMESPACE = "online-opd"
#: A replica whose trainer child has not polled for this long no longer keeps a shared trainer alive.
REPLICA_LEASE_S = 120.0
LOCAL_OBJECT_STORE_BYTES = 200 * 1024**2  # the trainer passes no large objects through Ray
#: A local head that stops answering is gone (nothing restarts it): its driver ends after this many seconds
#: instead of Ray's default 60, so serve/trainer_process.py starts a fresh one sooner.
LOCAL_GCS_RECONNECT_S = 10


class TrainerActor:
    """Ray actor body (decorated at start, so its resources come from the config)."""

    def __init__(self, cfg: dict, target_path: str, buffer_dir: str, registry_dir: str, state_dir: str,
                 autostart: bool = True) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        config = OnlineOPDConfig.model_validate(cfg)
        paths = {"target_path": Path(target_path), "buffer_dir": buffer_dir, "registry_dir": Path(registry_dir),
                 "state_dir": Path(state_dir)}
        if config.trainer.num_workers > 1:  # Ray Train workers; imported here: trainer_dp imports this module
            from serve.trainer_online_dp import DataParallelOnlineTrainer

            self._trainer = DataParallelOnlineTrainer(config, **paths)
        else:
            self._trainer = OnlineTrainer(config, **paths)
        self._dirs = {"buffer_dir": canonical_location(buffer_dir), "registry_dir": str(Path(registry_dir).resolve())}
        self._replicas: dict[str, float] = {}  # replica -> last time it attached or polled (monotonic)
        self._replicas_lock = threading.Lock()  # a threaded actor: calls run concurrently
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if autostart:
            self.start()

    def start(self) -> bool:
        """Start training in a background thread; False when it was already started."""
        with self._lock:
            if self._thread is not None:
                return False
            self._thread = threading.Thread(target=self._run, name="online-opd-trainer", daemon=True)
            self._thread.start()
            return True

    def _run(self) -> None:
        try:
            self._trainer.run(self._stop)
        except BaseException:
            logger.exception("online trainer died; exiting so that Ray restarts the actor")
            os._exit(1)

    def stats(self, replica: str | None = None, load: str | None = None) -> dict[str, Any]:
        """The trainer's figures plus whether its thread is alive, this process's id and the replicas
        it trains for; `replica` (a serving replica's poll) renews that replica's lease, `load` ("busy",
        "idle" or "unknown", as its trainer process read it from the server's /metrics) is that
        replica's engine load (``OnlineTrainer.note_engine_load``)."""
        with self._replicas_lock:
            if replica is not None:
                self._replicas[replica] = time.monotonic()
            replicas = sorted(self._replicas)
        if load is not None:
            self._trainer.note_engine_load(replica or "local", {"busy": True, "idle": False}.get(load))
        thread = self._thread
        return {**self._trainer.stats(), "running": thread is not None and thread.is_alive(),
                "pid": os.getpid(), "replicas": replicas}

    def attach(self, replica: str, buffer_dir: str, registry_dir: str) -> list[str]:
        """A serving replica joins this (shared) trainer; its buffer and registry must be the trainer's."""
        theirs = {"buffer_dir": canonical_location(buffer_dir), "registry_dir": str(Path(registry_dir).resolve())}
        if theirs != self._dirs:
            raise ValueError(f"replica {replica!r} serves with {theirs}, but the cluster's online trainer "
                             f"trains on {self._dirs}: replicas sharing a trainer must share one buffer and "
                             "one registry (capture.buffer_dir, serve.registry on shared storage)")
        with self._replicas_lock:
            self._replicas[replica] = time.monotonic()
            return sorted(self._replicas)

    def detach(self, replica: str, lease_s: float = REPLICA_LEASE_S) -> list[str]:
        """A replica leaves; returns the replicas still attached (those that polled within `lease_s`)."""
        with self._replicas_lock:
            self._replicas.pop(replica, None)
            now = time.monotonic()
            self._replicas = {r: seen for r, seen in self._replicas.items() if now - seen <= lease_s}
            return sorted(self._replicas)

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """Finish the current step (and gate), save the state, and return the final figures."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()


RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def join_auth_env(address: str | None, environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """The environment entry that lets ``ray.init(address=...)`` join a cluster with token auth on.

    Ray 2.60 turns token authentication on by default for clusters it starts (``ray start --head``
    writes the token to ``~/.ray/auth_token``), but a client turns it on by itself only for
    ``address`` None or "auto": with an explicit ``host:port`` the GCS refuses it ("Authentication
    token is missing or incorrect"). Where the user has not chosen (``RAY_AUTH_MODE`` unset) and a
    token is available where Ray looks for one (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``), this returns ``{"RAY_AUTH_MODE": "token"}``, what "auto" would do; a
    cluster with authentication disabled accepts such a client too. Otherwise nothing.
    """
    if address in (None, "auto") or environ.get(RAY_AUTH_MODE_ENV) is not None:
        return {}
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    has_token = bool(environ.get("RAY_AUTH_TOKEN")) or (
        Path(path).is_file() if path else (home / ".ray" / "auth_token").is_file())
    return {RAY_AUTH_MODE_ENV: "token"} if has_token else {}


def init_ray(ocfg) -> None:
    """Join ``online.ray_address`` (with token authentication where a token is available), or start
    a local Ray node sized to the trainer, not to the machine. Nothing when Ray is already up."""
    join_or_start_ray(ocfg.ray_address, num_cpus=ocfg.num_cpus, num_gpus=ocfg.num_gpus)


def join_or_start_ray(address: str | None, *, num_cpus: float, num_gpus: float,
                      resources: Mapping[str, float] | None = None) -> None:
    """Join the Ray cluster at ``address`` (with token authentication where a token is available), or,
    for None, start a local Ray node of ``num_cpus``, ``num_gpus`` and custom ``resources``, not the
    machine's. Nothing when Ray is already up."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {}
    if address is None:
        kwargs = {"num_cpus": max(1, math.ceil(num_cpus)), "num_gpus": math.ceil(num_gpus),
                  "resources": dict(resources or {}), "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
                  "_system_config": {"gcs_rpc_server_reconnect_timeout_s": LOCAL_GCS_RECONNECT_S}}
    else:
        kwargs = {"namespace": NAMESPACE}  # where every replica finds the one trainer by name
        auth = join_auth_env(address, os.environ, Path.home())
        if auth:
            logger.info("joining Ray at %s with token authentication (the token `ray start` saved)", address)
            os.environ.update(auth)
            # ray reads RAY_AUTH_MODE into its cached config at import: re-read it, as ray's own
            # "auto" path does (authentication_token_setup._enable_token_auth)
            from ray._raylet import Config

            Config.initialize("")
    # "local", not None: None makes ray.init look for a cluster to join (RAY_ADDRESS, the last `ray start`,
    # or any gcs_server process found by reading every process's command line)
    ray.init(address=address or "local", ignore_reinit_error=True, include_dashboard=False,
             logging_level=logging.WARNING, **kwargs)


def start_trainer(cfg: OnlineOPDConfig, *, target_path: Path, buffer_dir: Path | str, registry_dir: Path,
                  state_dir: Path, name: str = ACTOR_NAME, replica: str | None = None):
    """Create the trainer actor (starting a local Ray, or joining ``online.ray_address``, if needed).

    Local Ray: the actor lives and dies with this driver. On a cluster (``online.ray_address``) there
    is one trainer for every replica: a named, detached actor in the ``online-opd`` namespace, which
    the first replica creates and later ones find (``get_if_exists``); each attaches as `replica`
    (ValueError when its buffer or registry is not the trainer's) and ``stop_trainer`` stops it only
    when the last replica leaves. With ``trainer.num_workers > 1`` the actor trains on that many Ray Train
    workers (serve/trainer_online_dp.py). Returns with the actor handle; the actor loads the models and starts
    training by itself. A failure to start shows up as ``trainer_stats`` returning None.
    """
    ocfg = cfg.online
    if cfg.trainer.num_workers > 1:  # a local Ray holds the actor and its Ray Train workers
        from serve.trainer_online_dp import worker_resources

        workers = worker_resources(cfg)
        join_or_start_ray(ocfg.ray_address, num_cpus=ocfg.num_cpus + workers.pop("CPU"),
                          num_gpus=ocfg.num_gpus + workers.pop("GPU", 0.0), resources=workers)
    init_ray(ocfg)
    actor_cls = ray.remote(num_cpus=ocfg.num_cpus, num_gpus=ocfg.num_gpus, max_restarts=ocfg.max_restarts,
                           max_task_retries=ocfg.max_restarts, max_concurrency=4)(TrainerActor)
    shared = ocfg.ray_address is not None
    options = {"name": name, **({"lifetime": "detached", "get_if_exists": True} if shared else {})}
    handle = actor_cls.options(**options).remote(
        cfg.model_dump(mode="json"), str(target_path), str(buffer_dir), str(registry_dir), str(state_dir))
    if shared and replica is not None:
        replicas = ray.get(handle.attach.remote(replica, str(buffer_dir), str(registry_dir)))
        logger.info("online trainer actor %r on the cluster trains for replicas %s (this one: %s)",
                    name, replicas, replica)
    else:
        logger.info("started online trainer actor %r (%g CPUs, %g GPUs, state %s)", name, ocfg.num_cpus,
                    ocfg.num_gpus, state_dir)
    return handle


def trainer_stats(handle, timeout: float = 5.0) -> dict[str, Any] | None:
    """The actor's ``stats()``, or None when it cannot answer in time (starting, restarting, dead)."""
    try:
        return ray.get(handle.stats.remote(), timeout=timeout)
    except Exception as exc:
        logger.debug("trainer stats unavailable: %r", exc)
        return None


def stop_trainer(handle, timeout: float = 60.0, replica: str | None = None) -> dict[str, Any] | None:
    """Stop training (the state is saved), then end the actor; returns its last figures, or None.
    With `replica` (a shared trainer on a cluster): detach it, and stop only when none is left."""
    if replica is not None:
        try:
            others = ray.get(handle.detach.remote(replica), timeout=timeout)
        except Exception as exc:
            logger.warning("could not detach from the online trainer: %r", exc)
            return None
        if others:
            logger.info("online trainer keeps running for replicas %s", others)
            return trainer_stats(handle)
    final = None
    try:
        final = ray.get(handle.stop.remote(timeout), timeout=timeout + 10)
    except Exception as exc:
        logger.warning("online trainer did not stop cleanly: %r", exc)
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:
        logger.debug("killing the trainer actor: %r", exc)
    # ray.kill is asynchronous: return only once the actor no longer answers
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and trainer_stats(handle, timeout=2.0) is not None:
        time.sleep(0.2)
    return final
