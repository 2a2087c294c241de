"""The serving engine's load as the trainer process reads it, and when that process runs Ray.

``ServerLoad`` reads the server's own /metrics (vLLM's gauges and counter) and says "busy", "idle" or
"unknown"; the trainer process (serve/trainer_process.py) passes that to the trainer actor with each stats
poll (``OnlineTrainer.note_engine_load``, online_opd/train/load.py).

``Hibernation`` (``online.hibernate_after_s``, with ``duty_cycle`` 0 and a local Ray): the trainer process
starts Ray and the actor once the load has read idle for ``idle_after_s``, and stops them (the actor saves
its state) and Ray once it has read serving for ``hibernate_after_s``. Between, it writes the last figures
every second with status ``HIBERNATING`` and no pid: /metrics keeps them, and the supervisor counts the next
actor as no restart.
"""

from __future__ import annotations

import logging
import time

from online_opd.config_serving import OnlineConfig

logger = logging.getLogger("online_opd.trainer_process")

LOAD_POLL_S = 2.0  # seconds between the trainer process's reads of the engine's load (its server's /metrics)
HIBERNATING = "hibernating"  # the status in the trainer process's lines while Ray and the actor are stopped


class ServerLoad:
    """The serving engine's load, from its server's /metrics (vLLM's own gauges and counter).

    ``read()``: "busy" while a request runs or waits, or when generated tokens grew since the previous
    read (a request that came and went between two reads); "idle" otherwise; "unknown" when /metrics
    does not answer in ``timeout`` or lacks vLLM's figures (the server is starting).
    """

    QUEUES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    TOKENS = "vllm:generation_tokens_total"

    def __init__(self, url: str, timeout: float = LOAD_POLL_S) -> None:
        self.url = url
        self.timeout = timeout
        self._tokens: float | None = None

    def read(self) -> str:
        import httpx

        from serve.scrape import parse_metrics

        try:
            reply = httpx.get(f"{self.url.rstrip('/')}/metrics", timeout=self.timeout)
            reply.raise_for_status()
            # only the three series are parsed, not the whole exposition (vLLM's histograms) every read
            wanted = (*self.QUEUES, self.TOKENS, "# TYPE vllm:num_requests_", "# TYPE vllm:generation_tokens")
            metrics = parse_metrics("\n".join(line for line in reply.text.splitlines() if line.startswith(wanted)))
        except Exception as exc:  # starting, restarting, too slow: the trainer treats it as serving
            logger.debug("engine load unavailable from %s: %r", self.url, exc)
            return "unknown"
        if self.TOKENS not in metrics or any(k not in metrics for k in self.QUEUES):
            return "unknown"
        tokens, self._tokens = self._tokens, metrics[self.TOKENS]
        is_busy = sum(metrics[k] for k in self.QUEUES) > 0 or (tokens is not None and tokens != self._tokens)
        return "busy" if is_busy else "idle"


class Hibernation:
    """When the child runs Ray and the trainer actor, with ``online.hibernate_after_s``: from the moment
    the engines have been idle for ``idle_after_s`` until they have served for ``hibernate_after_s``
    ("unknown" load counts as serving, as in ``EngineLoad``). ``note`` each load read."""

    def __init__(self, idle_after_s: float, hibernate_after_s: float, clock=time.monotonic) -> None:
        self.idle_after_s = idle_after_s
        self.hibernate_after_s = hibernate_after_s
        self.clock = clock
        self._is_idle = False
        self._since: float | None = None  # when the load last changed between idle and serving

    @classmethod
    def of(cls, online: OnlineConfig, has_load: bool) -> Hibernation | None:
        """The configured hibernation, or None where it does not apply (the field's description)."""
        if online.hibernate_after_s is None:
            return None
        if online.duty_cycle > 0 or online.ray_address is not None or not has_load:
            logger.info("online.hibernate_after_s ignored: it needs duty_cycle 0, a local Ray and the server's "
                        "/metrics (duty_cycle %g, ray_address %s, load %s)", online.duty_cycle,
                        online.ray_address, "read" if has_load else "not read")
            return None
        return cls(online.idle_after_s, online.hibernate_after_s)

    def note(self, state: str) -> None:
        is_idle = state == "idle"
        if self._since is None or is_idle != self._is_idle:
            self._is_idle, self._since = is_idle, self.clock()

    def may_wake(self) -> bool:
        return self._since is not None and self._is_idle and self.clock() - self._since >= self.idle_after_s

    def should_sleep(self) -> bool:
        return self._since is not None and not self._is_idle and self.clock() - self._since >= self.hibernate_after_s
