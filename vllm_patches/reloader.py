"""The reloader: follow the registry's CURRENT, hot-load it, check it live, roll back (endpoint.py).

``RegistryFollower`` is a part of ``OnlineOPDService`` (vllm_patches/endpoint.py), which supplies
``settings`` (``EndpointSettings``), ``metrics`` (``server_metrics``), ``served``
(``ServedAcceptance``), ``latest``, ``num_api_servers``, ``engine_status()``, ``reload()`` and
``version``. API server 0 alone runs
it (``_reload_forever``). A new CURRENT is loaded unless the engine serves it already or an admin
reload pinned the drafter to it; the live check compares the new version's per-poll windows of
vLLM's spec-decode counters with the previous version's, stores its figures in the manifest's
``live_check`` and, on "roll back", rolls back that version only while it is still CURRENT
(``rollback(expected_current=...)``), else only marks it bad. A CURRENT that cannot be read or
served is counted and repaired by the registry's ``check()``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from online_opd.release.live_check import UNDECIDED, LiveCheck, decide_live_check, has_enough

logger = logging.getLogger("online_opd.endpoint")


class RegistryFollower:
    """The reloader's half of ``OnlineOPDService`` (module docstring)."""

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

    async def admin_pin(self) -> str | None:
        """For an admin reload: the registry's CURRENT now, which its drafter is pinned to (the reloader
        leaves it serving until CURRENT moves from it; ``""``: no CURRENT yet); None without a reloader."""
        if not (self.settings.auto_reload and self.settings.registry_dir):
            return None
        from online_opd.release.registry import DrafterRegistry

        current = await asyncio.to_thread(DrafterRegistry(self.settings.registry_dir).current)
        return current.version if current is not None else ""

    async def _follow(self, registry) -> None:
        current = await asyncio.to_thread(registry.current)
        if current is None:
            return
        # with one API server every reload went through this process, which refreshed ``latest``; with
        # several, another one may have reloaded (and pinned) the engine: ask it
        engine = (self.latest if self.num_api_servers == 1 else await self.engine_status()) or {}
        old, pinned = engine.get("version"), engine.get("pinned_current")
        if old is None or current.version in (old, pinned):
            return
        result = await self.reload(current.path, await asyncio.to_thread(registry.weights_sha256,
                                                                         current.version))
        if not result["ok"]:
            reason = f"hot reload {result['result']}: {result.get('error')}"
            await self._roll_back(registry, current.version, reason)
            return
        check = await self._live_check(registry, current.version, old)
        await self._conclude(registry, current.version, old, check)

    async def _live_check(self, registry, version: str, old: str) -> LiveCheck | None:
        """Poll until the test decides or the timeout; None when another reload replaced ``version`` or
        the registry's CURRENT moved away from it (another replica rolled it back, or the trainer
        promoted a newer one): the reloader then follows CURRENT at once, not after the timeout."""
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
            if self.version != version or await self._current_moved(registry, version):
                return None

    async def _current_moved(self, registry, version: str) -> bool:
        from online_opd.release.registry import RegistryError

        try:
            current = await asyncio.to_thread(registry.current)
        except RegistryError:
            return False  # the next _follow counts and repairs it
        return current is None or current.version != version

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
                        check.reason if check is not None else "another reload or a move of CURRENT replaced it")

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
