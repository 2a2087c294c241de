"""`online-opd loadgen` settings: `LoadConfig`, what one load run does, validated on construction.

The runner (serve/loadgen_runner.py) takes one; the command line (serve/loadgen.py) builds one from its
arguments; benchmarks build them directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from online_opd.data import SOURCES, SPLITS

__all__ = ["DEFAULT_BASE_URL", "CLOSED_LOOP_CONCURRENCY", "OPEN_LOOP_MAX_IN_FLIGHT", "Endpoint", "LoadConfig"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
CLOSED_LOOP_CONCURRENCY = 8  # workers when --concurrency is not given
OPEN_LOOP_MAX_IN_FLIGHT = 64  # in-flight cap under --rate when --concurrency is not given
Endpoint = Literal["chat", "completions"]


@dataclass
class LoadConfig:
    """Everything one load run needs; validated on construction (ValueError names the field).

    ``num_requests`` and ``duration`` are both stop conditions; whichever is
    reached first ends the run.  With neither, every selected prompt is sent
    once.  ``concurrency=None`` means 8 workers (closed loop) or a cap of 64
    requests in flight (open loop, ``rate`` set).  ``temperature``/``top_p``
    None are not sent, so the server's (model's) defaults apply.
    """

    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = None  # None: $OPENAI_API_KEY, else "EMPTY" (vLLM without --api-key)
    model: str | None = None  # None: the first id of GET /v1/models
    prompts: str = "sharegpt"
    split: str = "train"
    num_prompts: int = 256
    seed: int = 0
    endpoint: Endpoint = "chat"
    max_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    concurrency: int | None = None
    rate: float | None = None
    duration: float | None = None
    num_requests: int | None = None
    opt_out_fraction: float = 0.0
    timeout: float = 600.0
    out: Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("invalid loadgen settings: " + "; ".join(problems))

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    @property
    def max_in_flight(self) -> int:
        """Workers (closed loop) or the in-flight cap (open loop)."""
        if self.concurrency is not None:
            return self.concurrency
        return OPEN_LOOP_MAX_IN_FLIGHT if self.open_loop else CLOSED_LOOP_CONCURRENCY


def _problems(cfg: LoadConfig) -> list[str]:
    """Every invalid setting of ``cfg``, as ``field: reason`` (empty if valid)."""
    problems = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    def finite(x: float | None) -> bool:
        return x is None or math.isfinite(x)

    check(cfg.base_url.startswith(("http://", "https://")), f"base_url must start with http:// or "
          f"https:// (got {cfg.base_url!r})")
    check(cfg.prompts in SOURCES, f"prompts must be one of {', '.join(SOURCES)} (got {cfg.prompts!r})")
    check(cfg.split in SPLITS, f"split must be one of {', '.join(SPLITS)} (got {cfg.split!r})")
    check(cfg.endpoint in ("chat", "completions"), f"endpoint must be chat or completions "
          f"(got {cfg.endpoint!r})")
    check(cfg.num_prompts >= 1, f"num_prompts must be >= 1 (got {cfg.num_prompts})")
    check(cfg.max_tokens >= 1, f"max_tokens must be >= 1 (got {cfg.max_tokens})")
    check(cfg.temperature is None or (finite(cfg.temperature) and cfg.temperature >= 0),
          f"temperature must be >= 0 (got {cfg.temperature})")
    check(cfg.top_p is None or (finite(cfg.top_p) and 0 < cfg.top_p <= 1),
          f"top_p must be in (0, 1] (got {cfg.top_p})")
    check(cfg.concurrency is None or cfg.concurrency >= 1,
          f"concurrency must be >= 1 (got {cfg.concurrency})")
    check(cfg.rate is None or (finite(cfg.rate) and cfg.rate > 0),
          f"rate must be > 0 requests/s (got {cfg.rate}); omit it for a closed loop")
    check(cfg.duration is None or (finite(cfg.duration) and cfg.duration > 0),
          f"duration must be > 0 seconds (got {cfg.duration})")
    check(cfg.num_requests is None or cfg.num_requests >= 1,
          f"num_requests must be >= 1 (got {cfg.num_requests})")
    check(finite(cfg.opt_out_fraction) and 0 <= cfg.opt_out_fraction <= 1,
          f"opt_out_fraction must be in [0, 1] (got {cfg.opt_out_fraction})")
    check(finite(cfg.timeout) and cfg.timeout > 0, f"timeout must be > 0 seconds (got {cfg.timeout})")
    return problems
