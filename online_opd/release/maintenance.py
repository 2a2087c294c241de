"""Registry upkeep: the repair of a CURRENT that points at a bad or missing version, and retention.

- `check()` (run at `online-opd serve` start-up, by the server's reloader when CURRENT cannot be read, and
  by `online-opd drafters check`) repairs a CURRENT naming a missing, bad or corrupt version, e.g. after a
  crash between a rollback's mark-bad and its pointer write, or a CURRENT that is not a JSON pointer at all:
  CURRENT moves to the newest version that was made current and is still good, logged and recorded as a
  `repair` event.
- Retention (`keep_unpromoted`, `serve.registry_keep_unpromoted`): after each publish, versions that
  were never made current (candidates, rejected ones, bad ones never served) beyond the newest
  `keep_unpromoted` are deleted (`prune` event). Every version ever made current is kept: it is CURRENT,
  a rollback target or a record of what served. `reserved/` keeps their names, so none is reused.

`DrafterRegistry.check()` and `DrafterRegistry.prune()` call these functions; they take the registry's
lock and work on its files through its own helpers, so they belong to it and are called through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from online_opd.files import OLD_SUFFIX, fsync_path, temp_sibling
from online_opd.release.registry import MADE_CURRENT, DrafterRegistry, RegistryError, logger

__all__ = ["check", "prune"]


def check(registry: DrafterRegistry) -> dict | None:
    """Repair a CURRENT naming a missing, bad or corrupt version, or unreadable itself (the module docstring).

    Returns ``{"from", "to", "problem"}`` after a repair, None when CURRENT is sound (or unset).
    Raises `RegistryError`, changing nothing, when no version that was made current is good.
    """
    with registry._locked():
        try:
            pointer = registry._read_current()
        except RegistryError as exc:  # not JSON, or no version in it: the newest good one made current
            pointer, problem = {"version": None}, f"is unreadable ({exc})"
        else:
            if pointer is None:
                return None
            problem = _problem_serving(registry, pointer["version"])
            if problem is None:
                return None
        version = pointer["version"]
        target, skipped = registry._previous_good(exclude=version)
        if target is None:
            raise RegistryError(
                f"CURRENT of {registry.root} is {version}, which {problem}, and no version that was made "
                f"current is good (skipped: {skipped or 'none'}): promote one by hand with "
                "`online-opd drafters promote VERSION`")
        registry._write_current(target, f"repair: {version} {problem}")
        registry._log("repair", target, reason=problem, **{"from": version})
    logger.warning("registry check: CURRENT was %s, which %s; repaired to %s", version, problem, target)
    return {"from": version, "to": target, "problem": problem}


def _problem_serving(registry: DrafterRegistry, version: str) -> str | None:
    """Why ``version`` must not be CURRENT (missing, bad, failing its hashes), or None."""
    try:
        registry._verify(version, action="serve")
    except RegistryError as exc:
        return f"cannot be served ({exc})"
    status = registry._read_status(version)
    return f"is marked bad ({status['reason']})" if status["status"] == "bad" else None


def prune(registry: DrafterRegistry) -> list[str]:
    """Retention: delete never-current versions beyond the newest ``keep_unpromoted``; returns them."""
    if registry.keep_unpromoted is None:
        return []
    with registry._locked():
        pointer = registry._read_current()
        kept = {e.get("version") for e in registry.history() if e.get("event") in MADE_CURRENT}
        kept.add(pointer["version"] if pointer else None)
        never_current = [info.version for info in registry.list()
                         if info.version not in kept and info.status != "promoted"]
        doomed = never_current[:max(0, len(never_current) - registry.keep_unpromoted)]
        for version in doomed:
            _delete(registry, version)
    if doomed:
        logger.info("registry retention: deleted %s (keeping the newest %d never-current versions)",
                    ", ".join(doomed), registry.keep_unpromoted)
    return doomed


def _delete(registry: DrafterRegistry, version: str) -> None:
    """Rename the folder aside (readers see it whole or not at all), then remove it; under the lock."""
    aside = temp_sibling(registry.path(version), OLD_SUFFIX)
    os.replace(registry.versions_dir / version, aside)
    fsync_path(registry.versions_dir)
    shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(registry.status_dir / f"{version}.json")
    registry._log("prune", version,
                  reason=f"retention keeps the newest {registry.keep_unpromoted} never-current")
