"""Whether the serving engines are idle, from their load reports (the online trainer's duty cycle).

Each serving replica's trainer process reads its server's /metrics and reports the engine's load
(serve/engine_load.py ``ServerLoad``); ``OnlineTrainer.rest`` and ``may_step`` (online.py) ask
``EngineLoad.idle``. Pure Python: no torch, ray or vllm.
"""

from __future__ import annotations

import threading
import time

__all__ = ["LOAD_STALE_S", "EngineLoad"]

#: A load source (a serving replica) that has not reported for this long no longer counts.
LOAD_STALE_S = 30.0


class EngineLoad:
    """Whether every engine the trainer serves has been idle for ``idle_after_s``, from their reports.

    ``report(source, busy)``: one observation of a source's load, ``busy`` None when it could not be read
    (counts as busy). A source counts as idle while its latest report says idle and its latest busy (or
    unknown) report, or its first report, lies ``idle_after_s`` back; sources silent for ``stale_s`` are
    dropped, and with none left the engines do not count as idle. Times are wall-clock seconds (reports
    may cross processes).
    Thread-safe.
    """

    def __init__(self, idle_after_s: float, stale_s: float = LOAD_STALE_S) -> None:
        self.idle_after_s = idle_after_s
        self.stale_s = stale_s
        self._lock = threading.Lock()
        # source -> (its last report, its last busy or first report, whether the last one was busy)
        self._sources: dict[str, tuple[float, float, bool]] = {}

    def report(self, source: str, busy: bool | None, at: float | None = None) -> None:
        at = time.time() if at is None else at
        is_busy = busy is None or busy
        with self._lock:
            _, since, _ = self._sources.get(source, (at, at, False))
            self._sources[source] = (at, at if is_busy else since, is_busy)

    def idle(self, at: float | None = None) -> bool:
        at = time.time() if at is None else at
        with self._lock:
            self._sources = {s: v for s, v in self._sources.items() if at - v[0] <= self.stale_s}
            fresh = list(self._sources.values())
        return bool(fresh) and all(not is_busy and at - since >= self.idle_after_s for _, since, is_busy in fresh)
