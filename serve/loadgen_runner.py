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
and inflate latency. It drops a connection idle for 2 s, before the server's
keep-alive timeout closes it (serve.clients), so a pause between requests
does not turn into a spurious connection error.  Failed requests are counted by exception type and never
stop the run; Ctrl-C stops issuing, cancels the requests in flight, and the
summary so far is still returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict
from typing import IO, Any

from online_opd.data import HUMANEVAL_TEMPLATE, Prompt, load_prompts
from serve.clients import openai_client
from serve.loadgen_config import LoadConfig
from serve.loadgen_stats import RequestResult, summarize

__all__ = ["OPT_OUT_BODY", "opts_out", "select_prompts", "completion_text", "run_load"]

logger = logging.getLogger("serve.loadgen")  # the loadgen command's log

OPT_OUT_BODY = {"vllm_xargs": {"online_opd_capture": False}}


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
        from tqdm.auto import tqdm

        api_key = self.cfg.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        async with openai_client(self.cfg.base_url, asynchronous=True, api_key=api_key,
                                 timeout=self.cfg.timeout) as client:
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
