"""Serving overhead, paired: `online-opd serve` variants vs plain vLLM, all servers up at once.

What does a server cost against plain vLLM where it does not speculate (a fresh
drafter: the policy's K = 0), and which part of it costs what? Separate runs one
after the other (benchmarks/speculation_policy.py) move by 5-10% on this shared
2-core machine, more than the gap to explain. Here every server is started
first and then measured in short alternating blocks, so the machine's drift
falls on all of them alike:

- `plain`: `vllm serve` in-process (serve/server.py ``run_vllm_serve``), the same
  model, flags and CPU runtime settings (the config's `cpu:` section), no
  speculative config and no online-opd plugin: the baseline;
- one `online-opd serve` per `--variant NAME=ARGS` (extra serve arguments, shell
  words), each with `--drafter` naming a fresh drafter (the trainer stays off).
  By default `default` (no extra arguments), `nocap` (`--no-capture`) and
  `never` (`--speculation never`, which keeps capture and the plugin).

A cycle runs one block per server, in an order that rotates each cycle; a block
is one untimed warm-up request (a server idle for a while spins down its busy
loops) and then `--block-requests` x c requests, closed loop, the same requests
for every server of the cycle (temperature 0, `ignore_eos`). A variant's ratio
in a cycle is its tokens/s over plain's in the same cycle; the JSON reports the
per-cycle ratios, their median and mean with a 95% t-interval, and per server
the engine's work over its timed blocks (`engine_work`, from vLLM's counters:
tokens computed per output token, prefix-cache hit rate): a variant that
computes more than plain for the same requests shows there. For an auto-policy
server also its engine's step seconds in the blocks (`step_seconds`): steady
decode steps the policy times, at K = 0 and K > 0, and the untimed ones (prefill,
mixed) by whether they drafted, which the policy's predictions do not cover. They
come from the admin status, which is the policy loop's last poll of the engine (a
minute apart on an idle server here): per block they are shifted, over all blocks
they are close. With K > 0, a decode step in which a request that just finished
its prefill verifies no drafts yet is untimed too. Idle servers
stay up meanwhile. With `--step-profile DIR` every server, plain's
too (it then loads the online-opd plugin: the profile, and the CPU kernel fix of the rejection
sampler, which plain decoding never calls), times each engine step into
DIR/<server> (vllm_patches/step_profile.py), and the JSON sums the timed blocks' steps by kind
(`decode`, `prefill`, `mixed`) with the worker's forward, drafter and sampling seconds: where a
variant's extra time goes, step kind by step kind; `per_block` counts, block by block, the decode steps
and those that drafted (how soon a server speculates: a server that starts from stored step costs
against one that starts with an empty table, `-o serve.policy_costs_file=...`). An online-opd server polls its workers every
`serve.stats_poll_s` for `serve.stats_settle_s` after its last work, and each
poll makes an idle worker busy-wait for about a second: that would land on the
next server's block, so the servers here run with `serve.stats_settle_s=0`
(idle polls a minute apart; it changes nothing while a server works). A first
run with four servers and the default settle moved by 0.74-1.27 per cycle.

    python benchmarks/serving_overhead.py --cycles 8 --out benchmarks/results/serving_overhead.json
    python benchmarks/serving_overhead.py --variant default= --variant noexplore="-o serve.policy_explore_share=0 \\
        -o serve.policy_explore_share_unmeasured=0"

Each server holds its own KV cache (VLLM_CPU_KVCACHE_SPACE GiB; 1 here unless set): four servers need
about 10 GiB. One JSON object on stdout (also written to --out); logs on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from objectives import t_interval
from speculation_policy import make_fresh_drafter, parse_variants

from serve.launcher import ROOT, PlainVllmServer, ServerProcess, benchmark_logging, emit_result
from serve.loadgen import LoadConfig, run_load
from vllm_patches import STEP_PROFILE_ENV, step_profile

logger = logging.getLogger("serving_overhead")

TOKEN = "serving-overhead-bench"
DEFAULT_VARIANTS = ("default=", "nocap=--no-capture", "never=--speculation never")
def start_servers(base: Path, config: Path, variants: dict[str, list[str]], max_num_seqs: int,
                  profile: Path | None = None) -> dict[str, Any]:
    """The plain server and one online-opd server per variant, started one after the other
    (their start-ups would otherwise compete for the two cores); each waited for before the next.
    With `profile`, every server writes its per-step times into `profile/<name>`
    (vllm_patches/step_profile.py): plain vLLM then loads the online-opd plugin (register: cpu_fixes and the
    profile; no other hook acts without its variable)."""
    from online_opd.config import load_config
    from serve.cpu_runtime import runtime_env_for

    cfg = load_config(config)
    target, drafter = make_fresh_drafter(config, base / "fresh-drafter")
    servers: dict[str, Any] = {}

    def profile_env(name: str) -> dict[str, str]:
        return {} if profile is None else {STEP_PROFILE_ENV: str(profile / name)}

    plain_env = {**runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores), **profile_env("plain")}
    if profile is not None:
        plain_env["VLLM_PLUGINS"] = "online_opd"  # the profile; of the rest only cpu_fixes acts (rejection sampler)
    try:
        servers["plain"] = PlainVllmServer(
            base / "plain", target, dtype=cfg.model.serving_dtype(), max_model_len=cfg.model.max_model_len,
            max_num_seqs=max_num_seqs, runtime_env=plain_env)
        servers["plain"].wait_ready(timeout=900)
        for name, words in variants.items():
            start = time.perf_counter()
            servers[name] = ServerProcess(base / name, config, "--drafter", str(drafter), "--max-num-seqs",
                                          str(max_num_seqs), "-o", "serve.stats_settle_s=0", *words, token=TOKEN,
                                          env=profile_env(name))
            servers[name].wait_ready(timeout=900)
            logger.info("%s: ready in %.0f s", name, time.perf_counter() - start)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: dict[str, Any]) -> None:
    for server in servers.values():
        try:
            server.stop()
        except Exception as exc:  # keep stopping the others
            logger.warning("stopping %s: %s", server.url, exc)


#: vLLM's engine counters read around each timed block: tokens the engine computed (prompt tokens
#: not served from the prefix cache, plus decode and draft positions) and the prefix cache's work.
ENGINE_COUNTERS = {"computed_tokens": "vllm:iteration_tokens_total_sum",
                   "prefix_cache_queries": "vllm:prefix_cache_queries_total",
                   "prefix_cache_hits": "vllm:prefix_cache_hits_total"}


def block(server: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    common = dict(base_url=f"{server.url}/v1", prompts=args.prompts,
                  split="held_out" if args.prompts == "sharegpt" else "all",
                  num_prompts=256, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                  concurrency=args.concurrency, progress=False)
    run_load(LoadConfig(**common, seed=10_000 + seed, num_requests=args.concurrency))
    before, steps_before = server.metrics(), step_seconds(server)
    window = [time.time()]
    summary = run_load(LoadConfig(**common, seed=seed, num_requests=args.block_requests * args.concurrency))
    window.append(time.time())
    after, steps_after = server.metrics(), step_seconds(server)
    out = {k: summary[k] for k in ("output_tokens_per_s", "output_tokens", "requests_ok", "requests_failed", "wall_s")}
    out["window"] = [round(t, 4) for t in window]
    out.update({k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in ENGINE_COUNTERS.items()})
    if steps_before and steps_after:  # an online-opd server speculating with the auto policy
        out["step_seconds"] = {k: round(steps_after[k] - steps_before[k], 3) for k in steps_after}
    return out


def step_seconds(server: Any) -> dict[str, float] | None:
    """An auto-policy server's engine step seconds so far: timed (steady decode) by K = 0 and K > 0,
    untimed (prefill, mixed) by whether they drafted; None for other servers."""
    if not getattr(server, "token", None):
        return None
    try:
        spec = server.admin("GET", "/status").json().get("speculation") or {}
    except Exception as exc:
        logger.warning("%s: no engine status: %s", server.url, exc)
        return None
    costs, untimed = spec.get("costs") or [], spec.get("untimed") or {}
    if not costs and not untimed:
        return None
    return {"timed_plain": sum(r[4] for r in costs if r[1] == 0),
            "timed_drafting": sum(r[4] for r in costs if r[1] > 0),
            **{f"untimed_{kind}": v[1] for kind, v in untimed.items()}}


def engine_work(cycles: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One server's engine counters over all its timed blocks."""
    total = {k: sum(c["detail"][name][k] for c in cycles) for k in (*ENGINE_COUNTERS, "output_tokens")}
    out = {"computed_tokens": total["computed_tokens"],
           "computed_per_output_token": round(total["computed_tokens"] / max(total["output_tokens"], 1), 4),
           "prefix_cache_hit_rate": round(total["prefix_cache_hits"] / max(total["prefix_cache_queries"], 1), 4)}
    steps = [c["detail"][name]["step_seconds"] for c in cycles if "step_seconds" in c["detail"][name]]
    if steps:  # engine step seconds over the timed blocks, by kind (step_seconds)
        out["step_seconds"] = {k: round(sum(s.get(k, 0.0) for s in steps), 2) for k in steps[0]}
    return out


def profile_summary(directory: Path, cycles: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One server's engine steps inside its timed blocks, per kind of step (step_profile.py): the engine
    core's wall seconds (and its decode steps by batch size and K), and the worker's forward (execute_s),
    drafter (propose_s) and sampling-and-drafting (sample_s) seconds."""
    windows = [c["detail"][name]["window"] for c in cycles]

    def inside(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in records if any(start <= r["time"] <= end for start, end in windows)]

    every = step_profile.read(directory, "scheduler")
    core = inside(every)
    per_block = []  # how soon a server speculates: its decode steps that drafted, block by block
    for start, end in windows:
        decode = [r for r in every if start <= r["time"] <= end and r["kind"] == "decode"]
        per_block.append({"decode_steps": len(decode), "decode_steps_drafting": sum(r["k"] > 0 for r in decode),
                          "engine_seconds": round(sum(r["seconds"] for r in every
                                                      if start <= r["time"] <= end), 3)})
    return {"engine_core": step_profile.summarise(core, ("seconds", "schedule_s")),
            "decode_by_b_k": step_profile.decode_by_shape(core), "per_block": per_block,
            "worker": step_profile.summarise(inside(step_profile.read(directory, "worker")),
                                             ("execute_s", "propose_s", "sample_s"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--variant", action="append", default=None, metavar="NAME=ARGS",
                        help="an online-opd serve variant with these extra arguments (repeatable; default: "
                             + ", ".join(DEFAULT_VARIANTS) + ")")
    parser.add_argument("--cycles", type=int, default=8, help="blocks per server (default 8)")
    parser.add_argument("--block-requests", type=int, default=5, help="timed requests per block = this x c")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--prompts", choices=("humaneval", "sharegpt"), default="humaneval")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--step-profile", type=Path, default=None, metavar="DIR",
                        help="time every engine step of every server, plain's too, into DIR/<server> (kept), and "
                             "report the timed blocks' steps by kind: decode, prefill, mixed "
                             "(vllm_patches/step_profile.py)")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="copy every server's log to DIR/<server>.log at the end (the policy's schedule "
                             "changes and the figures behind them are logged there)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    try:
        variants = parse_variants(args.variant if args.variant is not None else list(DEFAULT_VARIANTS), ("plain",))
    except ValueError as exc:
        parser.error(str(exc))
    if args.cycles < 2:
        parser.error("--cycles must be >= 2 (a ratio's interval needs two cycles)")
    benchmark_logging()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # every server's, plain's too: several share the memory
    config = args.config.resolve()
    names = ["plain", *variants]
    cycles: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        profile = args.step_profile.resolve() if args.step_profile else None
        servers = start_servers(Path(tmp), config, variants, args.max_num_seqs, profile)
        try:
            for i in range(args.cycles):
                order = names[i % len(names):] + names[: i % len(names)]
                results = {name: block(servers[name], args, seed=i) for name in order}
                tps = {n: r["output_tokens_per_s"] for n, r in results.items()}
                ratios = {n: round(tps[n] / tps["plain"], 4) for n in variants if tps["plain"]}
                logger.info("cycle %d: %s", i, ", ".join(f"{n} {tps[n]:.1f}" for n in names)
                            + " tokens/s; ratios " + ", ".join(f"{n} {r:.3f}" for n, r in ratios.items()))
                cycles.append({"cycle": i, "order": order, "tokens_per_s": tps, "ratio": ratios, "detail": results})
        finally:
            stop_all(servers)
            if args.keep_logs is not None:  # the servers' folders are temporary: their logs go with them
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for name in names:
                    log = Path(tmp) / name / "server.log"
                    if log.exists():
                        shutil.copyfile(log, args.keep_logs / f"{name}.log")
        profiles = {name: profile_summary(profile / name, cycles, name) for name in names} if profile else None
    summary = {}
    for name in variants:
        values = [c["ratio"][name] for c in cycles if name in c["ratio"]]
        summary[name] = {"args": shlex.join(variants[name]), "ratio_median": round(statistics.median(values), 4),
                         **t_interval(values), "ratio_per_cycle": values}
    emit_result({
        "benchmark": "serving_overhead", "config": str(config),
        "plain": "vllm serve, same model, flags and CPU runtime settings (config cpu:), no speculative config, "
                 "no online-opd plugin" + (" (with --step-profile: the plugin, for the profile)" if profile else ""),
        "online_opd_serve": "online-opd serve --drafter <fresh drafter> (trainer off) plus each variant's arguments",
        "prompts": f"{args.prompts}, temperature 0, ignore_eos, {args.max_tokens} tokens",
        "concurrency": args.concurrency, "cycles": args.cycles, "block_requests": args.block_requests * args.concurrency,
        "max_num_seqs": args.max_num_seqs, "variants": summary,
        "engine_work": {name: engine_work(cycles, name) for name in names},
        "requests_failed": sum(r["requests_failed"] for c in cycles for r in c["detail"].values()),
        **({"step_profile": profiles} if profiles else {}),
        "cycles_detail": cycles,
        "note": "all servers up at once, measured in alternating blocks (order rotating per cycle); "
                "ratios are per cycle against plain in the same cycle",
    }, args.out)


if __name__ == "__main__":
    main()
