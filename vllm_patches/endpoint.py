"""``vllm.endpoint_plugins`` entry point: online-opd's HTTP surface in vLLM's API server.

- ``/metrics`` gains the ``online_opd_*`` series (vllm_patches/metrics.py): capture
  and buffer figures polled from the engine with ``collective_rpc`` every few
  seconds, reload counts and durations observed here.
- ``POST /online-opd/v1/reload`` (admin) hot-loads a drafter checkpoint:
  ``{"path": DIR}`` or ``{"version": "v0003"}`` (from the registry), with an
  optional ``"sha256"`` of its weights file (default: the manifest's). It is
  registered only when the admin token variable is set, and every call must
  carry ``Authorization: Bearer <token>``. ``GET /online-opd/v1/status`` (admin)
  returns the engine's drafter version, reload and capture figures (and the
  speculation policy's, under ``speculation``).
- The reloader (``serve.auto_reload``) follows the registry's CURRENT: it loads
  a new version, runs the live check (online_opd/release/live_check.py) on the
  per-poll windows of vLLM's counters against the previous version's, stores
  the figures in the manifest's ``live_check`` and, on "roll back", rolls back
  that version only if it is still CURRENT (``rollback(expected_current=...)``;
  otherwise it is only marked bad). An admin reload pins its drafter: the
  reloader leaves it serving until CURRENT next changes, then follows CURRENT.
  The pin is kept in the engine beside the version (``online_opd_status``), so
  it holds whichever API server took the admin call.
  A CURRENT it cannot read or serve (torn, hand-edited, naming a missing
  version) is counted (``online_opd_registry_errors_total``) and repaired by
  the registry's ``check()`` (``online_opd_registry_repairs_total``).
- A checkpoint is hashed and its tensors checked in this process, in a thread,
  before the reload RPC (``worker_ext.verify_for_reload``); the worker only
  stats the weights file against that check, compares the config and loads.
- Every reload (admin or the reloader) runs between engine steps with the engine
  paused and its prefix cache reset, so no drafter K/V computed by the old
  weights are drafted over after it (``OnlineOPDService._reload_paused``).
- With ``serve.speculation: auto`` the speculation policy loop
  (vllm_patches/speculation_loop.py) sets the engine's K per batch size from the
  measured step costs and the serving drafter's acceptance, periodically and
  after every reload; its figures are the ``online_opd_spec_*`` and
  ``online_opd_policy_*`` series.

- With several API servers (``--api-server-count N``; data parallelism starts
  one per rank) each is a process with its own plugin object. API server 0
  alone polls the engine and runs the reloader, the live check and the policy
  loop; the others serve the admin routes. Their /metrics is prometheus-client's
  multiprocess view, so API server 0 mirrors its collectors into it
  (``MultiprocessMirror``), and the trainer's figures come from the file the
  server's trainer supervisor writes (``trainer_stats_file``).

vLLM loads endpoint plugins only when they are named in ``VLLM_PLUGINS``;
``online-opd serve`` does that. Settings come as JSON in ``ONLINE_OPD_SERVE``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from vllm_patches import SERVE_ENV
from vllm_patches.engine_poll import (
    ACTIVITY_SERIES,
    SPEC_SERIES,
    PollPacer,
    engine_activity,
    sample_sums,
    spec_totals,
)
from vllm_patches.metrics import (
    NGRAM_FALLBACK_COUNTERS,
    PolledCollector,
    ServedAcceptance,
    SpeculationCollector,
    TrainerCollector,
    drafter_totals,
    server_metrics,
)
from vllm_patches.metrics_multiprocess import MultiprocessMirror, is_multiprocess
from vllm_patches.reloader import RegistryFollower
from vllm_patches.speculation_loop import PolicySettings, SpeculationPolicyLoop

logger = logging.getLogger("online_opd.endpoint")

ROUTE_PREFIX = "/online-opd/v1"
TRAINER_STALE_S = 20.0  # a trainer stats file this old: the trainer counts as down

#: Reads the online trainer's stats (None while it cannot answer). `online-opd serve` installs it in
#: this process; the hook layer never imports the serving layer, it is handed a plain callable.
_TRAINER_STATS: Callable[[], dict | None] | None = None


def set_trainer_stats(read_stats: Callable[[], dict | None] | None) -> None:
    global _TRAINER_STATS
    _TRAINER_STATS = read_stats


def read_trainer_stats_file(path: str | Path, stale_s: float = TRAINER_STALE_S) -> dict | None:
    """The trainer's figures the server's supervisor writes each second (serve/trainer_process.py),
    for API servers in processes of their own; ``up`` False once older than ``stale_s``; None while
    there is no readable file."""
    try:
        stats = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(stats, dict):
        return None
    if time.time() - float(stats.pop("at", 0.0)) > stale_s:
        return {"up": False, "restarts": stats.get("restarts")}
    return stats


#: capture and writer counters: summed over engines (data parallelism runs one capture per engine)
_SUMMED = ("requests_seen", "captured", "dropped", "opted_out", "not_sampled", "blocks", "teacher_blocks",
           "path_teacher_rows", "hidden_records", "hidden_rows", "hidden_over_limit", "errors", "in_flight", "submitted",
           "written_records", "written_segments", "write_errors", "held", "queued")
#: figures of the shared buffer folder each writer tallies whole: the largest is the freshest
_LARGEST = ("buffer_bytes", "buffer_segments")


def merge_engine_statuses(per_engine: list[dict]) -> dict | None:
    """One status from every engine's ``online_opd_status`` (one per data-parallel rank): engine 0's
    version and path, capture and writer counters summed, buffer figures the largest; ``versions``
    lists them all when the engines disagree (a reload that failed on some)."""
    if not per_engine:
        return None
    first = per_engine[0]
    captures = [e["capture"] for e in per_engine if e.get("capture")]
    out = dict(first)
    if captures:
        out["capture"] = _merge_counts(captures)
        writers = [c["writer"] for c in captures if c.get("writer")]
        if writers:
            out["capture"]["writer"] = _merge_counts(writers)
    fallbacks = [e["ngram_fallback"] for e in per_engine if e.get("ngram_fallback")]
    if fallbacks:
        out["ngram_fallback"] = dict(fallbacks[0], **{
            key: sum(f.get(key) or 0 for f in fallbacks) for key in NGRAM_FALLBACK_COUNTERS})
    versions = [e.get("version") for e in per_engine]
    if len(set(versions)) > 1:
        out["versions"] = versions
    return out


def _merge_counts(parts: list[dict]) -> dict:
    out = dict(parts[0])
    for key in _SUMMED:
        if any(key in p for p in parts):
            out[key] = sum(p.get(key) or 0 for p in parts)
    for key in _LARGEST:
        if any(key in p for p in parts):
            out[key] = max(p.get(key) or 0 for p in parts)
    return out


def api_server_rank(engine_client: Any) -> tuple[int, int]:
    """(this API server's index, the number of API servers) from vLLM's engine-core client."""
    core = getattr(engine_client, "engine_core", None)
    return int(getattr(core, "client_index", 0)), int(getattr(core, "client_count", 1))


SHUTDOWN_FLUSH_S = 10.0  # most seconds the engine's shutdown waits for the workers to write their records
SHUTDOWN_COSTS_S = 5.0  # most seconds it waits for the engine's step-cost table (stored for the next start)


class EndpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    admin_token_env: str = "ONLINE_OPD_ADMIN_TOKEN"
    stats_poll_s: float = 5.0
    stats_settle_s: float = 30.0
    stats_idle_poll_s: float = 60.0
    registry_dir: str | None = None
    auto_reload: bool = False
    reload_poll_s: float = 5.0
    live_check_drafts: int = 1000
    live_check_min_windows: int = 20
    live_check_alpha: float = 0.01
    live_check_timeout_s: float = 600.0
    rollback_tolerance: float = 0.02
    policy: PolicySettings | None = None  # serve.speculation auto: the policy loop (speculation_loop.py)
    trainer_stats_file: str | None = None  # written by the server's trainer supervisor (read_trainer_stats_file)

    @classmethod
    def from_env(cls) -> "EndpointSettings":
        raw = os.environ.get(SERVE_ENV)
        return cls.model_validate(json.loads(raw)) if raw else cls()


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    version: str | None = None
    sha256: str | None = None


class OnlineOPDService(RegistryFollower):
    """Engine access shared by the admin routes, /metrics and the reloader."""

    def __init__(self, engine_client: Any, settings: EndpointSettings):
        from prometheus_client.registry import Collector
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        self.engine = engine_client
        self.settings = settings
        self.latest: dict | None = None
        self.trainer: dict | None = None
        self.served = ServedAcceptance()
        self._reload_lock = asyncio.Lock()
        self._is_registry_broken = False  # CURRENT unusable and check() could not repair it (logged once)
        self._prom = get_prometheus_registry()
        self.metrics = server_metrics(self._prom)
        self.rank, self.num_api_servers = api_server_rank(engine_client)
        self.speculation: SpeculationPolicyLoop | None = None
        self._first_poll = asyncio.Event()  # set after the first status poll, answered or not
        self.mirror: MultiprocessMirror | None = None
        self._tasks: list[asyncio.Task] = []
        if self.rank != 0:
            logger.info("API server %d of %d: admin routes only (API server 0 polls, reloads and sets the "
                        "speculation schedule)", self.rank, self.num_api_servers)
            return
        served = self.served

        class _Served(Collector):
            def collect(self):
                yield served.collect_family()

        collectors = [PolledCollector(lambda: self.latest), TrainerCollector(lambda: self.trainer), _Served()]
        if settings.policy is not None:
            self.speculation = SpeculationPolicyLoop(
                engine_client, settings.policy, lambda: (self.version, (self.latest or {}).get("path")),
                ready=self._first_poll)
            collectors.append(SpeculationCollector(lambda: self.speculation.latest))
        self._start(collectors)

    def _start(self, collectors: list) -> None:
        """API server 0: expose the collectors (mirrored in multiprocess mode) and start the loops."""
        if is_multiprocess():
            self.mirror = MultiprocessMirror(collectors)
            logger.info("API server 0 of %d polls the engine, runs the reloader and mirrors online-opd's "
                        "figures into the multiprocess /metrics", self.num_api_servers)
        else:
            for collector in collectors:
                self._prom.register(collector)
        loop = asyncio.get_running_loop()
        self._flush_before_shutdown(loop)
        self._tasks.append(loop.create_task(self._poll_forever()))
        if self.settings.auto_reload and self.settings.registry_dir:
            self._tasks.append(loop.create_task(self._reload_forever()))
        if self.speculation is not None:
            self._tasks.append(loop.create_task(self.speculation.run_forever()))

    def _flush_before_shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        """On SIGTERM / SIGINT to this process alone vLLM's API server stops the engine client from a
        thread, which kills the engine core and the worker processes outright: the records their buffer
        writers held (up to ``capture.flush_interval_s`` of them) were lost. So the engine client's
        ``shutdown`` first asks every worker to write them (``online_opd_flush_capture``, at most
        ``SHUTDOWN_FLUSH_S``), then stops the engine as before. Requests still running are aborted by
        vLLM and leave no record. (A SIGTERM to the whole process group reaches the engine and the workers
        too, and this call may find the engine gone: then each worker writes its records as it stops,
        capture.py ``_close_on_worker_shutdown``.) Then the speculation policy stores the engine's step-cost
        table (``save_before_shutdown``, at most ``SHUTDOWN_COSTS_S``), so the next server starts from
        every step this one timed."""
        original = getattr(self.engine, "shutdown", None)
        if original is None:
            return

        def shutdown(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            if not on_loop and loop.is_running():  # vLLM's way: from an executor thread
                try:
                    results = asyncio.run_coroutine_threadsafe(
                        self.rpc_all("online_opd_flush_capture", (SHUTDOWN_FLUSH_S,)), loop).result(
                            SHUTDOWN_FLUSH_S + 5)
                    written = [r for workers in results for r in workers if r is not None]
                    logger.info("online-opd: captured records written before shutdown (%s)",
                                ", ".join(f"{r.get('captured', 0)} captured, written: {r['written']}"
                                          for r in written) or "nothing captured")
                except Exception as exc:  # the engine may be stopping already (a process-group signal)
                    logger.info("online-opd: no record flush through the engine before shutdown (%r); the "
                                "workers write theirs as they stop", exc)
                if self.speculation is not None:
                    try:
                        asyncio.run_coroutine_threadsafe(
                            self.speculation.save_before_shutdown(SHUTDOWN_COSTS_S), loop).result(
                                SHUTDOWN_COSTS_S + 5)
                    except Exception as exc:
                        logger.warning("online-opd: speculation step costs not saved before shutdown: %r", exc)
            return original(*args, **kwargs)

        self.engine.shutdown = shutdown

    @property
    def version(self) -> str | None:
        return (self.latest or {}).get("version")

    async def rpc_all(self, method: str, args: tuple = ()) -> list[list[dict]]:
        """``collective_rpc`` on every engine, one list of worker results per engine. With data
        parallelism vLLM's own ``collective_rpc`` reaches every engine but returns engine 0's only."""
        call_all = getattr(getattr(self.engine, "engine_core", None), "call_utility_all_async", None)
        if call_all is None:
            return [await self.engine.collective_rpc(method, args=args)]
        return list(await call_all("collective_rpc", method, None, args, None))

    async def engine_status(self) -> dict | None:
        per_engine = []
        for workers in await self.rpc_all("online_opd_status"):
            # the capturing rank reports capture figures; any rank reports the version
            status = next((r for r in workers if r.get("capture")), workers[0] if workers else None)
            if status is not None:
                per_engine.append(status)
        return merge_engine_statuses(per_engine)

    async def status(self) -> dict | None:
        self.latest = await self.engine_status()
        self.served.update(self.version, *drafter_totals(spec_totals(self._prom), self.latest))
        return self.latest

    async def _poll_forever(self) -> None:
        pacer = PollPacer(self.settings.stats_settle_s, self.settings.stats_idle_poll_s)
        while True:
            try:
                sums = sample_sums(self._prom, (*ACTIVITY_SERIES, *SPEC_SERIES))
                if pacer.due(time.monotonic(), engine_activity(sums)):
                    await self.status()  # reads vLLM's counters again, after the workers answered
                    pacer.polled(time.monotonic())
                else:  # an idle engine: its workers' figures did not move, vLLM's counters are local
                    totals = tuple(sums[name] for name in SPEC_SERIES)
                    self.served.update(self.version, *drafter_totals(totals, self.latest))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics["poll_errors"].inc()
                logger.warning("online-opd status poll failed: %s", exc)
            self._first_poll.set()
            await self._read_trainer()
            if self.mirror is not None:
                self.mirror.update()
            await asyncio.sleep(self.settings.stats_poll_s)

    async def _read_trainer(self) -> None:
        if _TRAINER_STATS is not None:  # the trainer's supervisor lives in this process
            self.trainer = await asyncio.to_thread(_TRAINER_STATS)
        elif self.settings.trainer_stats_file:
            self.trainer = await asyncio.to_thread(read_trainer_stats_file, self.settings.trainer_stats_file)

    async def _reload_paused(self, path: Path, sha256: str | None, verified: dict,
                             pinned_current: str | None) -> list[dict]:
        """The reload RPC at a clean version boundary: vLLM's weight-update pause.

        The drafter's context K/V live in the paged KV cache beside the target's (computed once per
        token from the target's features, with the drafter weights of that moment) and are shared
        through the prefix cache. Loaded mid-flight, new weights would draft over the old ones' K/V
        for every running request and every later prefix-cache hit. So the engine is paused between
        steps (``keep``: requests stay queued, the in-flight step is drained), its prefix cache reset
        (preempting every running request, whose K/V are then recomputed on resume with the new
        weights), the weights loaded, and the engine resumed, even when the load fails.
        """
        await self.engine.pause_generation(mode="keep", clear_cache=True)
        try:
            per_engine = await self.rpc_all("online_opd_reload", (str(path), sha256, verified, True, pinned_current))
            return [result for workers in per_engine for result in workers]
        finally:
            await self.engine.resume_generation()

    async def reload(self, path: str | Path, sha256: str | None = None,
                     pinned_current: str | None = None) -> dict:
        """Hot-load a checkpoint in every worker; the result says which version serves now.
        ``pinned_current``: an admin reload's pin (``admin_pin``); None clears any pin.

        The files are hashed and the tensors checked here, in a thread of the API server, so the
        engine step that runs the RPC only stats the weights file and loads it (worker_ext.py).
        """
        from vllm_patches.worker_ext import ReloadError, verify_for_reload

        path = Path(path).resolve()
        start = time.perf_counter()
        try:
            verified = await asyncio.to_thread(verify_for_reload, path, sha256)
        except (ReloadError, OSError) as exc:
            self.metrics["reloads"].labels("refused").inc()
            logger.error("drafter reload refused before the engine saw it, still serving %s: %s",
                         self.version, exc)
            return {"ok": False, "result": "refused", "error": str(exc), "version": self.version,
                    "engine_seconds": 0.0, "rpc_seconds": 0.0, "check_seconds": time.perf_counter() - start,
                    "path": str(path)}
        checked = time.perf_counter()
        async with self._reload_lock:
            # close the old version's window
            self.served.update(self.version, *drafter_totals(spec_totals(self._prom), self.latest))
            rpc_start = time.perf_counter()
            results = await self._reload_paused(path, sha256, verified, pinned_current)
            wall = time.perf_counter() - rpc_start
        bad = [r for r in results if not r.get("ok")]
        result = bad[0]["result"] if bad else "ok"
        self.metrics["reloads"].labels(result).inc()
        engine_seconds = max(float(r.get("seconds", 0.0)) for r in results)
        if not bad:
            self.metrics["reload_seconds"].observe(engine_seconds)
        in_flight = [r["in_flight"] for r in results if r.get("in_flight") is not None]
        out = {"ok": not bad, "result": result, "version": results[0].get("version"),
               "engine_seconds": engine_seconds, "rpc_seconds": wall, "check_seconds": checked - start,
               "path": str(path), "requests_in_flight": max(in_flight) if in_flight else None}
        if bad:
            out["error"] = bad[0].get("error")
        try:
            await self.status()
        except Exception as exc:  # the reload result stands even if the refresh fails
            logger.warning("status refresh after reload failed: %s", exc)
        if self.speculation is not None:
            self.speculation.wake()  # the schedule follows the new drafter's acceptance
        return out


class OnlineOPDEndpoints:
    """The endpoint plugin object vLLM instantiates (see vllm/plugins/endpoint_plugins)."""

    name = "online_opd_endpoints"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.settings = EndpointSettings.from_env()
        self.token = os.environ.get(self.settings.admin_token_env) or None

    def attach_router(self, app) -> None:
        if self.token is None:
            logger.info("online-opd admin routes off (%s is not set)", self.settings.admin_token_env)
            return
        token = self.token

        def admin(request: Request) -> None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HTTPException(status_code=401, detail="online-opd admin token required")

        router = APIRouter(prefix=ROUTE_PREFIX, dependencies=[Depends(admin)])

        @router.post("/reload")
        async def reload(body: ReloadRequest, request: Request):
            service: OnlineOPDService = request.app.state.online_opd
            if (body.path is None) == (body.version is None):
                raise HTTPException(status_code=400, detail="give exactly one of 'path' or 'version'")
            path, sha = body.path, body.sha256
            if body.version is not None:
                if not service.settings.registry_dir:
                    raise HTTPException(status_code=400, detail="no drafter registry configured")
                from online_opd.release.registry import DrafterRegistry, RegistryError

                try:
                    registry = DrafterRegistry(service.settings.registry_dir)
                    path, sha = str(registry.path(body.version)), sha or registry.weights_sha256(body.version)
                except RegistryError as exc:
                    raise HTTPException(status_code=404, detail=str(exc)) from exc
            pinned = await service.admin_pin()
            result = await service.reload(path, sha, pinned_current=pinned)
            if result["ok"] and pinned is not None:
                logger.info("admin reload: %s serves until the registry's CURRENT moves from %s",
                            result["version"], pinned or "(none)")
            code = 200 if result["ok"] else (422 if result["result"] == "refused" else 500)
            return JSONResponse(result, status_code=code)

        @router.get("/status")
        async def status(request: Request):
            service: OnlineOPDService = request.app.state.online_opd
            body = await service.status() or {}
            if service.speculation is not None:  # the policy's latest figures (speculation_loop.py)
                body = {**body, "speculation": service.speculation.latest}
            return JSONResponse(body)

        app.include_router(router)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        if engine_client is None:
            return
        from vllm_patches.model_runner import check_v1_runner

        check_v1_runner(engine_client.vllm_config)  # stops the server: the hooks need the V1 runner
        state.online_opd = OnlineOPDService(engine_client, self.settings)
