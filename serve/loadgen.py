"""`online-opd loadgen`: drive an OpenAI-compatible server (vLLM) with prompt traffic.

The traffic is real client traffic: requests go through ``openai.AsyncOpenAI``,
exactly as an application would send them, so the server sees the same
requests (and the same opt-out flag) that Draft-OPD captures in production.

Two arrival models, because they answer different questions:

* closed loop (default, ``--concurrency N``): N workers each send a request,
  wait for it, and send the next; measures throughput at a fixed load.
* open loop (``--rate R``): Poisson arrivals at R requests/s independent of the
  server's speed (latency under a given offered load).  ``--concurrency`` then
  caps the requests in flight; an arrival that finds the cap reached waits for
  a free slot, and that wait is recorded as ``queued_s``.

Endpoint: chat by default for both prompt sets, since the embedded target is an
instruct model and the HumanEval prompts are already wrapped as an instruction
("Complete the following Python function: ...").  ``--completions`` sends raw
text instead; for HumanEval the wrapper is removed so the model continues the
function source itself (the classic HumanEval completion setting).

A request opts out of capture with ``extra_body={"vllm_xargs":
{"online_opd_capture": False}}``; ``--opt-out-fraction F`` marks exactly
``floor((i + 1) F) - floor(i F)`` of request ``i``, i.e. spread evenly and
exactly ``round-down(N F)`` of N, so small runs get the fraction they ask for.

The client never retries (``max_retries=0``): a retry would hide a failure
and inflate latency.  Failed requests are counted by exception type and never
stop the run; Ctrl-C stops issuing, cancels the requests in flight, and the
summary so far is still returned.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal

from online_opd.data import HUMANEVAL_TEMPLATE, SOURCES, SPLITS, Prompt, load_prompts

__all__ = ["DEFAULT_BASE_URL", "LoadConfig", "RequestResult", "add_parser", "run", "run_load",
           "select_prompts", "summarize", "opts_out", "config_from_args"]

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
OPT_OUT_BODY = {"vllm_xargs": {"online_opd_capture": False}}
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


@dataclass
class RequestResult:
    """One request as written to ``--out`` (one JSON line each).

    Times: ``start_time`` is Unix time (joins with server logs), the others are
    ``time.perf_counter`` differences.  Token counts come from the server's
    ``usage`` (None when it sent none); ``ttft_s`` is the first chunk that
    carries text, so it is None without streaming.
    """

    index: int
    prompt_id: str
    opted_out: bool
    start_time: float
    start_offset_s: float = 0.0  # since the run started
    queued_s: float = 0.0  # open loop: waited for an in-flight slot after its arrival time
    latency_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


def opts_out(index: int, fraction: float) -> bool:
    """Whether request ``index`` opts out: evenly spread, exactly floor(N * fraction) of the first N."""
    return math.floor((index + 1) * fraction + 1e-9) > math.floor(index * fraction + 1e-9)


def select_prompts(source: str, split: str, num_prompts: int, seed: int) -> list[Prompt]:
    """The prompts to cycle through: ``load_prompts`` (hash split, seeded shuffle) with a clear error."""
    prompts = load_prompts(source, num_prompts=num_prompts, seed=seed, split=split)
    if not prompts:
        raise ValueError(f"no prompts in {source!r} split {split!r}")
    return prompts


def completion_text(prompt: Prompt) -> str:
    """Raw text for the completions endpoint; HumanEval loses its chat wrapper and ends in code."""
    text = prompt.messages[-1]["content"]
    if prompt.source == "humaneval":
        head, tail = HUMANEVAL_TEMPLATE.split("{prompt}")
        if text.startswith(head) and text.endswith(tail):
            text = text[len(head):len(text) - len(tail)]
    return text


def _percentile(values: Sequence[float], q: int) -> float | None:
    """The ``q``-th percentile (integer q in 1..99); None for no values.

    ``method="inclusive"`` interpolates linearly between the order statistics
    at (n - 1) * q / 100, as numpy's default does.
    """
    if len(values) < 2:  # statistics.quantiles needs two points before Python 3.13
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(results: Sequence[RequestResult], wall_s: float, *, stream: bool) -> dict[str, Any]:
    """Aggregate of finished requests.  Rates use successful requests over the whole wall time;
    latency/TTFT percentiles are over successful requests only (a failure's latency says
    little about serving speed)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    wall = max(wall_s, 1e-9)

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    summary: dict[str, Any] = {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "opted_out": sum(r.opted_out for r in results),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tokens": output_tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(output_tokens / wall, 3),
        "requests_per_s": round(len(ok) / wall, 4),
        "latency_p50_s": rounded(_percentile(latencies, 50)),
        "latency_p95_s": rounded(_percentile(latencies, 95)),
    }
    if stream:
        summary["ttft_p50_s"] = rounded(_percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50))
    summary["errors"] = dict(Counter(r.error_type for r in results if not r.ok).most_common())
    return summary


def run_load(cfg: LoadConfig) -> dict[str, Any]:
    """Run the load described by ``cfg`` and return the summary (the CLI prints the same dict).

    Raises ValueError for bad prompt selections and RuntimeError when no model
    can be listed; request failures only show up in the summary.
    """
    prompts = select_prompts(cfg.prompts, cfg.split, cfg.num_prompts, cfg.seed)
    return asyncio.run(_Load(cfg, prompts).run())


class _Load:
    """State of one run: the request counter, the results so far, the output file."""

    def __init__(self, cfg: LoadConfig, prompts: list[Prompt]) -> None:
        self.cfg = cfg
        self.prompts = prompts
        # stop after one pass over the prompts unless told otherwise
        self.limit = cfg.num_requests if cfg.num_requests or cfg.duration else len(prompts)
        self.results: list[RequestResult] = []
        self.next_index = 0
        self.cancelled = 0
        self.interrupted = False
        self.model = cfg.model or ""
        self.t0 = 0.0
        self.deadline = math.inf
        self.out: IO[str] | None = None
        self.bar: Any = None

    async def run(self) -> dict[str, Any]:
        from openai import AsyncOpenAI
        from tqdm.auto import tqdm

        api_key = self.cfg.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        async with AsyncOpenAI(base_url=self.cfg.base_url, api_key=api_key, timeout=self.cfg.timeout,
                               max_retries=0) as client:
            if not self.model:
                self.model = await _first_model(client, self.cfg.base_url)
            logger.info("loadgen: %s %s at %s, %s", self.cfg.endpoint, self.model, self.cfg.base_url,
                        f"open loop {self.cfg.rate}/s, at most {self.cfg.max_in_flight} in flight"
                        if self.cfg.open_loop else f"closed loop, {self.cfg.max_in_flight} workers")
            with contextlib.ExitStack() as stack:
                if self.cfg.out is not None:
                    self.cfg.out.parent.mkdir(parents=True, exist_ok=True)
                    self.out = stack.enter_context(open(self.cfg.out, "w", encoding="utf-8"))
                self.bar = stack.enter_context(tqdm(
                    total=self.limit, desc="loadgen", unit="req", disable=not self.cfg.progress,
                    file=sys.stderr, dynamic_ncols=True))
                self.t0 = time.perf_counter()
                if self.cfg.duration is not None:
                    self.deadline = self.t0 + self.cfg.duration
                await self._drive_interruptibly(client)
                wall = time.perf_counter() - self.t0
        summary = {"model": self.model, "endpoint": self.cfg.endpoint, "stream": self.cfg.stream,
                   "mode": "open" if self.cfg.open_loop else "closed", "rate": self.cfg.rate,
                   "max_in_flight": self.cfg.max_in_flight, "prompts": self.cfg.prompts,
                   "split": self.cfg.split}
        summary.update(summarize(self.results, wall, stream=self.cfg.stream))
        summary["requests_cancelled"] = self.cancelled
        summary["interrupted"] = self.interrupted
        if self.cfg.out is not None:
            summary["out"] = str(self.cfg.out)
        return summary

    async def _drive_interruptibly(self, client: Any) -> None:
        """Run the load; SIGINT (when we may handle it: main thread) cancels it instead of killing us."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self._drive(client))

        def interrupt() -> None:
            if not self.interrupted:
                logger.warning("loadgen: interrupted; cancelling %d requests in flight",
                               self.next_index - len(self.results) - self.cancelled)
            self.interrupted = True
            task.cancel()

        handled = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGINT, interrupt)
            handled = True
        try:
            await task
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
        finally:
            if handled:
                loop.remove_signal_handler(signal.SIGINT)

    async def _drive(self, client: Any) -> None:
        if not self.cfg.open_loop:
            await asyncio.gather(*(self._worker(client) for _ in range(self.cfg.max_in_flight)))
            return
        # open loop: Poisson arrivals, first at t=0; a full in-flight cap delays the send
        rng = random.Random(self.cfg.seed)
        slots = asyncio.Semaphore(self.cfg.max_in_flight)
        tasks: set[asyncio.Task] = set()
        arrival = self.t0
        try:
            while (index := self._claim()) is not None:
                delay = arrival - time.perf_counter()
                if arrival >= self.deadline:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                await slots.acquire()
                queued = max(0.0, time.perf_counter() - arrival)
                task = asyncio.ensure_future(self._one(client, index, queued))
                tasks.add(task)
                task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
                arrival += rng.expovariate(self.cfg.rate)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def _claim(self) -> int | None:
        """The next request index, or None once a stop condition holds."""
        if self.limit is not None and self.next_index >= self.limit:
            return None
        if time.perf_counter() >= self.deadline:
            return None
        self.next_index += 1
        return self.next_index - 1

    async def _worker(self, client: Any) -> None:
        while (index := self._claim()) is not None:
            await self._one(client, index, 0.0)

    async def _one(self, client: Any, index: int, queued_s: float) -> None:
        prompt = self.prompts[index % len(self.prompts)]
        opted_out = opts_out(index, self.cfg.opt_out_fraction)
        start = time.perf_counter()
        result = RequestResult(index=index, prompt_id=prompt.id, opted_out=opted_out, start_time=time.time(),
                               start_offset_s=round(start - self.t0, 6), queued_s=round(queued_s, 6))
        try:
            await self._send(client, prompt, opted_out, start, result)
            result.latency_s = round(time.perf_counter() - start, 6)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except Exception as exc:  # a failed request is data, never a crash
            result.latency_s = round(time.perf_counter() - start, 6)
            result.error_type = type(exc).__name__
            result.error = str(exc)[:500]
        self._record(result)

    async def _send(self, client: Any, prompt: Prompt, opted_out: bool, start: float,
                    result: RequestResult) -> None:
        cfg = self.cfg
        extra_body: dict[str, Any] = dict(OPT_OUT_BODY) if opted_out else {}
        if cfg.ignore_eos:
            extra_body["ignore_eos"] = True
        kwargs: dict[str, Any] = {"model": self.model, "extra_body": extra_body or None}
        if cfg.temperature is not None:
            kwargs["temperature"] = cfg.temperature
        if cfg.top_p is not None:
            kwargs["top_p"] = cfg.top_p
        if cfg.stream:
            kwargs.update(stream=True, stream_options={"include_usage": True})
        if cfg.endpoint == "chat":
            response = await client.chat.completions.create(
                messages=prompt.messages, max_completion_tokens=cfg.max_tokens, **kwargs)
        else:
            response = await client.completions.create(
                prompt=completion_text(prompt), max_tokens=cfg.max_tokens, **kwargs)
        if not cfg.stream:
            _take_usage(result, response.usage)
            result.finish_reason = response.choices[0].finish_reason if response.choices else None
            return
        async with response:
            async for chunk in response:
                for choice in chunk.choices:
                    text = choice.delta.content if cfg.endpoint == "chat" else choice.text
                    if text and result.ttft_s is None:
                        result.ttft_s = round(time.perf_counter() - start, 6)
                    result.finish_reason = choice.finish_reason or result.finish_reason
                if chunk.usage is not None:
                    _take_usage(result, chunk.usage)

    def _record(self, result: RequestResult) -> None:
        self.results.append(result)
        if self.out is not None:
            self.out.write(json.dumps(asdict(result)) + "\n")
            self.out.flush()  # keep what finished even if the run is killed
        if self.bar is not None:
            self.bar.update(1)
            failed = sum(not r.ok for r in self.results)
            if failed:
                self.bar.set_postfix(failed=failed, refresh=False)


def _take_usage(result: RequestResult, usage: Any) -> None:
    if usage is not None:
        result.prompt_tokens = usage.prompt_tokens
        result.completion_tokens = usage.completion_tokens


async def _first_model(client: Any, base_url: str) -> str:
    """The first served model id; a clear error if the server is unreachable or serves none."""
    try:
        page = await client.models.list()
    except Exception as exc:
        raise RuntimeError(f"cannot list models at {base_url}/models ({type(exc).__name__}: {exc}); "
                           "is the server running? (or pass --model)") from None
    ids = [model.id for model in page.data]
    if not ids:
        raise RuntimeError(f"{base_url}/models lists no models; pass --model")
    return ids[0]


# ---------------------------------------------------------------------------------------------- CLI


def _typed(kind: type, check: Any, requirement: str) -> Any:
    """An argparse type: parse with ``kind``, then ``check``; argparse reports ``requirement``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} {requirement}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return parse


_POSITIVE_INT = _typed(int, lambda v: v >= 1, ">= 1")
_POSITIVE_FLOAT = _typed(float, lambda v: math.isfinite(v) and v > 0, "> 0")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``loadgen`` command to ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "loadgen", help="send prompt traffic to an OpenAI-compatible server (openai client)",
        description="Send prompt traffic to an OpenAI-compatible server (e.g. `online-opd serve`) with the "
                    "openai client. Closed loop by default (--concurrency workers); --rate gives an open "
                    "loop of Poisson arrivals. Summary JSON on stdout; progress and logs on stderr.")
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=DEFAULT_BASE_URL, help="default: %(default)s")
    server.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, else EMPTY")
    server.add_argument("--model", default=None, help="default: the first id of GET <base-url>/models")
    server.add_argument("--timeout", type=_POSITIVE_FLOAT, default=600.0,
                        help="per-request timeout in seconds (default: %(default)s); no retries")

    data = p.add_argument_group("prompts")
    data.add_argument("--prompts", choices=SOURCES, default="sharegpt", help="default: %(default)s")
    data.add_argument("--split", choices=SPLITS, default="train", help="default: %(default)s")
    data.add_argument("--num-prompts", type=_POSITIVE_INT, default=256,
                      help="distinct prompts, cycled if more requests are sent (default: %(default)s)")
    data.add_argument("--seed", type=int, default=0,
                      help="prompt shuffle and Poisson arrivals (default: %(default)s)")

    request = p.add_argument_group("requests")
    endpoint = request.add_mutually_exclusive_group()
    endpoint.add_argument("--chat", dest="endpoint", action="store_const", const="chat",
                          help="/chat/completions, the prompt as a user message (default)")
    endpoint.add_argument("--completions", dest="endpoint", action="store_const", const="completions",
                          help="/completions with raw text; humaneval sends the bare function source")
    p.set_defaults(endpoint="chat")
    request.add_argument("--max-tokens", type=_POSITIVE_INT, default=128, help="default: %(default)s")
    request.add_argument("--temperature", type=_typed(float, lambda v: math.isfinite(v) and v >= 0, ">= 0"),
                         default=None, help="default: the server's")
    request.add_argument("--top-p", type=_typed(float, lambda v: 0 < v <= 1, "in (0, 1]"), default=None,
                         help="default: the server's")
    request.add_argument("--ignore-eos", action="store_true",
                         help="vLLM: always generate --max-tokens tokens (fixed-length load)")
    request.add_argument("--stream", action="store_true", help="stream responses; also measures TTFT")
    request.add_argument("--opt-out-fraction", type=_typed(float, lambda v: 0 <= v <= 1, "in [0, 1]"),
                         default=0.0, help="share of requests sent with vllm_xargs online_opd_capture=false, "
                                           "spread evenly (default: %(default)s)")

    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_POSITIVE_INT, default=None,
                      help=f"closed loop: workers (default {CLOSED_LOOP_CONCURRENCY}); with --rate: most "
                           f"requests in flight (default {OPEN_LOOP_MAX_IN_FLIGHT})")
    load.add_argument("--rate", type=_POSITIVE_FLOAT, default=None,
                      help="open loop: Poisson arrivals, requests/s")
    load.add_argument("--num-requests", type=_POSITIVE_INT, default=None,
                      help="stop after this many requests")
    load.add_argument("--duration", type=_POSITIVE_FLOAT, default=None,
                      help="stop issuing after this many seconds (in-flight requests finish); with "
                           "--num-requests, whichever comes first; with neither, each prompt once")
    load.add_argument("--out", type=Path, default=None, help="write one JSON line per request here")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of parsed ``loadgen`` arguments (ValueError on an invalid combination)."""
    return LoadConfig(
        base_url=args.base_url, api_key=args.api_key, model=args.model, prompts=args.prompts,
        split=args.split, num_prompts=args.num_prompts, seed=args.seed, endpoint=args.endpoint,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        ignore_eos=args.ignore_eos, stream=args.stream, concurrency=args.concurrency, rate=args.rate,
        duration=args.duration, num_requests=args.num_requests, opt_out_fraction=args.opt_out_fraction,
        timeout=args.timeout, out=args.out, progress=not getattr(args, "no_progress", False))


def run(args: argparse.Namespace) -> int:
    """CLI entry: print the summary JSON; 0 unless every request failed (1) or Ctrl-C (130)."""
    summary = run_load(config_from_args(args))
    print(json.dumps(summary, indent=2), flush=True)
    if summary["interrupted"]:
        return 130
    return 1 if summary["requests_failed"] and not summary["requests_ok"] else 0

