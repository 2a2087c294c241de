"""Soak traffic against `online-opd serve` and the checks made on it (benchmarks/soak.py, tests/test_faults.py).

Traffic (``run_traffic``): closed-loop workers send completions on token-id
prompts with ``return_token_ids``, so each answer carries the exact output
ids. Request ``i`` draws its prompt, temperature and streaming from
``random.Random(seed + i)``; it opts out of capture by loadgen's rule
(``opts_out(i, opt_out_fraction)``: evenly spread, exactly the fraction).
Reloads (``run_reloads``): the admin route, every ``every_s``, of the registry
version a callable chooses per turn.

Checks (``check_soak``), each a count that must be 0:

- ``failed``: requests that got an error or no output;
- ``missing_records`` / ``extra_records``: the buffer's records, keyed by
  (prompt ids, output ids), against the ok requests that did not opt out, as
  multisets: every such request is exactly one record, and an opted-out
  request leaves none (a prompt answered the same way twice is two records);
- ``greedy_mismatches``: greedy outputs that differ from plain vLLM's
  (``references``: non-speculative outputs per prompt index);
- ``corrupt_segments`` and ``failed_reloads``.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from online_opd.traces.records import SequenceRecord
from serve.clients import http_limits
from serve.loadgen import opts_out


@dataclass
class SoakRequest:
    """One request of the soak and what came back."""

    index: int
    prompt_index: int
    temperature: float
    is_stream: bool
    is_opted_out: bool
    start_time: float
    latency_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.output_ids)


@dataclass
class TrafficSettings:
    """What ``run_traffic`` sends; ``prompts`` are token ids (the chat template already applied)."""

    base_url: str  # the server, without /v1
    prompts: Sequence[Sequence[int]]
    concurrency: int = 32
    duration_s: float = 600.0
    max_tokens: int = 48
    temperatures: tuple[float, ...] = (0.0, 0.8)
    stream_fraction: float = 0.5
    opt_out_fraction: float = 0.1
    seed: int = 0
    timeout_s: float = 600.0


def plan_request(settings: TrafficSettings, index: int) -> SoakRequest:
    """Prompt, temperature, streaming and opt-out of request ``index`` (reproducible)."""
    rng = random.Random(settings.seed + index)
    return SoakRequest(index=index, prompt_index=rng.randrange(len(settings.prompts)),
                       temperature=rng.choice(settings.temperatures),
                       is_stream=rng.random() < settings.stream_fraction,
                       is_opted_out=opts_out(index, settings.opt_out_fraction), start_time=time.time())


def run_traffic(settings: TrafficSettings, stop: threading.Event | None = None) -> list[SoakRequest]:
    """Send requests until ``duration_s`` passed or ``stop`` is set; every request, in index order."""
    return asyncio.run(_Traffic(settings, stop or threading.Event()).run())


class _Traffic:
    def __init__(self, settings: TrafficSettings, stop: threading.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.next_index = 0
        self.done: list[SoakRequest] = []
        self.model = ""

    async def run(self) -> list[SoakRequest]:
        s = self.settings
        limits = http_limits(s.concurrency + 4)
        async with httpx.AsyncClient(base_url=s.base_url, timeout=s.timeout_s, limits=limits) as client:
            self.model = (await client.get("/v1/models")).json()["data"][0]["id"]
            deadline = time.monotonic() + s.duration_s
            await asyncio.gather(*(self._worker(client, deadline) for _ in range(s.concurrency)))
        return sorted(self.done, key=lambda r: r.index)

    async def _worker(self, client: httpx.AsyncClient, deadline: float) -> None:
        while not self.stop.is_set() and time.monotonic() < deadline:
            request = plan_request(self.settings, self.next_index)
            self.next_index += 1
            start = time.perf_counter()
            try:
                await self._send(client, request)
            except Exception as exc:  # a failed request is a finding, never a crash
                request.error = f"{type(exc).__name__}: {exc}"[:500]
            request.latency_s = time.perf_counter() - start
            self.done.append(request)

    async def _send(self, client: httpx.AsyncClient, request: SoakRequest) -> None:
        s = self.settings
        body: dict[str, Any] = {"model": self.model, "prompt": list(s.prompts[request.prompt_index]),
                                "max_tokens": s.max_tokens, "temperature": request.temperature,
                                "return_token_ids": True, "stream": request.is_stream}
        if request.is_opted_out:
            body["vllm_xargs"] = {"online_opd_capture": False}
        if not request.is_stream:
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            request.output_ids, request.finish_reason = list(choice["token_ids"]), choice["finish_reason"]
            return
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in _json(line[6:]).get("choices", []):
                    request.output_ids += choice.get("token_ids") or []
                    request.finish_reason = choice.get("finish_reason") or request.finish_reason


def _json(text: str) -> dict:
    data = json.loads(text)
    if "error" in data:
        raise RuntimeError(f"error in the stream: {data['error']}")
    return data


def run_reloads(admin: Callable[..., httpx.Response], choose_version: Callable[[int], str], every_s: float,
                stop: threading.Event) -> list[dict]:
    """POST /reload every ``every_s`` until ``stop``, of ``choose_version(turn)``; each answer's JSON."""
    results = []
    turn = 0
    while not stop.wait(every_s):
        try:
            version = choose_version(turn)
            turn += 1
            response = admin("POST", "/reload", json={"version": version})
            results.append({**response.json(), "status_code": response.status_code, "requested": version})
        except Exception as exc:
            results.append({"ok": False, "result": "error", "error": repr(exc), "turn": turn})
    return results


def record_key(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(prompt_ids), tuple(output_ids)


def check_soak(settings: TrafficSettings, requests: Sequence[SoakRequest], records: Sequence[SequenceRecord], *,
               references: dict[int, Sequence[int]] | None = None, corrupt_segments: int = 0,
               reloads: Sequence[dict] = ()) -> dict[str, Any]:
    """The soak's figures; every count named in the module docstring must be 0."""
    ok = [r for r in requests if r.ok]
    expected = Counter(record_key(settings.prompts[r.prompt_index], r.output_ids)
                       for r in ok if not r.is_opted_out)
    got = Counter(record_key(rec.tokens[:rec.prompt_len], rec.tokens[rec.prompt_len:]) for rec in records)
    greedy = [r for r in ok if r.temperature == 0.0 and references and r.prompt_index in references]
    mismatched = [r for r in greedy if r.output_ids != list(references[r.prompt_index])]
    return {
        "requests": len(requests), "ok": len(ok), "failed": len(requests) - len(ok),
        "opted_out": sum(r.is_opted_out for r in ok), "streamed": sum(r.is_stream for r in ok),
        "greedy": len(greedy), "greedy_mismatches": len(mismatched),
        "expected_records": sum(expected.values()), "records": sum(got.values()),
        "missing_records": sum((expected - got).values()), "extra_records": sum((got - expected).values()),
        "corrupt_segments": corrupt_segments,
        "reloads": len(reloads), "failed_reloads": sum(not r.get("ok") for r in reloads),
        "output_tokens": sum(len(r.output_ids) for r in ok),
        "errors": dict(Counter((r.error or "no output")[:80] for r in requests if not r.ok)),
    }


SOAK_FAILURES = ("failed", "missing_records", "extra_records", "greedy_mismatches", "corrupt_segments",
                 "failed_reloads")


def problems(figures: dict[str, Any]) -> dict[str, int]:
    """The counts of ``check_soak`` that are not 0 (empty: the soak passed)."""
    return {key: figures[key] for key in SOAK_FAILURES if figures.get(key)}


def request_rows(requests: Sequence[SoakRequest]) -> list[dict]:
    """Requests as JSON rows (output ids left out)."""
    return [{k: v for k, v in asdict(r).items() if k != "output_ids"} | {"num_output": len(r.output_ids)}
            for r in requests]
