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

from online_opd.release.live_check import UNDECIDED, LiveCheck, decide_live_check, has_enough
from vllm_patches.metrics import (
    PolledCollector,
    ServedAcceptance,
    SpeculationCollector,
    TrainerCollector,
    server_metrics,
    spec_totals,
)
from vllm_patches.speculation_loop import PolicySettings, SpeculationPolicyLoop

logger = logging.getLogger("online_opd.endpoint")

SERVE_ENV = "ONLINE_OPD_SERVE"
ROUTE_PREFIX = "/online-opd/v1"

#: Reads the online trainer's stats (None while it cannot answer). `online-opd serve` installs it in
#: this process; the hook layer never imports the serving layer, it is handed a plain callable.
_TRAINER_STATS: Callable[[], dict | None] | None = None


def set_trainer_stats(read_stats: Callable[[], dict | None] | None) -> None:
    global _TRAINER_STATS
    _TRAINER_STATS = read_stats


class EndpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    admin_token_env: str = "ONLINE_OPD_ADMIN_TOKEN"
    stats_poll_s: float = 5.0
    registry_dir: str | None = None
    auto_reload: bool = False
    reload_poll_s: float = 5.0
    live_check_drafts: int = 1000
    live_check_min_windows: int = 20
    live_check_alpha: float = 0.01
    live_check_timeout_s: float = 600.0
    rollback_tolerance: float = 0.02
    policy: PolicySettings | None = None  # serve.speculation auto: the policy loop (speculation_loop.py)

    @classmethod
    def from_env(cls) -> "EndpointSettings":
        raw = os.environ.get(SERVE_ENV)
        return cls.model_validate(json.loads(raw)) if raw else cls()


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    version: str | None = None
    sha256: str | None = None


class OnlineOPDService:
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
        self._pinned_current: str | None = None  # registry CURRENT when an admin reload pinned the drafter
        self._is_registry_broken = False  # CURRENT unusable and check() could not repair it (logged once)
        self._prom = prom = get_prometheus_registry()
        self.metrics = server_metrics(prom)
        prom.register(PolledCollector(lambda: self.latest))
        prom.register(TrainerCollector(lambda: self.trainer))
        served = self.served

        class _Served(Collector):
            def collect(self):
                yield served.collect_family()

        prom.register(_Served())
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_forever())]
        if settings.auto_reload and settings.registry_dir:
            self._tasks.append(loop.create_task(self._reload_forever()))
        self.speculation: SpeculationPolicyLoop | None = None
        if settings.policy is not None:
            self.speculation = SpeculationPolicyLoop(
                engine_client, settings.policy, lambda: (self.version, (self.latest or {}).get("path")))
            prom.register(SpeculationCollector(lambda: self.speculation.latest))
            self._tasks.append(loop.create_task(self.speculation.run_forever()))

    @property
    def version(self) -> str | None:
        return (self.latest or {}).get("version")

    async def status(self) -> dict | None:
        results = await self.engine.collective_rpc("online_opd_status")
        # the capturing rank reports capture figures; any rank reports the version
        self.latest = next((r for r in results if r.get("capture")), results[0] if results else None)
        self.served.update(self.version, *spec_totals(self._prom))
        return self.latest

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.status()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics["poll_errors"].inc()
                logger.warning("online-opd status poll failed: %s", exc)
            if _TRAINER_STATS is not None:
                self.trainer = await asyncio.to_thread(_TRAINER_STATS)
            await asyncio.sleep(self.settings.stats_poll_s)

    # -- the reloader: follow the registry's current version, check it live, roll back ---------------
    async def _reload_forever(self) -> None:
        from online_opd.release.registry import DrafterRegistry, RegistryError

        registry = DrafterRegistry(self.settings.registry_dir)
        while True:
            await asyncio.sleep(self.settings.reload_poll_s)
            try:
                await self._follow(registry)
            except asyncio.CancelledError:
                raise
            except RegistryError as exc:
                await self._repair_registry(registry, exc)
            except Exception:
                logger.exception("reloader iteration failed (serving continues)")

    async def _repair_registry(self, registry, error: Exception) -> None:
        """CURRENT is unreadable or names a version that cannot be served: count it and let the
        registry's ``check()`` move CURRENT to the newest good version. An unrepairable registry is
        logged once until it can be repaired; the engine keeps serving its drafter meanwhile."""
        self.metrics["registry_errors"].inc()
        try:
            repair = await asyncio.to_thread(registry.check)
        except Exception as exc:
            if not self._is_registry_broken:
                logger.error("registry %s: %s, and check() cannot repair it: %s; still serving %s",
                             registry.root, error, exc, self.version)
            self._is_registry_broken = True
            return
        self._is_registry_broken = False
        if repair is not None:
            self.metrics["registry_repairs"].inc()
            logger.warning("registry %s: %s; repaired CURRENT %s -> %s", registry.root, error,
                           repair["from"], repair["to"])

    async def pin(self) -> None:
        """After an admin reload: the reloader leaves the drafter alone until the registry's CURRENT
        next changes (then it follows CURRENT again, and the admin's choice is replaced)."""
        if not (self.settings.auto_reload and self.settings.registry_dir):
            return
        from online_opd.release.registry import DrafterRegistry

        current = await asyncio.to_thread(DrafterRegistry(self.settings.registry_dir).current)
        self._pinned_current = current.version if current is not None else ""
        logger.info("admin reload: %s serves until the registry's CURRENT moves from %s", self.version,
                    self._pinned_current or "(none)")

    async def _follow(self, registry) -> None:
        current = await asyncio.to_thread(registry.current)
        if current is None or self.version is None or current.version == self.version:
            return
        if self._pinned_current is not None:
            if current.version == self._pinned_current:
                return
            self._pinned_current = None
        old = self.version
        result = await self.reload(current.path, await asyncio.to_thread(registry.weights_sha256,
                                                                         current.version))
        if not result["ok"]:
            reason = f"hot reload {result['result']}: {result.get('error')}"
            await self._roll_back(registry, current.version, reason)
            return
        check = await self._live_check(current.version, old)
        await self._conclude(registry, current.version, old, check)

    async def _live_check(self, version: str, old: str) -> LiveCheck | None:
        """Poll until the test decides or the timeout; None when another reload replaced ``version``."""
        s = self.settings
        baseline = self.served.recent(old, s.live_check_drafts, s.live_check_min_windows)
        start = self.served.mark(version)
        is_possible = has_enough(baseline, s.live_check_drafts, s.live_check_min_windows)
        deadline = time.monotonic() + s.live_check_timeout_s
        while True:
            check = decide_live_check(baseline, self.served.since(version, start), min_drafts=s.live_check_drafts,
                                      min_windows=s.live_check_min_windows, tolerance=s.rollback_tolerance,
                                      alpha=s.live_check_alpha)
            if check.decision != UNDECIDED or not is_possible or time.monotonic() >= deadline:
                return check  # decided, never can be (the old version served too little), or timed out
            await asyncio.sleep(s.stats_poll_s)
            if self.version != version:
                return None

    async def _conclude(self, registry, version: str, old: str, check: LiveCheck | None) -> None:
        """Store the check in the version's manifest; roll back when it says so."""
        s = self.settings
        figures = {"baseline_version": old, "alpha": s.live_check_alpha, "tolerance": s.rollback_tolerance}
        if check is None:
            figures["result"] = "interrupted"
        else:
            base, cand = check.baseline, check.candidate
            figures.update(check.to_dict(), tau=cand.tau if cand else None,
                           drafts=cand.num_drafts if cand else 0.0, baseline_tau=base.tau if base else None,
                           baseline_drafts=base.num_drafts if base else 0.0,
                           result={"keep": "kept", "roll_back": "rolled_back"}.get(check.decision, "inconclusive"))
        await asyncio.to_thread(registry.set_metrics, version, "live_check", figures)
        if check is not None and figures["result"] == "rolled_back":
            await self._roll_back(registry, version, f"live check against {old}: {check.reason}")
        else:
            logger.info("live check of %s: %s (%s)", version, figures["result"],
                        check.reason if check is not None else "another reload replaced it")

    async def _roll_back(self, registry, version: str, reason: str) -> None:
        """Roll back ``version`` if it is still CURRENT; if CURRENT moved meanwhile, only mark it bad."""
        from online_opd.release.registry import CurrentMovedError

        try:
            back = await asyncio.to_thread(registry.rollback, reason, expected_current=version)
        except CurrentMovedError as exc:
            await asyncio.to_thread(registry.mark_bad, version, f"{reason} (not rolled back: {exc})")
            logger.warning("%s failed (%s) but is no longer CURRENT: marked bad, CURRENT left alone",
                           version, reason)
            return
        self.metrics["rollbacks"].inc()
        logger.warning("rolled back %s -> %s: %s", version, back.version, reason)

    async def _reload_paused(self, path: Path, sha256: str | None, verified: dict) -> list[dict]:
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
            return await self.engine.collective_rpc("online_opd_reload",
                                                    args=(str(path), sha256, verified, True))
        finally:
            await self.engine.resume_generation()

    async def reload(self, path: str | Path, sha256: str | None = None) -> dict:
        """Hot-load a checkpoint in every worker; the result says which version serves now.

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
            self.served.update(self.version, *spec_totals(self._prom))  # close the old version's window
            rpc_start = time.perf_counter()
            results = await self._reload_paused(path, sha256, verified)
            wall = time.perf_counter() - rpc_start
        bad = [r for r in results if not r.get("ok")]
        result = bad[0]["result"] if bad else "ok"
        self.metrics["reloads"].labels(result).inc()
        engine_seconds = max(float(r.get("seconds", 0.0)) for r in results)
        if not bad:
            self.metrics["reload_seconds"].observe(engine_seconds)
        out = {"ok": not bad, "result": result, "version": results[0].get("version"),
               "engine_seconds": engine_seconds, "rpc_seconds": wall, "check_seconds": checked - start,
               "path": str(path)}
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
            result = await service.reload(path, sha)
            if result["ok"]:
                await service.pin()
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
