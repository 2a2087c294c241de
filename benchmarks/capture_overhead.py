"""Capture overhead: served output tokens/s with capture ON vs OFF, at concurrency 1 and 16.

Each mode runs in its own `online-opd serve` process (`--no-train`, the same
`--drafter`, `--max-num-seqs 16`): capture ON is the default server, OFF adds
`--no-capture` (the endpoint plugin, /metrics polling and admin routes stay on
in both, so the capture plugin is the only difference). A round starts one
server per mode, one after the other; the order alternates between rounds
(on, off, off, on, ...) to spread drift of the machine over both modes.

Per server and concurrency: a warm-up of a few requests, then a fixed
closed-loop load (`serve.loadgen.run_load`): held-out ShareGPT prompts,
temperature 0, `ignore_eos` so every request generates exactly `--max-tokens`.
The ratio on/off is reported per round and as the median over rounds; the
target is ratio >= 0.98. The ON server's capture counters
(online_opd_records_captured_total / _dropped_total) are read from /metrics
after its engine status has been refreshed.

The machine is shared and noisy (2 CPU cores, vLLM's CPU backend), so a single
round's ratio can swing by several percent either way: read the median over
rounds, and run more `--rounds` for a tighter figure.

    python benchmarks/capture_overhead.py --rounds 2 --out runs/bench/capture_overhead.json

``--teacher-top-k N`` measures the verifier-as-teacher capture instead: mode
"teacher" (capture with ``capture.teacher_top_k=N``, every captured request
carrying it) against mode "on" (capture without it), target ratio >= 0.97;
each server's buffer is read after it stops for its bytes per captured block.

    python benchmarks/capture_overhead.py --teacher-top-k 20 --out runs/bench/teacher_overhead.json

``--hidden-sample-rate F`` adds the target's features to the teacher server
(``capture.hidden_sample_rate``: that share of its teacher-carrying requests
keeps the aux hidden states); the buffer figures then count the records with
them and their bytes.

One JSON object on stdout (also written to --out); logs on stderr.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from serve.launcher import ROOT, ServerProcess, benchmark_logging, emit_result
from serve.loadgen import LoadConfig, run_load

logger = logging.getLogger("capture_overhead")

TOKEN = "capture-overhead-bench"
DEFAULT_DRAFTER = ROOT / "runs" / "bootstrap" / "drafter"
TARGET_RATIO = 0.98
TEACHER_TARGET_RATIO = 0.97
CONCURRENCIES = (1, 16)


def check_drafter(path: Path) -> Path:
    """The drafter folder, or SystemExit with the way to make one."""
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise SystemExit(f"no drafter checkpoint at {path}: run `online-opd bootstrap` first "
                         "(or pass --drafter DIR)")
    return path.resolve()


def measure(server: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up then the fixed load at each concurrency; the load summaries by concurrency."""
    base_url = f"{server.url}/v1"
    out: dict[str, Any] = {}
    for concurrency in CONCURRENCIES:
        requests = args.requests_c1 if concurrency == 1 else args.requests_c16
        common = dict(base_url=base_url, prompts="sharegpt", split="held_out", num_prompts=256,
                      max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, concurrency=concurrency,
                      progress=False)
        run_load(LoadConfig(**common, seed=1, num_requests=max(args.warmup, concurrency)))
        summary = run_load(LoadConfig(**common, seed=0, num_requests=requests))
        logger.info("  c=%d: %.1f tokens/s (%d ok, %d failed, %.1f s)", concurrency,
                    summary["output_tokens_per_s"], summary["requests_ok"], summary["requests_failed"],
                    summary["wall_s"])
        out[str(concurrency)] = {k: summary[k] for k in (
            "output_tokens_per_s", "output_tokens", "requests_ok", "requests_failed", "wall_s",
            "latency_p50_s", "latency_p95_s")}
        out[str(concurrency)]["requests_sent"] = requests + max(args.warmup, concurrency)
    return out


def capture_counters(server: ServerProcess) -> dict[str, float]:
    """Captured/dropped records of the ON server, after refreshing its polled engine status."""
    reply = server.admin("GET", "/status")
    reply.raise_for_status()
    metrics = server.metrics()
    writer = ((reply.json() or {}).get("capture") or {}).get("writer") or {}
    return {"records_captured": metrics.get("online_opd_records_captured_total", float("nan")),
            "records_dropped": metrics.get("online_opd_records_dropped_total", float("nan")),
            "capture_errors": metrics.get("online_opd_capture_errors_total", float("nan")),
            "buffer_bytes": writer.get("buffer_bytes")}


def buffer_figures(buffer: Path) -> dict[str, Any]:
    """Bytes on disk per captured block (segments as written: Parquet, zstd) and the blocks with teacher."""
    from online_opd.traces.buffer import BufferReader

    reader = BufferReader(buffer)
    segments = reader.segments() if reader.exists() else []
    records = [record for info in segments for record in reader.read_segment(info)]
    blocks = [b for record in records for b in record.blocks]
    size = sum(info.bytes for info in segments)
    hidden = [r.hidden for r in records if r.hidden is not None]
    return {"segment_bytes": size, "blocks": len(blocks),
            "teacher_blocks": sum(b.teacher is not None for b in blocks),
            "bytes_per_block": round(size / len(blocks), 1) if blocks else None,
            "records": len(records), "hidden_records": len(hidden),
            "hidden_rows": sum(h.num_rows for h in hidden), "hidden_raw_bytes": sum(len(h.data) for h in hidden),
            "hidden_positions_from_start": sum(h.start == 0 for h in hidden)}


def run_server(mode: str, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start one server in `mode` (on / off / teacher), measure it, stop it."""
    extra = ["--no-train", "--drafter", str(args.drafter), "--max-num-seqs", "16", *shlex.split(args.serve_args)]
    if mode == "off":
        extra.append("--no-capture")
    if mode == "teacher":
        extra += ["-o", f"capture.teacher_top_k={args.teacher_top_k}",
                  "-o", f"capture.teacher_sample_rate={args.teacher_sample_rate}",
                  "-o", f"capture.hidden_sample_rate={args.hidden_sample_rate}"]
    server = ServerProcess(run_dir, args.config, *extra, token=TOKEN)
    start = time.perf_counter()
    try:
        server.wait_ready(timeout=900)
        logger.info("%s: server ready in %.0f s", mode, time.perf_counter() - start)
        result: dict[str, Any] = {"by_concurrency": measure(server, args)}
        if mode != "off":
            result["capture"] = capture_counters(server)
            sent = sum(c["requests_sent"] for c in result["by_concurrency"].values())
            result["capture"]["requests_sent"] = sent
    finally:
        server.stop()
    if mode != "off":
        result["capture"].update(buffer_figures(server.buffer))
    return result


def ratio(on: float, off: float) -> float | None:
    return round(on / off, 4) if off > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--rounds", type=int, default=2, help="server pairs; order alternates (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-c1", type=int, default=8)
    parser.add_argument("--requests-c16", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=4,
                        help="warm-up requests per concurrency (at least the concurrency; default 4)")
    parser.add_argument("--teacher-top-k", type=int, default=0,
                        help="measure capture with the verifier's top-k (mode 'teacher') against capture "
                             "without it (mode 'on'); default 0: capture on against off")
    parser.add_argument("--teacher-sample-rate", type=float, default=1.0,
                        help="capture.teacher_sample_rate of the 'teacher' server (default 1: every request)")
    parser.add_argument("--hidden-sample-rate", type=float, default=0.0,
                        help="capture.hidden_sample_rate of the 'teacher' server (default 0: no target features)")
    parser.add_argument("--serve-args", default="",
                        help="more `online-opd serve` arguments for every server, as shell words "
                             "(e.g. '--speculation always': drafts at every batch size)")
    parser.add_argument("--run-dir", type=Path, default=None, help="server folders (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    benchmark_logging()
    args.drafter = check_drafter(args.drafter)
    args.config = args.config.resolve()

    # (measured, against): capture against none, or capture with the teacher against capture without
    pair = ("teacher", "on") if args.teacher_top_k > 0 else ("on", "off")
    target = TEACHER_TARGET_RATIO if args.teacher_top_k > 0 else TARGET_RATIO
    with tempfile.TemporaryDirectory(prefix="capture-overhead-") as tmp:
        base = args.run_dir or Path(tmp)
        rounds = []
        for r in range(args.rounds):
            order = pair if r % 2 == 0 else pair[::-1]
            modes = {}
            for mode in order:
                logger.info("round %d: capture %s", r, mode)
                modes[mode] = run_server(mode, base / f"round{r}-{mode}", args)
            tps = {m: {c: v["output_tokens_per_s"] for c, v in modes[m]["by_concurrency"].items()} for m in pair}
            rounds.append({"round": r, "order": list(order), "tokens_per_s": tps,
                           "ratio": {c: ratio(tps[pair[0]][c], tps[pair[1]][c]) for c in tps[pair[0]]},
                           "capture": {m: modes[m]["capture"] for m in pair if "capture" in modes[m]},
                           "detail": {m: modes[m]["by_concurrency"] for m in pair}})

    per_concurrency = {}
    for c in map(str, CONCURRENCIES):
        ratios = [r["ratio"][c] for r in rounds if r["ratio"][c] is not None]
        median = round(statistics.median(ratios), 4) if ratios else None
        per_concurrency[c] = {
            "ratio_median": median, "ratio_per_round": ratios,
            **{f"tokens_per_s_{m}": [r["tokens_per_s"][m][c] for r in rounds] for m in pair},
            "target_met": median is not None and median >= target}
    failed = sum(d[c]["requests_failed"] for r in rounds for d in r["detail"].values() for c in d)
    captured = [m for m in pair if m != "off"]
    result = {
        "benchmark": "capture_overhead" + ("_teacher" if args.teacher_top_k > 0 else ""),
        "drafter": str(args.drafter), "config": str(args.config), "rounds": args.rounds,
        "teacher_top_k": args.teacher_top_k, "teacher_sample_rate": args.teacher_sample_rate,
        "hidden_sample_rate": args.hidden_sample_rate,
        "serve_args": args.serve_args,
        "max_tokens": args.max_tokens, "requests": {"1": args.requests_c1, "16": args.requests_c16},
        "warmup": args.warmup, "prompts": "sharegpt held_out, temperature 0, ignore_eos",
        "target": f"tokens/s ratio {pair[0]}/{pair[1]} >= {target} (median over rounds)",
        "per_concurrency": per_concurrency,
        "target_met": all(v["target_met"] for v in per_concurrency.values()),
        "requests_failed": failed,
        "capture": {m: {key: [r["capture"][m][key] for r in rounds] for key in (
            "records_captured", "records_dropped", "requests_sent", "blocks", "teacher_blocks", "bytes_per_block",
            "records", "hidden_records", "hidden_rows", "hidden_raw_bytes", "hidden_positions_from_start")}
            for m in captured},
        "rounds_detail": rounds,
        "note": "each mode runs in its own server process; shared 2-core machine, expect noise of a few %",
    }
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
