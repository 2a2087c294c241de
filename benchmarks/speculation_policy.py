"""Speculation policy: `online-opd serve` (speculation auto) vs plain vLLM, output tokens/s at c=1, 8, 32.

Fresh state: a fresh drafter (random, warm-started from the target: what
`online-opd serve` starts from on a new machine) in an empty run folder. Two
servers on identical requests (held-out ShareGPT prompts, temperature 0,
`ignore_eos`, `--max-tokens` each):

- `online-opd serve` with its defaults (speculation auto, capture on) and
  `--drafter` naming the fresh drafter, which keeps the online trainer off
  (`--train` turns it on: it shares the same cores, which is the trainer's
  cost, not the policy's);
- plain vLLM: `vllm serve` in-process (serve/server.py ``run_vllm_serve``) with
  the same model, flags and CPU runtime settings (the config's `cpu:` section:
  the fastest plain settings benchmarks/plain_settings.py found), no
  speculative config and no online-opd plugin;
- (unless --no-ngram) the same plain server with vLLM's built-in `ngram`
  speculation (prompt lookup 2-4, K=4): what a user gets without training;
- (--ngram-fallback) `online-opd serve` as above with `--ngram-fallback`
  (mode `online-opd+ngram`): prompt lookup replaces the drafter's block where a
  request's context matches and such blocks were accepted better
  (vllm_patches/ngram_fallback.py); and (--always) the same with
  `--speculation always` (mode `always+ngram`), K every step.

- (--variant NAME=ARGS, repeatable) `online-opd serve` as the first mode with extra
  serve arguments (shell words, e.g. `never="--speculation never"`, `nocap=--no-capture`,
  `noexplore="-o serve.policy_explore_share=0 -o serve.policy_explore_share_unmeasured=0"`):
  to break down what a server costs against plain vLLM.

`--prompts humaneval` measures on HumanEval (code: copy-heavy, a domain the
drafter never saw) instead of held-out ShareGPT (`--split` picks the prompts: with
`--split held_out`, those benchmarks/domain_shift.py holds out); `--concurrency` picks the loads.

A round starts one server per mode; each mode goes first in turn. Per
server and concurrency: warm-up requests, then a fixed closed-loop load; the
ratio online-opd / plain of output tokens/s is reported per round and as the
median. The target is >= 0.95 at every concurrency. From the online-opd
server's admin status: the schedule the policy chose, the measured step costs
t(b, K), the fitted cost model, the break-even tau (t(b, K) / t(b, 0)) per batch
size, the exploration share, the drafts vLLM verified, and the seconds of the steps
the cost table times (steady decode) against those it does not (prefill, mixed), by
whether they drafted.

    python benchmarks/speculation_policy.py --rounds 2 --out benchmarks/results/speculation_policy.json
    python benchmarks/speculation_policy.py --prompts humaneval --ngram-fallback --always \
        --concurrency 1 8 --out benchmarks/results/ngram_fallback.json

One JSON object on stdout (also written to --out); logs on stderr. The machine
is shared (2 cores): a round's ratio moves by several percent either way.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from online_opd.speculation.costs import CostModel, StepCosts
from online_opd.speculation.policy import break_even_taus
from serve.engine import ngram_speculative_config
from serve.launcher import ROOT, PlainVllmServer, ServerProcess, benchmark_logging, emit_result, tau
from serve.loadgen import LoadConfig, run_load

logger = logging.getLogger("speculation_policy")

TOKEN = "speculation-policy-bench"
TARGET_RATIO = 0.95
CONCURRENCIES = (1, 8, 32)
# vLLM's built-in prompt-lookup speculation: the baseline a user gets without training
NGRAM = ngram_speculative_config(4)
MODES = ("online-opd", "plain", "ngram", "online-opd+ngram", "always+ngram")


def make_fresh_drafter(cfg_path: Path, out: Path) -> tuple[Path, Path]:
    """(target folder, fresh drafter checkpoint) as `online-opd serve` would make them."""
    import torch

    from online_opd.config import load_config
    from online_opd.models.drafters.checkpoint import save_drafter
    from online_opd.models.target_model import TargetModel
    from serve.pipeline import fresh_drafter, load_tokenizer, resolve_target

    cfg = load_config(cfg_path)
    target = resolve_target(cfg, progress=False)
    target_model = TargetModel.from_pretrained(target, dtype=torch.float32)
    drafter, vocab = fresh_drafter(cfg, target_model, load_tokenizer(target))
    return target, save_drafter(drafter, out, version="v0001", metrics={"origin": "fresh", **vocab})


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    split = args.split or ("held_out" if args.prompts == "sharegpt" else "all")
    if args.prewarm_s > 0:  # the same traffic for every server, so the policy measures before it is timed
        run_load(LoadConfig(base_url=f"{url}/v1", prompts=args.prompts, split=split, num_prompts=256,
                            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, concurrency=1,
                            progress=False, seed=2, duration=args.prewarm_s))
    for concurrency in args.concurrency:
        common = dict(base_url=f"{url}/v1", prompts=args.prompts, split=split, num_prompts=256,
                      max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, concurrency=concurrency,
                      progress=False)
        run_load(LoadConfig(**common, seed=1, num_requests=max(args.warmup, concurrency)))
        summary = run_load(LoadConfig(**common, seed=0, num_requests=args.requests_per_worker * concurrency))
        logger.info("  c=%d: %.1f tokens/s (%d ok, %d failed, %.1f s)", concurrency,
                    summary["output_tokens_per_s"], summary["requests_ok"], summary["requests_failed"],
                    summary["wall_s"])
        out[str(concurrency)] = {k: summary[k] for k in (
            "output_tokens_per_s", "output_tokens", "requests_ok", "requests_failed", "wall_s")}
    return out


def policy_figures(server: ServerProcess, max_k: int) -> dict[str, Any]:
    """The policy's schedule, costs, cost model and break-even taus from the admin status."""
    status = server.admin("GET", "/status").json()
    spec = status.get("speculation") or {}
    metrics = server.metrics()
    costs = spec.get("costs") or []
    model = CostModel(StepCosts.from_rows(costs))
    sizes = sorted({int(r[0]) for r in costs})
    return {
        "schedule": spec.get("schedule"), "acceptance_used": spec.get("acceptance_used"),
        "acceptance_source": spec.get("acceptance_source"), "num_changes": spec.get("num_changes"),
        "steps": spec.get("steps"), "explored_steps": spec.get("explored_steps"),
        "exploration_share": (spec["explored_steps"] / spec["steps"]) if spec.get("steps") else None,
        "step_costs": [{"batch_size": int(b), "k": int(k), "seconds": round(s, 5), "num_steps": int(n),
                        **({"drafted": round(rest[2], 3)} if len(rest) > 2 else {})}
                       for b, k, s, n, *rest in costs],
        "cost_model": model.describe(),
        "break_even_tau": {str(b): [None if t is None else round(t, 3) for t in break_even_taus(model, b, max_k)]
                           for b in sizes},
        # steps the cost table does not time (prefill, mixed), against the timed ones' seconds: the
        # policy's predictions cover only the timed share
        "timed_seconds": round(sum(r[4] for r in costs if len(r) > 4), 2),
        "untimed_steps": {kind: {"steps": v[0], "seconds": round(v[1], 2), "output_tokens": v[2]}
                          for kind, v in (spec.get("untimed") or {}).items()},
        "drafts_verified": metrics.get("vllm:spec_decode_num_drafts_total"),
        "draft_tokens_accepted": metrics.get("vllm:spec_decode_num_accepted_tokens_total"),
        "draft_trim": trim_figures(status.get("draft_trim")),
    }


def trim_figures(trim: dict | None) -> dict[str, Any] | None:
    """Draft trimming's counters, thresholds and calibrated acceptance (serve --draft-trim), or None."""
    if not trim:
        return None
    keys = ("blocks", "trimmed_blocks", "drafted_tokens", "kept_tokens", "verified_blocks", "accepted_tokens",
            "errors", "thresholds")
    figures = {k: trim.get(k) for k in keys}
    cal = trim.get("calibration")
    if cal:
        from online_opd.speculation.trim import ConfidenceCalibration

        rates = ConfidenceCalibration(cal["max_k"], cal["prior"], cal["seen"], cal["hits"]).rates()
        figures["calibrated_acceptance"] = [[round(float(x), 3) for x in row] for row in rates]
        figures["calibration_blocks"] = [[int(x) for x in row] for row in cal["seen"]]
    return figures


def fallback_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The ngram fallback's verified blocks and accepted tokens per proposer over the measurement,
    and the drafter version's live tau (its own blocks only)."""
    out: dict[str, Any] = {}
    for proposer in ("drafter", "ngram"):
        blocks = after.get(f"online_opd_ngram_fallback_blocks_total{{proposer={proposer}}}", 0.0) \
            - before.get(f"online_opd_ngram_fallback_blocks_total{{proposer={proposer}}}", 0.0)
        accepted = after.get(f"online_opd_ngram_fallback_accepted_tokens_total{{proposer={proposer}}}", 0.0) \
            - before.get(f"online_opd_ngram_fallback_accepted_tokens_total{{proposer={proposer}}}", 0.0)
        out[proposer] = {"blocks": blocks, "tau": round(1 + accepted / blocks, 4) if blocks else None}
    return out


def run_mode(mode: str, run_dir: Path, target: Path, drafter: Path, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    if mode in ("plain", "ngram"):
        from online_opd.config import load_config
        from serve.cpu_runtime import runtime_env_for

        cfg = load_config(args.config)
        spec = ["--speculative-config", json.dumps(NGRAM)] if mode == "ngram" else []
        server: Any = PlainVllmServer(run_dir, target, *spec, dtype=cfg.model.serving_dtype(),
                                      max_model_len=cfg.model.max_model_len, max_num_seqs=args.max_num_seqs,
                                      runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores))
    else:
        extra = [] if args.train else ["--drafter", str(drafter)]
        extra += args.variants.get(mode, [])
        if mode.endswith("+ngram"):
            extra.append("--ngram-fallback")
        if mode.startswith("always"):
            extra += ["--speculation", "always"]
        server = ServerProcess(run_dir, args.config, *extra, "--max-num-seqs", str(args.max_num_seqs), token=TOKEN)
    try:
        server.wait_ready(timeout=900)
        logger.info("%s: ready in %.0f s", mode, time.perf_counter() - start)
        before = server.metrics()
        result: dict[str, Any] = {"by_concurrency": measure(server.url, args)}
        if mode == "online-opd" or mode == "online-opd+ngram" or mode in args.variants:
            result["policy"] = policy_figures(server, args.max_k)
        if mode.endswith("+ngram"):
            after = server.metrics()
            result["fallback"] = fallback_figures(before, after)
            served, drafts = tau(before, after)
            result["fallback"]["all_blocks"] = {"blocks": drafts, "tau": round(served, 4)}
        elif mode == "ngram":
            served, drafts = tau({"vllm:spec_decode_num_drafts_total": 0, "vllm:spec_decode_num_accepted_tokens_total": 0},
                                 server.metrics())
            result["spec"] = {"config": NGRAM, "tau": round(served, 4), "drafts": drafts}
        return result
    finally:
        server.stop()


def parse_variants(specs: list[str], reserved) -> dict[str, list[str]]:
    """`--variant NAME=ARGS` values -> {NAME: serve arguments as shell words}; a name must be new (not
    in `reserved`, not repeated). ValueError names the bad one."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, eq, words = spec.partition("=")
        if not eq or not name or name in reserved or name in out:
            raise ValueError(f"--variant {spec!r}: expected NAME=ARGS with a new mode name "
                             f"(not {', '.join(reserved)} or one given before)")
        out[name] = shlex.split(words)
    return out


def summarize(rounds: list[dict], concurrencies, variants=()) -> dict[str, Any]:
    out = {}
    for c in map(str, concurrencies):
        ratios = [r["ratio"][c] for r in rounds if r["ratio"].get(c) is not None]
        median = round(statistics.median(ratios), 4) if ratios else None
        out[c] = {"ratio_median": median, "ratio_per_round": ratios,
                  "tokens_per_s_online_opd": [r["tokens_per_s"].get("online-opd", {}).get(c) for r in rounds],
                  "tokens_per_s_plain": [r["tokens_per_s"]["plain"][c] for r in rounds],
                  "target_met": median is not None and median >= TARGET_RATIO}
        ngram = [r["ratio_ngram"][c] for r in rounds if r.get("ratio_ngram", {}).get(c) is not None]
        if ngram:
            out[c]["ngram_ratio_median"] = round(statistics.median(ngram), 4)
            out[c]["ngram_ratio_per_round"] = ngram
        for mode in ("online-opd+ngram", "always+ngram", *variants):
            ratios = [r["ratio_by_mode"][mode][c] for r in rounds if r["ratio_by_mode"].get(mode, {}).get(c)]
            if ratios:
                out[c][f"{mode}_ratio_median"] = round(statistics.median(ratios), 4)
                out[c][f"{mode}_ratio_per_round"] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--rounds", type=int, default=2, help="server pairs; the order alternates (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-worker", type=int, default=4, help="measured requests = this x c")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-k", type=int, default=4, help="the drafter's block size (break-even taus)")
    parser.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure vLLM's built-in ngram speculation, the untrained baseline (default on)")
    parser.add_argument("--ngram-fallback", action="store_true",
                        help="also measure online-opd serve --ngram-fallback (mode online-opd+ngram)")
    parser.add_argument("--always", action="store_true",
                        help="with --ngram-fallback: also with --speculation always (mode always+ngram)")
    parser.add_argument("--prompts", choices=("sharegpt", "humaneval"), default="sharegpt",
                        help="held-out ShareGPT (default) or HumanEval (code, a domain the drafter never saw)")
    parser.add_argument("--split", choices=("train", "held_out", "all"), default=None,
                        help="the prompts' split (default: held_out for ShareGPT, all for HumanEval); "
                             "`--prompts humaneval --split held_out` are the prompts benchmarks/domain_shift.py "
                             "never trains on")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES),
                        help="closed-loop concurrencies measured (default 1 8 32)")
    parser.add_argument("--prewarm-s", type=float, default=0.0,
                        help="seconds of c=1 traffic every server gets before the measured loads (default 0: "
                             "a fresh server; set it to measure the policy after it learnt the acceptance)")
    parser.add_argument("--modes", nargs="+", default=None,
                        choices=MODES,
                        help="measure only these modes (plain is always measured: the ratios' baseline)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="also measure `online-opd serve` with these extra arguments (shell words) as mode "
                             "NAME, e.g. never=\"--speculation never\" (repeatable)")
    parser.add_argument("--train", action="store_true", help="online-opd serve with its online trainer on")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    try:
        args.variants = parse_variants(args.variant, MODES)
    except ValueError as exc:
        parser.error(str(exc))
    benchmark_logging()
    args.config = args.config.resolve()
    with tempfile.TemporaryDirectory(prefix="speculation-policy-") as tmp:
        base = Path(tmp)
        target, drafter = make_fresh_drafter(args.config, base / "fresh-drafter")
        rounds = []
        for r in range(args.rounds):
            names = ["online-opd", "plain"] + (["ngram"] if args.ngram else []) \
                + (["online-opd+ngram"] if args.ngram_fallback else []) \
                + (["always+ngram"] if args.ngram_fallback and args.always else [])
            if args.modes:
                names = [m for m in names if m in args.modes or m == "plain"]
            names += list(args.variants)
            order = names[r % len(names):] + names[: r % len(names)]  # each mode goes first in turn
            modes = {m: run_mode(m, base / f"round{r}-{m}", target, drafter, args) for m in order}
            tps = {m: {c: v["output_tokens_per_s"] for c, v in modes[m]["by_concurrency"].items()} for m in modes}

            def ratio(mode: str) -> dict:
                return {c: round(tps[mode][c] / tps["plain"][c], 4) if tps["plain"][c] else None for c in tps["plain"]}

            rounds.append({"round": r, "order": list(order), "tokens_per_s": tps,
                           "ratio": ratio("online-opd") if "online-opd" in modes else {},
                           **({"ratio_ngram": ratio("ngram"), "ngram": modes["ngram"]["spec"]} if "ngram" in modes
                              else {}),
                           "ratio_by_mode": {m: ratio(m) for m in modes if m != "plain"},
                           "fallback": {m: modes[m]["fallback"] for m in modes if "fallback" in modes[m]},
                           "policy": modes.get("online-opd", {}).get("policy"),
                           "policy_with_fallback": modes.get("online-opd+ngram", {}).get("policy"),
                           "policy_by_variant": {m: modes[m].get("policy") for m in args.variants if m in modes},
                           "detail": {m: modes[m]["by_concurrency"] for m in modes}})
    per_concurrency = summarize(rounds, args.concurrency, list(args.variants))
    result = {
        "benchmark": "speculation_policy", "config": str(args.config), "rounds": args.rounds,
        "online_opd_serve": "defaults (speculation auto, capture on), fresh drafter"
                            + (", online trainer on" if args.train else ", online trainer off (--drafter)"),
        "plain": "vllm serve, same model, flags and CPU runtime settings (config cpu:), no speculative config, "
                 "no online-opd plugin",
        "ngram": f"the plain server plus vLLM's ngram speculation {json.dumps(NGRAM)}" if args.ngram else None,
        "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
        "prompts": f"{args.prompts} {args.split or ('held_out' if args.prompts == 'sharegpt' else 'all')}, "
                   "temperature 0, ignore_eos",
        "ngram_fallback": "online-opd serve --ngram-fallback (online-opd+ngram), and with --speculation always "
                          "(always+ngram)" if args.ngram_fallback else None,
        "target": f"output tokens/s online-opd / plain >= {TARGET_RATIO} at each concurrency (median over rounds)",
        "per_concurrency": per_concurrency,
        "prewarm_s": args.prewarm_s,
        "variants": {name: shlex.join(words) for name, words in args.variants.items()},
        "target_met": all(v["target_met"] for v in per_concurrency.values()),
        "requests_failed": sum(d[c]["requests_failed"] for r in rounds for d in r["detail"].values() for c in d),
        "rounds_detail": rounds,
        "note": "each mode in its own server process; shared 2-core machine, expect noise of a few %",
    }
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
