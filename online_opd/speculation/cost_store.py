"""Step costs kept across server restarts, per setup.

A step's cost t(b, K) belongs to the machine, the target model and its dtype,
the drafter's shape and the engine settings, not to a drafter version or a
server's lifetime. A server that starts with an empty table serves K = 0 above
batch size 1 until exploration has timed speculative steps there (the policy's
conservative schedule): 243 steps at b = 8 in the c=8 step profile of the
README, with a drafter that pays there. So the policy loop saves its table
(vllm_patches/speculation_loop.py) and the next server on the same setup starts
from it (serve/server.py's starting schedule, then the loop's cost model through
``costs.with_prior``).

The file (JSON, written atomically) holds up to ``MAX_TABLES`` tables, each
with its ``setup`` (a flat JSON object: the machine, vLLM, target, dtype,
drafter shape, K_max, capture and CPU settings; serve/server.py ``cost_setup``)
and the rows of ``StepCosts.to_rows``. A table is used only when its setup
equals the server's exactly; otherwise the log says which fields differ. A
file that cannot be read as such is moved aside (``.corrupt``) and the server
starts with an empty table: a cost table is derived data, and a bad one must
not stop serving.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from online_opd.files import atomic_write_json
from online_opd.speculation.costs import StepCosts

FORMAT = 1
MAX_TABLES = 8


@dataclass
class StoredCosts:
    """What ``load`` found: the table for this setup (None when there is none) and why."""

    costs: StepCosts | None
    reason: str
    saved_at: float | None = None


def _read(path: Path) -> list[dict]:
    """The file's tables (empty when it does not exist); ValueError when it is not a cost file."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text: {exc}") from exc
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tables"), list):
        raise ValueError(f"not a step-cost file of format {FORMAT}")
    for table in doc["tables"]:
        if not (isinstance(table, dict) and isinstance(table.get("setup"), dict)
                and isinstance(table.get("costs"), list)):
            raise ValueError("a table without its setup or costs")
        StepCosts.from_rows(table["costs"])  # raises on malformed rows
    return doc["tables"]


def _move_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    return aside


def differences(stored: dict[str, Any], setup: dict[str, Any]) -> list[str]:
    """The setup fields whose values differ (or that only one side has), sorted."""
    return sorted(k for k in set(stored) | set(setup) if stored.get(k, None) != setup.get(k, None)
                  or (k in stored) != (k in setup))


def load(path: str | os.PathLike, setup: dict[str, Any]) -> StoredCosts:
    """The table stored for ``setup`` in ``path``, else None with the reason (no file, no table of this
    setup and the closest one's differing fields, or a corrupt file moved aside)."""
    path = Path(path)
    try:
        tables = _read(path)
    except (ValueError, TypeError, OSError) as exc:
        try:
            aside = f"moved to {_move_aside(path).name}"
        except OSError as move_error:
            aside = f"could not be moved aside: {move_error}"
        return StoredCosts(None, f"{path} is unreadable ({exc}); {aside}")
    if not tables:
        return StoredCosts(None, f"no step costs stored in {path} yet")
    for table in tables:
        if table["setup"] == setup:
            costs = StepCosts.from_rows(table["costs"])
            return StoredCosts(costs, f"{len(costs.buckets)} (b, K) buckets from {path}",
                               table.get("saved_at"))
    closest = min(tables, key=lambda t: len(differences(t["setup"], setup)))
    return StoredCosts(None, f"the {len(tables)} table(s) in {path} were measured on another setup "
                             f"(the closest differs in {', '.join(differences(closest['setup'], setup))})")


def save(path: str | os.PathLike, setup: dict[str, Any], costs: StepCosts, *,
         max_tables: int = MAX_TABLES) -> Path:
    """Store ``costs`` for ``setup`` in ``path`` (replacing that setup's table, keeping the other
    setups' newest ``max_tables - 1``); an unreadable file is moved aside first."""
    path = Path(path)
    try:
        tables = _read(path)
    except (ValueError, TypeError, OSError):
        _move_aside(path)
        tables = []
    others = [t for t in tables if t["setup"] != setup]
    others.sort(key=lambda t: t.get("saved_at") or 0.0, reverse=True)
    table = {"setup": setup, "saved_at": time.time(), "costs": costs.to_rows()}
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, {"format": FORMAT, "tables": [table] + others[:max_tables - 1]})
