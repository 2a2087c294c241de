"""Versioned drafter registry: immutable checkpoint versions plus an atomic `CURRENT` pointer.

Layout under `root`:

- `versions/<version>/` — checkpoint folders as `save_drafter` writes them (`v0001`, `v0002`, …).
  A version is staged in a hidden sibling and renamed into place, so it is never visible half-written.
- `reserved/<version>/` — one empty folder per allocated version name. `os.mkdir` is atomic, also on
  shared storage, so two processes publishing at once never get the same name, and a name is never
  reused even if its publish failed.
- `CURRENT` — `{"version", "since", "reason"}`, replaced with tmp + fsync + `os.replace`: a reader
  polling it (the server's reloader) sees the old or the new pointer, never a torn file.
- `status/<version>.json` — `{"status", "reason", "since"}`; a version without one is a candidate.
- `history.jsonl` — append-only lifecycle events (publish, promote, reject, mark_bad, rollback, repair,
  prune), one JSON object per line with a unix `time`. Rollback finds the previous good version here.

State changes (promote, rollback, status, metrics, check, prune) hold an `fcntl.flock` on `root/.lock`,
which the kernel releases if the holder dies, so a crash never leaves the registry locked.

Safe over time:

- `rollback(reason, expected_current=v)` is a compare-and-swap: it refuses (`CurrentMovedError`,
  nothing changed) when CURRENT is no longer `v`, so a live check of `v` never rolls back a version
  promoted while it ran.
- `check()` (the start-up repair of CURRENT) and retention (`keep_unpromoted`, `prune()` after each
  publish): online_opd/release/maintenance.py.

Pure stdlib plus the checkpoint module: no vllm, no ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from online_opd.files import atomic_folder, atomic_write_json, sha256_file
from online_opd.models.drafters.checkpoint import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    read_manifest,
    verify_checkpoint,
    write_checkpoint,
)
from online_opd.models.drafters.registry import method_for_config

logger = logging.getLogger(__name__)

CURRENT_FILE = "CURRENT"
HISTORY_FILE = "history.jsonl"
LOCK_FILE = ".lock"
STATUSES = ("candidate", "promoted", "rejected", "bad")
MADE_CURRENT = ("promote", "rollback", "repair")  # history events that point CURRENT at their version
_VERSION_RE = re.compile(r"^v(\d+)$")


class RegistryError(ValueError):
    """A registry operation cannot be done: unknown version, corrupt checkpoint, nothing to roll back to."""


class CurrentMovedError(RegistryError):
    """A rollback of one version found another one current: nothing was changed."""


@dataclass
class VersionInfo:
    """One registry version as seen now (status and `is_current` can change; the weights cannot)."""

    version: str
    path: Path
    parent: str | None
    step: int
    created: float
    status: str
    is_current: bool
    metrics: dict = field(default_factory=dict)
    method: str | None = None
    status_reason: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form (path as a string)."""
        return {**asdict(self), "path": str(self.path)}


def version_name(number: int) -> str:
    return f"v{number:04d}"


def version_number(version: str) -> int | None:
    """The number of a well-formed version name, else None (hidden staging folders, typos)."""
    match = _VERSION_RE.match(version)
    return int(match.group(1)) if match else None


class DrafterRegistry:
    """Versioned drafter checkpoints under one folder; safe for several processes at once."""

    def __init__(self, root: str | Path, *, keep_unpromoted: int | None = None):
        if keep_unpromoted is not None and keep_unpromoted < 1:
            raise RegistryError(f"keep_unpromoted={keep_unpromoted}: keep at least 1 (the newest candidate "
                                "must outlive its own publish), or None to keep everything")
        self.root = Path(root)
        self.keep_unpromoted = keep_unpromoted
        self.versions_dir = self.root / "versions"
        self.reserved_dir = self.root / "reserved"
        self.status_dir = self.root / "status"

    # ---- publishing -------------------------------------------------------------------------------

    def publish(
        self,
        drafter_or_dir: nn.Module | str | Path,
        *,
        parent: str | None = None,
        step: int | None = None,
        metrics: dict | None = None,
    ) -> VersionInfo:
        """Add a drafter as a new candidate version.

        A module is written with `save_drafter`; a folder is verified against its manifest's hashes and
        copied. For a folder, `step` defaults to the source's step and `metrics` are merged over the
        source's; the source's own name is kept under `manifest["source"]`.
        """
        if parent is not None:
            self.path(parent)  # a parent must be a version of this registry
        is_dir = isinstance(drafter_or_dir, (str, Path))
        source = Path(drafter_or_dir) if is_dir else None
        source_manifest = self._check_source(source) if source is not None else {}
        version = self._reserve()
        with atomic_folder(self.versions_dir / version) as staging:
            if source is not None:
                self._copy_checkpoint(source, source_manifest, staging)
                extra = {"source": {"path": str(source.resolve()), "version": source_manifest.get("version")}}
                step = source_manifest.get("step", 0) if step is None else step
                metrics = {**source_manifest.get("metrics", {}), **(metrics or {})}
            else:
                write_checkpoint(drafter_or_dir, staging, version=version)
                extra = {}
            manifest = read_manifest(staging)
            manifest.update(extra, version=version, parent_version=parent, step=int(step or 0),
                            metrics=metrics or {}, created=time.time())
            atomic_write_json(staging / MANIFEST_FILE, manifest)
            try:
                verify_checkpoint(staging)  # catches a copy that went wrong or a source changed meanwhile
            except CheckpointError as exc:
                raise RegistryError(
                    f"cannot publish {version}: copied checkpoint failed verification: {exc}") from exc
        self._log("publish", version, parent=parent, step=manifest["step"])
        logger.info("published drafter %s (parent %s, step %s)", version, parent, manifest["step"])
        self.prune()
        return self.get(version)

    def _check_source(self, source: Path) -> dict:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (source / name).is_file():
                raise RegistryError(f"cannot publish {source}: not a drafter checkpoint (no {name})")
        try:
            manifest = verify_checkpoint(source)
            hf_config = json.loads((source / CONFIG_FILE).read_text())
            method = manifest.get("method") or method_for_config(hf_config)
        except ValueError as exc:  # CheckpointError, unreadable config.json, unsupported architecture
            raise RegistryError(f"cannot publish {source}: {exc}") from exc
        return {**manifest, "method": method}

    @staticmethod
    def _copy_checkpoint(source: Path, manifest: dict, staging: Path) -> None:
        """Copy the listed files (config and weights at least); a manifest without hashes gets them."""
        names = sorted(set(manifest.get("files", {})) | {CONFIG_FILE, WEIGHTS_FILE})
        for name in names:
            shutil.copy2(source / name, staging / name)
        hashes = dict(manifest.get("files", {}))
        for name in names:  # files the source did not hash are hashed here, after the copy
            hashes.setdefault(name, sha256_file(staging / name))
        atomic_write_json(staging / MANIFEST_FILE, {**manifest, "files": hashes})

    def _reserve(self) -> str:
        """Allocate the next version name; `os.mkdir` fails for all but one concurrent caller."""
        self.reserved_dir.mkdir(parents=True, exist_ok=True)
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        taken = [version_number(p.name) for d in (self.reserved_dir, self.versions_dir) for p in d.iterdir()]
        number = max((n for n in taken if n is not None), default=0) + 1
        while True:
            try:
                os.mkdir(self.reserved_dir / version_name(number))
                return version_name(number)
            except FileExistsError:
                number += 1

    # ---- lifecycle --------------------------------------------------------------------------------

    def promote(self, version: str, reason: str = "") -> VersionInfo:
        """Make `version` the one servers load; refuses bad versions and checkpoints failing their hashes."""
        with self._locked():
            info = self.get(version)
            if info.status == "bad":
                why = info.status_reason or "no reason given"
                raise RegistryError(f"cannot promote {version}: it is marked bad ({why})")
            self._verify(version, action="promote")
            if info.is_current:
                return info
            if info.status == "rejected":
                logger.warning("promoting %s although it was rejected (%s)", version, info.status_reason)
            self._set_status(version, "promoted", reason)
            self._write_current(version, reason)
            self._log("promote", version, reason=reason)
        logger.info("promoted drafter %s (%s)", version, reason or "no reason given")
        return self.get(version)

    def rollback(self, reason: str, *, expected_current: str | None = None) -> VersionInfo:
        """Mark the current version bad and make the most recent earlier promoted, good version current.

        With ``expected_current``, only if that version is still current (compare-and-swap under the
        lock), else `CurrentMovedError`. Nothing changes if there is no version to return to (the
        error says so): serving a known-bad pointer is left to the caller, e.g. with `mark_bad`.
        """
        with self._locked():
            current = self._read_current()
            if current is None:
                raise RegistryError(f"cannot roll back: no current version in {self.root}")
            bad = current["version"]
            if expected_current is not None and bad != expected_current:
                raise CurrentMovedError(f"not rolling back {expected_current}: CURRENT is {bad} now (it moved "
                                        "since the caller looked). Nothing was changed.")
            target, skipped = self._previous_good(exclude=bad)
            if target is None:
                detail = f"; skipped: {', '.join(skipped)}" if skipped else ""
                raise RegistryError(f"cannot roll back from {bad}: no earlier promoted version that is "
                                    f"not bad and verifies{detail}. Nothing was changed.")
            self._set_status(bad, "bad", f"rolled back: {reason}")
            self._log("mark_bad", bad, reason=f"rolled back: {reason}")
            self._write_current(target, f"rollback from {bad}: {reason}")
            self._log("rollback", target, reason=reason, **{"from": bad})
        logger.warning("rolled back drafter %s -> %s (%s)", bad, target, reason)
        return self.get(target)

    def _previous_good(self, exclude: str) -> tuple[str | None, list[str]]:
        """Walk history backwards over versions that were made current; first good, verifying one wins."""
        seen, skipped = {exclude}, []
        for event in reversed(self.history()):
            version = event.get("version")
            if event.get("event") not in MADE_CURRENT or version in seen:
                continue
            seen.add(version)
            status = self._read_status(version)["status"]
            if status == "bad":
                continue
            try:
                self._verify(version, action="roll back to")
            except RegistryError as exc:
                logger.error("%s", exc)
                skipped.append(f"{version} (fails verification)")
                continue
            return version, skipped
        return None, skipped

    def mark_bad(self, version: str, reason: str) -> VersionInfo:
        """Never promote `version` again. Does not move CURRENT: use `rollback` for the current one."""
        return self._change_status(version, "bad", reason)

    def reject(self, version: str, reason: str) -> VersionInfo:
        """Record that the gate turned `version` down (it can still be promoted by hand)."""
        return self._change_status(version, "rejected", reason)

    def _change_status(self, version: str, status: str, reason: str) -> VersionInfo:
        event = {"bad": "mark_bad", "rejected": "reject"}[status]
        with self._locked():
            self.path(version)
            self._set_status(version, status, reason)
            self._log(event, version, reason=reason)
        logger.info("%s: %s (%s)", version, status, reason)
        return self.get(version)

    def set_metrics(self, version: str, key: str, value: Any) -> VersionInfo:
        """Store a figure (e.g. the gate's acceptance) in the version's manifest `metrics`.

        Only manifest.json changes, and it is not among the hashed files, so `verify_checkpoint` keeps
        passing. The manifest is replaced atomically under the lock, so concurrent writers lose nothing.
        """
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise RegistryError(f"cannot set metric {key!r} of {version}: value is not JSON ({exc})") from exc
        with self._locked():
            path = self.path(version)
            manifest = read_manifest(path)
            manifest.setdefault("metrics", {})[key] = value
            atomic_write_json(path / MANIFEST_FILE, manifest)
        return self.get(version)

    # ---- upkeep -----------------------------------------------------------------------------------

    def check(self) -> dict | None:
        """Repair a CURRENT naming a missing, bad or corrupt version, or unreadable itself
        (online_opd/release/maintenance.py).

        Returns ``{"from", "to", "problem"}`` after a repair, None when CURRENT is sound (or unset).
        Raises `RegistryError`, changing nothing, when no version that was made current is good.
        """
        from online_opd.release import maintenance  # it imports this module

        return maintenance.check(self)

    def prune(self) -> list[str]:
        """Retention: delete never-current versions beyond the newest ``keep_unpromoted``; returns them."""
        from online_opd.release import maintenance  # it imports this module

        return maintenance.prune(self)

    # ---- reading ----------------------------------------------------------------------------------

    def current(self) -> VersionInfo | None:
        """The version servers should run, or None before the first promote."""
        pointer = self._read_current()
        return None if pointer is None else self.get(pointer["version"])

    def get(self, version: str) -> VersionInfo:
        path = self.path(version)
        manifest = read_manifest(path)
        status = self._read_status(version)
        pointer = self._read_current()
        created = manifest.get("created") or (path / MANIFEST_FILE).stat().st_mtime
        return VersionInfo(
            version=version, path=path, parent=manifest.get("parent_version"),
            step=int(manifest.get("step", 0)), created=float(created), status=status["status"],
            is_current=pointer is not None and pointer["version"] == version,
            metrics=manifest.get("metrics", {}), method=manifest.get("method"),
            status_reason=status["reason"])

    def list(self) -> list[VersionInfo]:
        """All published versions, oldest first."""
        if not self.versions_dir.is_dir():
            return []
        numbered = [(version_number(p.name), p.name) for p in self.versions_dir.iterdir()
                    if (p / MANIFEST_FILE).is_file()]
        return [self.get(name) for number, name in sorted(n for n in numbered if n[0] is not None)]

    def history(self) -> list[dict]:
        """Lifecycle events, oldest first. A torn last line (crash mid-append) is skipped."""
        file = self.root / HISTORY_FILE
        if not file.exists():
            return []
        events = []
        for line in file.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s: skipping unreadable line %r", file, line[:80])
        return events

    def path(self, version: str) -> Path:
        """The checkpoint folder of `version` (what vLLM and `load_drafter` read)."""
        path = self.versions_dir / version
        if version_number(version) is None or not (path / MANIFEST_FILE).is_file():
            known = [p.name for p in self.versions_dir.iterdir()] if self.versions_dir.is_dir() else []
            known = sorted(n for n in known if version_number(n) is not None)
            listing = f"{known[0]}…{known[-1]}" if known else "none"
            raise RegistryError(f"unknown drafter version {version!r} in {self.root} (versions: {listing})")
        return path

    def weights_sha256(self, version: str) -> str:
        """sha256 of the version's model.safetensors, from its manifest: the reload call passes this."""
        digest = read_manifest(self.path(version)).get("files", {}).get(WEIGHTS_FILE)
        if not digest:
            raise RegistryError(f"{version}: manifest has no sha256 for {WEIGHTS_FILE}")
        return digest

    # ---- internals --------------------------------------------------------------------------------

    def _verify(self, version: str, action: str) -> None:
        path = self.path(version)
        files = read_manifest(path).get("files", {})
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if name not in files:
                raise RegistryError(f"cannot {action} {version}: manifest has no sha256 for {name}")
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            raise RegistryError(f"cannot {action} {version}: checkpoint failed verification: {exc}") from exc

    def _read_current(self) -> dict | None:
        file = self.root / CURRENT_FILE
        try:
            pointer = json.loads(file.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:  # only if edited by hand: writers replace it atomically
            raise RegistryError(f"{file}: unreadable ({exc})") from exc
        if not isinstance(pointer, dict) or "version" not in pointer:
            raise RegistryError(f"{file}: expected a JSON object with a 'version', got {pointer!r}")
        return pointer

    def _write_current(self, version: str, reason: str) -> None:
        pointer = {"version": version, "since": time.time(), "reason": reason}
        atomic_write_json(self.root / CURRENT_FILE, pointer)

    def _read_status(self, version: str) -> dict:
        try:
            status = json.loads((self.status_dir / f"{version}.json").read_text())
        except FileNotFoundError:
            return {"status": "candidate", "reason": "", "since": None}
        return {"status": status.get("status", "candidate"), "reason": status.get("reason", ""),
                "since": status.get("since")}

    def _set_status(self, version: str, status: str, reason: str) -> None:
        assert status in STATUSES, status
        self.status_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.status_dir / f"{version}.json",
                           {"status": status, "reason": reason, "since": time.time()})

    def _log(self, event: str, version: str, **fields: Any) -> None:
        """Append one event line with a single write on an O_APPEND file, then fsync."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"time": time.time(), "event": event, "version": version, **fields}) + "\n"
        fd = os.open(self.root / HISTORY_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock
