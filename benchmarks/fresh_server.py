"""A fresh server under steady traffic: when speculation switches on by itself, and tokens/s against plain vLLM.

What a new user gets from `make run` on a fresh clone: `online-opd serve` with
configs/default.yaml and nothing else (speculation auto, capture, the online
trainer, gate and hot reload on, a fresh drafter in an empty run folder), under
steady closed-loop traffic from one domain for `--minutes`. The same traffic
goes to plain vLLM (same model, flags and CPU runtime settings, no speculative
config, no online-opd plugin) for `--plain-minutes` before the online-opd server
starts and again after it stops, so the baseline brackets the run in time.

Traffic: `--prompts` (HumanEval by default: one domain, code), chat endpoint,
temperature 0, `--max-tokens` each, `--concurrency` workers, the same request
order for every server (seed 0). Both servers are scraped every `--scrape-s`
seconds (serve/scrape.py); every figure comes from those scrapes:

- tokens/s per `--window-s` window from ``vllm:generation_tokens_total``;
- the policy's schedule (``online_opd_spec_k`` per batch-size range): the first
  scrape where some range speculates is "speculation switched on";
- served tau per window from ``vllm:spec_decode_*`` (exploration's blocks too),
  the drafter version serving, trainer steps and gate promotions.

The ratio of a window is its tokens/s over plain's mean tokens/s (both plain
periods together); both plain periods are also given, as the drift over the run.

    python benchmarks/fresh_server.py --minutes 30 --out benchmarks/results/fresh_server.json

One JSON object on stdout (also written to --out, the PNG beside it with the
same stem); logs on stderr.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from serve.launcher import ROOT, PlainVllmServer, ServerProcess, benchmark_logging, emit_result
from serve.loadgen import LoadConfig, run_load
from serve.report import load_scrapes
from serve.scrape import scrape_loop

logger = logging.getLogger("fresh_server")

TOKEN = "fresh-server-bench"
GENERATED = "vllm:generation_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_K = "online_opd_spec_k{batch_size_range="
REPLAYED = "online_opd_trainer_replayed_tokens_total"


def run_period(server: ServerProcess, name: str, minutes: float, scrapes: Path, args: argparse.Namespace) -> dict:
    """Wait for the server, then `minutes` of traffic while scraping; the load summary and the start time."""
    started = time.time()
    server.wait_ready(timeout=900)
    logger.info("%s: ready in %.0f s; %.1f min of traffic", name, time.time() - started, minutes)
    stop = threading.Event()
    scraper = threading.Thread(target=scrape_loop, args=(server.url, scrapes, args.scrape_s),
                               kwargs={"stop": stop}, daemon=True)
    t0 = time.time()
    scraper.start()
    try:
        summary = run_load(LoadConfig(
            base_url=f"{server.url}/v1", prompts=args.prompts, split="all" if args.prompts == "humaneval" else "train",
            num_prompts=256, max_tokens=args.max_tokens, temperature=0.0, concurrency=args.concurrency,
            duration=minutes * 60, progress=False, seed=0))
    finally:
        time.sleep(args.scrape_s)  # one scrape after the last request
        stop.set()
        scraper.join(30)
    logger.info("%s: %.1f tokens/s (%d ok, %d failed)", name, summary["output_tokens_per_s"],
                summary["requests_ok"], summary["requests_failed"])
    return {"t0": t0, "load": {k: summary[k] for k in (
        "output_tokens_per_s", "output_tokens", "requests_ok", "requests_failed", "wall_s")}}


def schedule_of(metrics: dict[str, float]) -> list[list[Any]]:
    """[[first, last, K], ...] from the ``online_opd_spec_k`` samples of one scrape."""
    rows = []
    for key, value in metrics.items():
        if key.startswith(SPEC_K) and value is not None:
            first, last = key[len(SPEC_K):-1].split("-")
            rows.append([int(first), int(last), int(value)])
    return sorted(rows)


def windows(scrapes: list[dict], t0: float, end: float, window_s: float) -> list[dict]:
    """Per window of `window_s` seconds between t0 and the load's end (the idle tail left out): tokens/s,
    served tau, and the schedule, version and trainer steps at its end."""
    out: list[dict] = []
    scrapes = [s for s in scrapes if s["time"] <= end + 1.0]
    if not scrapes:
        return out
    start = scrapes[0]
    for scrape in scrapes[1:]:
        if scrape["time"] - start["time"] < window_s and scrape is not scrapes[-1]:
            continue
        a, b = start["metrics"], scrape["metrics"]
        seconds = scrape["time"] - start["time"]
        def delta(name: str) -> float:
            return (b.get(name) or 0.0) - (a.get(name) or 0.0)

        drafts, accepted = delta(DRAFTS), delta(ACCEPTED)
        out.append({
            "t_end_s": round(scrape["time"] - t0, 1), "seconds": round(seconds, 1),
            "tokens_per_s": round(delta(GENERATED) / seconds, 3),
            "trainer_replayed_tokens_per_s": round(delta(REPLAYED) / seconds, 3),
            "drafts": drafts, "tau": round(1 + accepted / drafts, 4) if drafts else None,
            "schedule": schedule_of(b), "drafter_version": b.get("online_opd_drafter_version"),
            "trainer_steps": b.get("online_opd_trainer_steps_total"),
            "promotions": b.get("online_opd_gate_promotions_total"),
        })
        start = scrape
    return out


def switched_on(scrapes: list[dict], t0: float) -> dict | None:
    """The first scrape whose schedule speculates somewhere (some K > 0), or None."""
    for scrape in scrapes:
        schedule = schedule_of(scrape["metrics"])
        if any(k > 0 for _, _, k in schedule):
            return {"t_s": round(scrape["time"] - t0, 1), "schedule": schedule}
    return None


def plot(out: Path, online: list[dict], plain_mean: float, plain_periods: list[float], minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = [w["t_end_s"] / 60 for w in online]
    top.plot(xs, [w["tokens_per_s"] for w in online], marker=".", label="online-opd serve (defaults, fresh)")
    top.hlines(plain_mean, 0, minutes, colors="black", linestyles="--", label=f"plain vLLM, mean {plain_mean:.1f}")
    for value, style in zip(plain_periods, (":", "-.")):
        top.hlines(value, 0, minutes, colors="grey", linestyles=style, linewidth=0.8)
    top.set_ylim(bottom=0)
    top.set_ylabel("output tokens/s")
    top.legend(loc="lower right")
    top.set_title("Fresh server, steady traffic: tokens/s per window (grey: plain before / after)")
    bottom.step(xs, [max((k for first, _, k in w["schedule"] if first == 1), default=0) for w in online],
                where="post", color="tab:red", label="K at batch size 1 (policy)")
    bottom.set_ylim(-0.2, 4.5)
    bottom.set_ylabel("K at b=1")
    bottom.set_xlabel("minutes since the online-opd server was ready")
    twin = bottom.twinx()
    twin.plot(xs, [w["tau"] if w["tau"] is not None else float("nan") for w in online], color="tab:green",
              marker=".", label="served tau (window)")
    twin.set_ylabel("served tau")
    lines = bottom.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    bottom.legend(lines, [h.get_label() for h in lines], loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic to the online-opd server (default 30)")
    parser.add_argument("--plain-minutes", type=float, default=5.0,
                        help="traffic to plain vLLM before and again after the online-opd server (default 5 each)")
    parser.add_argument("--prompts", choices=("humaneval", "sharegpt"), default="humaneval")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--scrape-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra argument for `online-opd serve` (repeat; e.g. --serve-arg=--ngram-fallback)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep run folders and scrapes here")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (and the PNG beside it)")
    args = parser.parse_args()
    benchmark_logging()
    args.config = args.config.resolve()

    from online_opd.config import load_config
    from serve.cpu_runtime import runtime_env_for
    from serve.pipeline import resolve_target

    cfg = load_config(args.config)
    target = resolve_target(cfg, progress=False)
    with tempfile.TemporaryDirectory(prefix="fresh-server-") as tmp:
        base = (args.work_dir or Path(tmp)).resolve()

        def plain(tag: str) -> dict:
            server = PlainVllmServer(base / tag, target, dtype=cfg.model.serving_dtype(),
                                     max_model_len=cfg.model.max_model_len, max_num_seqs=args.max_num_seqs,
                                     runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores))
            try:
                period = run_period(server, tag, args.plain_minutes, base / tag / "scrapes.jsonl", args)
            finally:
                server.stop()
            period["windows"] = windows(load_scrapes(base / tag / "scrapes.jsonl")[0], period["t0"],
                                        period["t0"] + period["load"]["wall_s"], args.window_s)
            return period

        before = plain("plain-before")
        server = ServerProcess(base / "online-opd", args.config, *args.serve_arg, "--max-num-seqs",
                               str(args.max_num_seqs), token=TOKEN)
        try:
            online = run_period(server, "online-opd", args.minutes, base / "online-opd" / "scrapes.jsonl", args)
        finally:
            server.stop()
        log_lines = [line for line in (base / "online-opd" / "server.log").read_text().splitlines()
                     if "speculation schedule" in line or "promot" in line or "rolled back" in line]
        after = plain("plain-after")
        scrapes = load_scrapes(base / "online-opd" / "scrapes.jsonl")[0]
        online["windows"] = windows(scrapes, online["t0"], online["t0"] + online["load"]["wall_s"], args.window_s)

    plain_periods = [p["load"]["output_tokens_per_s"] for p in (before, after)]
    plain_tokens = sum(p["load"]["output_tokens"] for p in (before, after))
    plain_mean = plain_tokens / sum(p["load"]["wall_s"] for p in (before, after))
    ratios = [round(w["tokens_per_s"] / plain_mean, 4) for w in online["windows"]]
    last = [w for w in online["windows"] if w["t_end_s"] > (args.minutes - 10) * 60]
    last_ratio = (sum(w["tokens_per_s"] * w["seconds"] for w in last) / sum(w["seconds"] for w in last) / plain_mean
                  if last else None)
    png = args.out.with_suffix(".png") if args.out else None
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(png, online["windows"], plain_mean, plain_periods, args.minutes)
    result = {
        "benchmark": "fresh_server", "config": str(args.config), "serve_args": args.serve_arg,
        "traffic": {"prompts": args.prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                    "temperature": 0.0, "endpoint": "chat", "minutes": args.minutes,
                    "plain_minutes_each": args.plain_minutes},
        "plain": "vllm serve, same model, flags and CPU runtime settings (config cpu:), no speculative config, "
                 "no online-opd plugin; before and after the online-opd server",
        "speculation_switched_on": switched_on(scrapes, online["t0"]),
        "tokens_per_s": {"online_opd": online["load"]["output_tokens_per_s"], "plain_before": plain_periods[0],
                         "plain_after": plain_periods[1], "plain_mean": round(plain_mean, 3)},
        "ratio_whole_run": round(online["load"]["output_tokens_per_s"] / plain_mean, 4),
        "ratio_last_10_min": round(last_ratio, 4) if last_ratio is not None else None,
        "ratio_per_window": {"median": statistics.median(ratios) if ratios else None, "values": ratios},
        # issue 11's "a trainer that keeps up": tokens the trainer replayed (sequence + drafted blocks)
        # per output token served, over the whole run (from the last scrape; the counters start at 0)
        "trainer_replayed_per_served_token": round((scrapes[-1]["metrics"].get(REPLAYED) or 0.0)
                                                   / max(online["load"]["output_tokens"], 1), 4) if scrapes else None,
        "requests_failed": sum(p["load"]["requests_failed"] for p in (before, online, after)),
        "final_window": online["windows"][-1] if online["windows"] else None,
        "policy_log": log_lines[-40:],
        "windows": {"online_opd": online["windows"], "plain_before": before["windows"],
                    "plain_after": after["windows"]},
        "loads": {"online_opd": online["load"], "plain_before": before["load"], "plain_after": after["load"]},
        "png": str(png) if png else None,
        "note": "one run on a shared 2-core machine; the online trainer shares those cores with serving",
    }
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
