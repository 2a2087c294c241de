"""``vllm.endpoint_plugins`` entry point: online-opd's HTTP surface in vLLM's API server.

- ``/metrics`` gains the ``online_opd_*`` series (vllm_patches/metrics.py): capture
  and buffer figures polled from the engine with ``collective_rpc`` every few
  seconds, reload counts and durations observed here.
- ``POST /online-opd/v1/reload`` (admin) hot-loads a drafter checkpoint:
  ``{"path": DIR}`` or ``{"version": "v0003"}`` (from the registry), with an
  optional ``"sha256"`` of its weights file (default: the manifest's). It is
  registered only when the admin token variable is set, and every call must
  carry ``Authorization: Bearer <token>``. ``GET /online-opd/v1/status`` (admin)
  returns the engine's drafter version, reload and capture figures.

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

from online_opd.models.drafters.checkpoint import WEIGHTS_FILE, read_manifest
from vllm_patches.metrics import (
    PolledCollector,
    ServedAcceptance,
    TrainerCollector,
    server_metrics,
    spec_totals,
)

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
    live_check_drafts: int = 200
    live_check_timeout_s: float = 600.0
    rollback_tolerance: float = 0.05

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
        from online_opd.release.registry import DrafterRegistry

        registry = DrafterRegistry(self.settings.registry_dir)
        while True:
            await asyncio.sleep(self.settings.reload_poll_s)
            try:
                await self._follow(registry)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("reloader iteration failed (serving continues)")

    async def _follow(self, registry) -> None:
        current = await asyncio.to_thread(registry.current)
        if current is None or self.version is None or current.version == self.version:
            return
        old = self.version
        baseline, base_drafts = self.served.recent_tau(old, self.settings.live_check_drafts)
        result = await self.reload(current.path, await asyncio.to_thread(registry.weights_sha256,
                                                                         current.version))
        if not result["ok"]:
            reason = f"hot reload {result['result']}: {result.get('error')}"
            await asyncio.to_thread(registry.rollback, reason)
            self.metrics["rollbacks"].inc()
            logger.error("version %s could not be loaded, rolled back: %s", current.version, reason)
            return
        start = self.served.mark(current.version)
        deadline = time.monotonic() + self.settings.live_check_timeout_s
        tau, drafts = None, 0.0
        while time.monotonic() < deadline:
            await asyncio.sleep(self.settings.stats_poll_s)
            tau, drafts = self.served.since_tau(current.version, start)
            if drafts >= self.settings.live_check_drafts or self.version != current.version:
                break
        check = {"tau": tau, "drafts": drafts, "baseline_version": old, "baseline_tau": baseline,
                 "baseline_drafts": base_drafts, "tolerance": self.settings.rollback_tolerance}
        if (tau is not None and baseline is not None and drafts >= self.settings.live_check_drafts
                and tau < baseline * (1.0 - self.settings.rollback_tolerance)):
            reason = f"live tau {tau:.3f} < {baseline:.3f} of {old} (tolerance {self.settings.rollback_tolerance})"
            check["result"] = "rolled_back"
            await asyncio.to_thread(registry.set_metrics, current.version, "live_check", check)
            await asyncio.to_thread(registry.rollback, reason)
            self.metrics["rollbacks"].inc()
            logger.warning("rolled back %s: %s", current.version, reason)
        else:
            check["result"] = "kept" if drafts >= self.settings.live_check_drafts else "inconclusive"
            await asyncio.to_thread(registry.set_metrics, current.version, "live_check", check)
            logger.info("live check of %s: %s (tau %s over %d drafts, %s had %s)", current.version,
                        check["result"], tau, drafts, old, baseline)

    async def reload(self, path: str | Path, sha256: str | None = None) -> dict:
        """Hot-load a checkpoint in every worker; the result says which version serves now."""
        path = Path(path).resolve()
        if sha256 is None:
            sha256 = read_manifest(path).get("files", {}).get(WEIGHTS_FILE)
        async with self._reload_lock:
            self.served.update(self.version, *spec_totals(self._prom))  # close the old version's window
            start = time.perf_counter()
            results = await self.engine.collective_rpc("online_opd_reload", args=(str(path), sha256))
            wall = time.perf_counter() - start
        bad = [r for r in results if not r.get("ok")]
        result = bad[0]["result"] if bad else "ok"
        self.metrics["reloads"].labels(result).inc()
        engine_seconds = max(float(r.get("seconds", 0.0)) for r in results)
        if not bad:
            self.metrics["reload_seconds"].observe(engine_seconds)
        out = {"ok": not bad, "result": result, "version": results[0].get("version"),
               "engine_seconds": engine_seconds, "rpc_seconds": wall, "path": str(path)}
        if bad:
            out["error"] = bad[0].get("error")
        try:
            await self.status()
        except Exception as exc:  # the reload result stands even if the refresh fails
            logger.warning("status refresh after reload failed: %s", exc)
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
            code = 200 if result["ok"] else (422 if result["result"] == "refused" else 500)
            return JSONResponse(result, status_code=code)

        @router.get("/status")
        async def status(request: Request):
            service: OnlineOPDService = request.app.state.online_opd
            return JSONResponse(await service.status())

        app.include_router(router)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        if engine_client is None:
            return
        state.online_opd = OnlineOPDService(engine_client, self.settings)
