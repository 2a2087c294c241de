"""Hot-reload latency under load, against the decode step time of the same server.

One `online-opd serve` process (capture on, `--no-train`, `--drafter D`, admin
token set). A closed loop of `--concurrency` streaming chat requests
(held-out ShareGPT prompts, temperature 0, `ignore_eos`, `--max-tokens`) runs
for the whole benchmark. Two phases:

1. baseline, no reloads (`--baseline-seconds`): the decode step time is the
   median interval between consecutive streamed chunks of those requests.
   Requests are sent with `return_token_ids`, so vLLM streams one chunk per
   engine step even when a step's text is empty; with speculative decoding one
   step emits several tokens, so a chunk is a step, not a token.
2. `--reloads` admin reloads (`POST /online-opd/v1/reload`), one every
   `--interval` seconds, alternating between D and a copy of D saved as
   version "bench-b" (same weights, its own manifest and sha256s, so every
   reload goes through all checks and really swaps the version).

Per reload it records:

- engine_seconds: time inside the worker's reload call (hash and tensor
  checks, load, repack), from the reply; the engine runs no step meanwhile;
- rpc_seconds: the server's `collective_rpc` round trip, from the reply;
- post_seconds: the admin POST as the client sees it (the route also refreshes
  the engine status after the reload: one more RPC, so one more step boundary);
- publish_to_new_step_s: from sending the POST to the first chunk, received
  after the reply, of a separate streaming "probe" request started just before
  the reload (already decoding). For an admin-triggered reload this is the time
  from publishing a version to the first step that uses its weights, as a
  client sees it (registry publish -> reloader poll is not part of it). It is
  an upper bound: the reply itself waits for the status refresh, so the first
  step on the new weights has usually already run when the reply arrives;
- stall_s: the longest chunk gap of the load requests that spans the reload.

The target is engine_seconds <= one decode step (median engine_seconds over
the median step); the max is reported too. Any failed request (load or probe)
is counted; a reload that is not ok or reports another version is an error.
The machine is shared and has 2 CPU cores: the client, the API server and the
engine compete for them, so client-side timings carry that noise.

    python benchmarks/reload_latency.py --reloads 10 --out runs/bench/reload_latency.json

One JSON object on stdout (also written to --out); logs on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from online_opd.data import Prompt
from serve.clients import http_limits, openai_client
from serve.launcher import ROOT, ServerProcess, benchmark_logging, emit_result
from serve.loadgen import select_prompts

logger = logging.getLogger("reload_latency")

TOKEN = "reload-latency-bench"
DEFAULT_DRAFTER = ROOT / "runs" / "bootstrap" / "drafter"
COPY_VERSION = "bench-b"


@dataclass
class Stream:
    """One streaming request: arrival time of each chunk that carries tokens (perf_counter)."""

    start: float
    chunks: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False
    new_chunk: asyncio.Event = field(default_factory=asyncio.Event)


def check_drafter(path: Path) -> Path:
    """The drafter folder, or SystemExit with the way to make one."""
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise SystemExit(f"no drafter checkpoint at {path}: run `online-opd bootstrap` first "
                         "(or pass --drafter DIR)")
    return path.resolve()


def make_copy(drafter: Path, dest: Path) -> Path:
    """D saved again as version "bench-b" (same weights; manifest and sha256s of its own)."""
    from online_opd.models.drafters.checkpoint import load_drafter, read_manifest, save_drafter

    parent = read_manifest(drafter).get("version")
    return save_drafter(load_drafter(drafter), dest, version=COPY_VERSION, parent_version=parent)


async def stream_request(client: Any, model: str, prompt: Prompt, max_tokens: int, record: Stream) -> None:
    """Send one streaming chat request, recording chunk arrival times; failures go to record.error."""
    try:
        response = await client.chat.completions.create(
            model=model, messages=prompt.messages, max_completion_tokens=max_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async with response:
            async for chunk in response:
                now = time.perf_counter()
                for choice in chunk.choices:
                    ids = getattr(choice, "token_ids", None) or []
                    if ids:
                        record.chunks.append(now)
                        record.chunk_tokens.append(len(ids))
                        record.new_chunk.set()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a failed request is data
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.done = True
        record.new_chunk.set()


class Load:
    """Closed loop of streaming requests until stopped."""

    def __init__(self, client: Any, model: str, prompts: list[Prompt], concurrency: int, max_tokens: int):
        self.client, self.model, self.prompts = client, model, prompts
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.records: list[Stream] = []
        self.stopping = False
        self.next = 0
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._worker()) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        """Stop issuing; requests in flight finish."""
        self.stopping = True
        await asyncio.gather(*self.tasks)

    async def _worker(self) -> None:
        while not self.stopping:
            prompt = self.prompts[self.next % len(self.prompts)]
            self.next += 1
            record = Stream(start=time.perf_counter())
            self.records.append(record)
            await stream_request(self.client, self.model, prompt, self.max_tokens, record)


def gaps_within(records: list[Stream], t0: float, t1: float) -> list[float]:
    """Chunk-to-chunk intervals (steps) of all requests, both chunks inside [t0, t1]."""
    out = []
    for r in records:
        times = [t for t in r.chunks if t0 <= t <= t1]
        out += [b - a for a, b in zip(times, times[1:])]
    return out


def tokens_per_step(records: list[Stream], t0: float, t1: float) -> float | None:
    """Mean tokens per streamed chunk (= per engine step, 1 + accepted drafts) inside [t0, t1]."""
    counts = [n for r in records for t, n in zip(r.chunks, r.chunk_tokens) if t0 <= t <= t1]
    return round(sum(counts) / len(counts), 3) if counts else None


def spanning_gap(records: list[Stream], t0: float, t1: float) -> float | None:
    """The longest chunk gap of any request that overlaps the interval [t0, t1]."""
    best = None
    for r in records:
        for a, b in zip(r.chunks, r.chunks[1:]):
            if a <= t1 and b >= t0:
                best = max(best or 0.0, b - a)
    return best


async def reload_once(admin: httpx.AsyncClient, client: Any, model: str, prompt: Prompt, path: Path,
                      expected: str, probe_tokens: int) -> dict[str, Any]:
    """Start a probe stream, wait for it to decode, reload, and time the probe's first chunk after it."""
    probe = Stream(start=time.perf_counter())
    task = asyncio.ensure_future(stream_request(client, model, prompt, probe_tokens, probe))
    try:
        while not probe.chunks and not probe.done:
            probe.new_chunk.clear()
            await probe.new_chunk.wait()
        sent = time.perf_counter()
        reply = await admin.post("/reload", json={"path": str(path)})
        replied = time.perf_counter()
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        while not probe.done and not (probe.chunks and probe.chunks[-1] > replied):
            probe.new_chunk.clear()
            await probe.new_chunk.wait()
        after = next((t for t in probe.chunks if t > replied), None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ok = reply.status_code == 200 and body.get("ok") is True and body.get("version") == expected
    return {"to": expected, "ok": ok, "status_code": reply.status_code, "version": body.get("version"),
            "error": None if ok else (body.get("error") or reply.text[:300]),
            "engine_seconds": body.get("engine_seconds"), "rpc_seconds": body.get("rpc_seconds"),
            "post_seconds": replied - sent,
            "publish_to_new_step_s": None if after is None else after - sent,
            "probe_error": probe.error, "_window": (sent, replied)}


def r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


async def measure(server: ServerProcess, args: argparse.Namespace, paths: list[tuple[Path, str]]) -> dict:
    prompts = select_prompts("sharegpt", "held_out", 256, seed=0)
    api_client = openai_client(f"{server.url}/v1", asynchronous=True, timeout=600)
    admin_client = httpx.AsyncClient(base_url=f"{server.url}/online-opd/v1", timeout=120, limits=http_limits(),
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    async with api_client as client, admin_client as admin:
        model = (await client.models.list()).data[0].id
        warm = [Stream(start=time.perf_counter()) for _ in range(args.concurrency)]
        await asyncio.gather(*(stream_request(client, model, prompts[-1 - i], args.max_tokens, w)
                               for i, w in enumerate(warm)))
        load = Load(client, model, prompts, args.concurrency, args.max_tokens)
        load.start()
        await asyncio.sleep(min(5.0, args.baseline_seconds / 3))  # reach steady state
        t0 = time.perf_counter()
        await asyncio.sleep(args.baseline_seconds)
        t1 = time.perf_counter()
        steps = gaps_within(load.records, t0, t1)
        logger.info("baseline: %d step intervals, median %.1f ms", len(steps),
                    1e3 * statistics.median(steps) if steps else float("nan"))
        reloads = []
        next_at = time.perf_counter()
        for i in range(args.reloads):
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            next_at = time.perf_counter() + args.interval
            path, version = paths[i % 2]
            result = await reload_once(admin, client, model, prompts[(i * 7 + 100) % len(prompts)], path,
                                       version, 4 * args.max_tokens)
            reloads.append(result)
            logger.info("reload %d -> %s: ok=%s engine %.1f ms, rpc %.1f ms, publish->new step %s ms", i,
                        version, result["ok"], 1e3 * (result["engine_seconds"] or float("nan")),
                        1e3 * (result["rpc_seconds"] or float("nan")),
                        None if result["publish_to_new_step_s"] is None
                        else round(1e3 * result["publish_to_new_step_s"], 1))
        await asyncio.sleep(1.0)
        await load.stop()
        status = (await admin.get("/status")).json()
    for r in reloads:
        r["stall_s"] = r4(spanning_gap(load.records, *r.pop("_window")))
        for k in ("engine_seconds", "rpc_seconds", "post_seconds", "publish_to_new_step_s"):
            r[k] = r4(r[k])
    failed = [r.error for r in load.records if r.error]
    failed += [r["probe_error"] for r in reloads if r["probe_error"]]
    return {"steps": steps, "reloads": reloads, "failed": failed, "status": status,
            "load_requests": len(load.records),
            "tokens_per_step": tokens_per_step(load.records, t0, t1)}


def summarize(raw: dict, args: argparse.Namespace) -> dict[str, Any]:
    steps, reloads = raw["steps"], raw["reloads"]
    step = statistics.median(steps) if steps else None
    engine = [r["engine_seconds"] for r in reloads if r["engine_seconds"] is not None]
    publish = [r["publish_to_new_step_s"] for r in reloads if r["publish_to_new_step_s"] is not None]
    stalls = [r["stall_s"] for r in reloads if r["stall_s"] is not None]
    rpc = [r["rpc_seconds"] for r in reloads if r["rpc_seconds"] is not None]
    med, top = (statistics.median(engine), max(engine)) if engine else (None, None)
    ratio = None if med is None or not step else med / step
    ratio_max = None if top is None or not step else top / step
    return {
        "benchmark": "reload_latency",
        "drafter": str(args.drafter), "config": str(args.config),
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "reloads": args.reloads,
        "interval_s": args.interval,
        "step_s_median": r4(step),
        "step_s_p90": r4(statistics.quantiles(steps, n=10)[-1]) if len(steps) >= 2 else None,
        "step_intervals": len(steps), "tokens_per_step": raw["tokens_per_step"],
        "engine_seconds_median": r4(med), "engine_seconds_max": r4(top),
        "rpc_seconds_median": r4(statistics.median(rpc)) if rpc else None,
        "publish_to_new_step_s_median": r4(statistics.median(publish)) if publish else None,
        "publish_to_new_step_s_max": r4(max(publish)) if publish else None,
        "stall_s_median": r4(statistics.median(stalls)) if stalls else None,
        "stall_s_max": r4(max(stalls)) if stalls else None,
        "engine_over_step_median": r4(ratio), "engine_over_step_max": r4(ratio_max),
        "target": "engine_seconds <= one decode step (median engine_seconds / median step)",
        "target_met": ratio is not None and ratio <= 1.0,
        "target_met_by_max": ratio_max is not None and ratio_max <= 1.0,
        "reloads_ok": sum(r["ok"] for r in reloads),
        "requests_failed": len(raw["failed"]), "failures": raw["failed"][:5],
        "no_request_failed": not raw["failed"],
        "load_requests": raw["load_requests"],
        "engine_reload_counts": (raw["status"] or {}).get("reloads"),
        "per_reload": reloads,
        "note": "publish_to_new_step_s: POST sent -> first chunk after the reply of a probe stream "
                "started just before the reload (admin-triggered reload); shared 2-core machine, "
                "client timings noisy",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between reload starts")
    parser.add_argument("--baseline-seconds", type=float, default=15.0,
                        help="load without reloads to measure the step time (default 15)")
    parser.add_argument("--run-dir", type=Path, default=None, help="server folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    benchmark_logging()
    args.drafter = check_drafter(args.drafter)
    args.config = args.config.resolve()

    with tempfile.TemporaryDirectory(prefix="reload-latency-") as tmp:
        base = args.run_dir or Path(tmp)
        copy = make_copy(args.drafter, base / "drafters" / COPY_VERSION)
        from online_opd.models.drafters.checkpoint import read_manifest

        paths = [(copy, COPY_VERSION), (args.drafter, str(read_manifest(args.drafter).get("version")
                                                            or args.drafter.name))]
        server = ServerProcess(base / "server", args.config, "--no-train", "--drafter", str(args.drafter),
                               "--max-num-seqs", "16", token=TOKEN)
        try:
            server.wait_ready(timeout=900)
            logger.info("server ready")
            raw = asyncio.run(measure(server, args, paths))
        finally:
            server.stop()
    result = summarize(raw, args)
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
