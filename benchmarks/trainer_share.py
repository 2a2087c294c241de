"""The online trainer's share of the CPU while `online-opd serve` serves: trainer step time and serving tokens/s.

The engine binds its OpenMP threads to every core (configs/default.yaml `cpu:`,
the fastest plain-vLLM settings), and the online trainer shares those cores
(`online.cpu_priority`, `online.duty_cycle`).
Each variant is a fresh `online-opd serve` (defaults, fresh drafter, trainer on)
with extra environment entries, under the same closed-loop traffic for
`--minutes`. The variants test ways to give the trainer its share:

- `default`: the config's settings (configs/default.yaml: the trainer's process and its Ray on SCHED_IDLE,
  no step while the engine serves, `online.duty_cycle: 0`, and Ray and the actor stopped after 30 s of
  serving, `online.hibernate_after_s: 30`);
- `normal_priority`: `online.cpu_priority=normal`, the trainer competes with the engine;
- `trainer_off`: `online.enabled=false`, what serving does without a trainer;
- other variants with `--variant NAME=KEY=VALUE,KEY=VALUE` (a KEY with a dot is a config override,
  any other an environment variable, e.g. `KMP_BLOCKTIME=0`).

Per variant: output tokens/s, the trainer's steps, mean seconds per step
(`train_seconds / steps` from its stats), replayed tokens per second of wall
time and seconds rested (the duty cycle), all read at the end of the traffic, and the
CPU time the trainer's process tree (the trainer process, its Ray and the actor) and the
rest of the server (API server, engine core, workers) used over the traffic, in cores.
With `--idle-minutes` the server then stays without traffic that long, and the
trainer's steps and replayed tokens per second over that idle time are reported
too (`online.idle_duty_cycle`: it trains back to back once it sees the engine idle).

    python benchmarks/trainer_share.py --minutes 5 --idle-minutes 2 --out benchmarks/results/trainer_share.json

One JSON object on stdout (also written to --out); logs on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from serve.launcher import ROOT, ServerProcess, benchmark_logging, emit_result
from serve.loadgen import LoadConfig, run_load

logger = logging.getLogger("trainer_share")


Variant = tuple[str, dict[str, str], list[str]]


def parse_variant(text: str) -> Variant:
    """NAME=KEY=VALUE[,KEY=VALUE]: a KEY with a dot is a config override (`online.cpu_priority=normal`),
    any other an environment variable (`KMP_BLOCKTIME=0`)."""
    name, _, assignments = text.partition("=")
    pairs = [a.split("=", 1) for a in assignments.split(",") if a]
    if not name or any(len(p) != 2 or not p[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"expected NAME=KEY=VALUE[,KEY=VALUE], got {text!r}")
    env = {k: v for k, v in pairs if "." not in k}
    overrides = [f"{k}={v}" for k, v in pairs if "." in k]
    return name, env, overrides


DEFAULT_VARIANTS = [parse_variant(v) for v in (
    "default=", "normal_priority=online.cpu_priority=normal", "trainer_off=online.enabled=false")]


def run_variant(variant: Variant, run_dir: Path, args: argparse.Namespace) -> dict:
    name, env, overrides = variant
    options = [arg for override in overrides for arg in ("-o", override)]
    server = ServerProcess(run_dir, args.config, *options, *args.serve_arg, token="trainer-share", env=env)
    try:
        server.wait_ready(timeout=900)
        cpu_before = _cpu_seconds(server.proc.pid)
        summary = run_load(LoadConfig(
            base_url=f"{server.url}/v1", prompts=args.prompts, split="all" if args.prompts == "humaneval" else "train",
            num_prompts=256, max_tokens=args.max_tokens, temperature=0.0, concurrency=args.concurrency,
            duration=args.minutes * 60, progress=False, seed=0))
        cpu_after = _cpu_seconds(server.proc.pid)
        time.sleep(2)
        stats = _trainer_stats(run_dir)
        if args.idle_minutes and stats:
            time.sleep(args.idle_minutes * 60)
            after = _trainer_stats(run_dir)
    finally:
        server.stop()
    steps = stats.get("steps") or 0
    result = {
        "env": env, "overrides": overrides, "output_tokens_per_s": summary["output_tokens_per_s"], "requests_ok": summary["requests_ok"],
        "requests_failed": summary["requests_failed"], "wall_s": summary["wall_s"], "trainer_steps": steps,
        "trainer_seconds_per_step": round(stats["train_seconds"] / steps, 2) if steps else None,
        "trainer_replayed_tokens_per_wall_s": round((stats.get("replayed_tokens") or 0) / summary["wall_s"], 2),
        "trainer_rest_s": round(stats.get("rest_seconds") or 0, 1), "records_seen": stats.get("records_seen"),
        "cores_used": {part: round((cpu_after[part] - cpu_before.get(part, 0.0)) / summary["wall_s"], 3)
                       for part in cpu_after},
    }
    if args.idle_minutes and stats:
        idle_s = args.idle_minutes * 60
        result["idle"] = {
            "minutes": args.idle_minutes, "trainer_steps": (after.get("steps") or 0) - steps,
            "trainer_replayed_tokens_per_wall_s": round(
                ((after.get("replayed_tokens") or 0) - (stats.get("replayed_tokens") or 0)) / idle_s, 2),
            "trainer_rest_s": round((after.get("rest_seconds") or 0) - (stats.get("rest_seconds") or 0), 1),
            "engines_idle_at_end": after.get("engines_idle")}
    logger.info("%s: %s", name, result)
    return result


def _cpu_seconds(server_pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of the server's process tree, split into the trainer's part (the
    `serve.trainer_process` child and its descendants) and the rest; processes gone since count no
    more (a trainer restart would show as a drop)."""
    import psutil

    def seconds(proc: psutil.Process) -> float:
        try:
            times = proc.cpu_times()
            return times.user + times.system
        except psutil.Error:
            return 0.0

    server = psutil.Process(server_pid)
    tree = [server, *server.children(recursive=True)]
    trainer: set[int] = set()
    for proc in tree:
        try:
            if "serve.trainer_process" in " ".join(proc.cmdline()):
                trainer |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.Error:
            continue
    out = {"trainer": 0.0, "server": 0.0}
    for proc in tree:
        out["trainer" if proc.pid in trainer else "server"] += seconds(proc)
    return out


def _trainer_stats(run_dir: Path) -> dict:
    """The trainer's latest figures, as its supervisor wrote them; {} when the trainer is off."""
    stats_file = run_dir / "trainer_stats.json"
    return json.loads(stats_file.read_text()) if stats_file.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--idle-minutes", type=float, default=0.0,
                        help="then leave each server without traffic this long and report the trainer's steps")
    parser.add_argument("--prompts", choices=("humaneval", "sharegpt"), default="humaneval")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--variant", type=parse_variant, action="append", default=None,
                        help="NAME=KEY=VALUE[,KEY=VALUE], a KEY with a dot a config override, else an environment "
                             "variable (repeat; default: the defaults, online.cpu_priority=normal, the trainer off)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra argument for `online-opd serve`")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    benchmark_logging()
    args.config = args.config.resolve()
    variants = args.variant or DEFAULT_VARIANTS
    with tempfile.TemporaryDirectory(prefix="trainer-share-") as tmp:
        results = {v[0]: run_variant(v, Path(tmp) / v[0], args) for v in variants}
    emit_result({"benchmark": "trainer_share", "config": str(args.config), "minutes": args.minutes,
                 "idle_minutes": args.idle_minutes,
                 "traffic": {"prompts": args.prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                             "temperature": 0.0},
                 "variants": results,
                 "note": "one run per variant, one after the other, on a shared 2-core machine"}, args.out)


if __name__ == "__main__":
    main()
