"""Domain shift: a ShareGPT-bootstrapped drafter serving HumanEval traffic, three ways.

Arms, in one run on this machine:
  (a) static     the bootstrap drafter, never updated;
  (b) naive      online training with the target-rollout forward KL (trainer.objective=target_rollout);
  (c) draft_opd  online Draft-OPD (trainer.objective=draft_opd);
  (d) auto       (only with `--arms ...,auto`) the objective chosen from live acceptance;
  (e) lk, lk_greedy  (with `--arms`) the LK objective, -log acceptance rate, at teacher T=1 / T=0.
The online arms each run `online-opd serve` with its Ray trainer for the same number of optimizer
steps (`--steps`) with the same batch shape: equal trainer compute (their trainer seconds are
reported too). Traffic: `online-opd loadgen`'s engine on HumanEval *train*-split prompts, greedy
(or sampled at `--temperature`, each repeat a fresh sample: more distinct sequences per prompt),
closed loop, in batches of 16 requests: batch i sends the first 16 of the train split shuffled with
seed i, so an arm sees every train prompt, a few times each, in the same order in every arm (TRAFFIC;
runs before 2026-12-04 sent the same 16 prompts in every batch, which the gate's held-out share cut to
2 prompts). The gate (margin 0, paired lower bound) promotes versions; the reloader hot-loads them.

Measured: served acceptance length tau on *held-out* HumanEval prompts, over each arm's wall
time. The held-out prompts never reach the server. tau(version) is computed exactly: at T=0
speculative decoding is lossless, so the blocks a drafter drafts on a target rollout, and how many
the verifier accepts, follow from the rollout (online_opd/opd/rollout.py), and the drafter vLLM serves
proposes bit-for-bit what the torch drafter proposes (tests/test_serve.py checks this at every
captured anchor). The curve is tau of the version serving at each moment. The live tau on the
training traffic (vLLM's own counters, per version) is reported beside it.

Keeping up (issue 11 item 3), per arm over its wall time: served tokens/s (vllm:generation_tokens_total)
against the trainer's trained tokens/s (online_opd_trainer_trained_tokens_total: r + 1 per replayed
block, the served tokens its steps learnt from); `keep_up` is their ratio (>= 1: the trainer could
learn from every verified block once). `--capture-features` serves with the verifier's top-32 and the
target's features captured for every request, so replay runs no target forward.

Prints JSON; writes `<out>/domain_shift.json` and `<out>/domain_shift.png`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from provenance import code_version, source_commit  # sibling module: benchmarks/ leads sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from online_opd.config import load_config  # noqa: E402
from online_opd.data import load_prompts  # noqa: E402
from online_opd.models.drafters.checkpoint import load_drafter  # noqa: E402
from online_opd.models.target_model import TargetModel  # noqa: E402
from online_opd.opd.rollout import greedy_blocks, pooled_acceptance_length  # noqa: E402
from online_opd.release.registry import DrafterRegistry  # noqa: E402
from online_opd.train.sequences import TrainSequence  # noqa: E402
from serve import engine  # noqa: E402
from serve.launcher import ServerProcess  # noqa: E402
from serve.loadgen import LoadConfig, run_load  # noqa: E402
from serve.pipeline import load_tokenizer, resolve_target  # noqa: E402
from serve.scrape import scrape_loop  # noqa: E402

logger = logging.getLogger("domain_shift")

TRAFFIC = "humaneval-train-rotating-16"  # the traffic's shape, recorded so runs of other traffic do not pool


def traffic_name(temperature: float) -> str:
    """TRAFFIC, with the sampling temperature appended when it is not greedy (runs at T=0 keep the old name)."""
    return TRAFFIC if temperature == 0 else f"{TRAFFIC}-T{temperature:g}"


def humaneval_rollouts(cfg, target: Path, num_prompts: int, max_tokens: int,
                      split: str = "held_out") -> list[list[int]]:
    """The target's T=0 replies to ``num_prompts`` HumanEval prompts of ``split`` (held_out: the runs never
    train on them; train: the traffic's own prompts)."""
    prompts = load_prompts("humaneval", num_prompts=num_prompts, split=split, seed=0)
    ids = engine.chat_prompt_ids(load_tokenizer(target), [p.messages for p in prompts])
    llm = engine.make_llm(target, dtype="float32", max_model_len=cfg.model.max_model_len,
                          engine_kwargs={"max_num_seqs": 16})
    try:
        gens = engine.generate(llm, ids, max_tokens=max_tokens, progress=False)
    finally:
        engine.shutdown(llm)
    return [(g.prompt_ids, g.output_ids) for g in gens if g.output_ids]


class HeldOutTau:
    """Exact T=0 tau of a drafter on fixed target rollouts (held-out ones here; features computed once)."""

    def __init__(self, target: Path, rollouts, layer_ids):
        self.model = TargetModel.from_pretrained(target, dtype=torch.float32)
        self.seqs = []
        with torch.no_grad():
            for prompt, output in rollouts:
                tokens = torch.tensor(prompt + output)
                feats = self.model.forward(tokens, layer_ids=layer_ids, logits_at=tokens[:0]).aux_hidden
                self.seqs.append(TrainSequence(tokens, len(prompt), feats))

    def __call__(self, drafter_path: Path) -> float:
        drafter = load_drafter(drafter_path)
        drafter.attach_target(self.model.embed_weight, self.model.lm_head_weight)
        return pooled_acceptance_length([greedy_blocks(drafter, s) for s in self.seqs])


ARM_SETTINGS = {  # --arms names that are not trainer.objective values: (objective, further trainer overrides)
    "lk_greedy": ("lk", ["trainer.lk_temperature=0"]),  # LK with the target's greedy token as the teacher
}


def run_arm(name: str, objective: str, args, bootstrap_dir: Path, out: Path) -> dict:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer_objective, settings = ARM_SETTINGS.get(objective, (objective, []))
    overrides = [f"trainer.objective={trainer_objective}", *settings, f"trainer.lr={args.lr}", "trainer.warmup_ratio=0.0",
                 f"trainer.seed={args.seed}",
                 f"trainer.sequences_per_step={args.sequences_per_step}",
                 f"trainer.anchors_per_sequence={args.anchors}", f"online.max_steps={args.steps}",
                 "online.min_records=4", "online.checkpoint_every=1000", "online.duty_cycle=1",
                 f"gate.every_steps={args.gate_every}", "gate.min_records=6", "gate.held_out_fraction=0.15",
                 "gate.max_records=32", "gate.max_blocks_per_record=32", "serve.live_check_drafts=300",
                 "serve.stats_poll_s=2", "serve.reload_poll_s=2", f"bootstrap.output_dir={bootstrap_dir}",
                 f"serve.speculation={args.speculation}"]
    if args.capture_features:
        overrides += ["capture.teacher_top_k=32", "capture.hidden_sample_rate=1.0"]
    overrides += args.set
    server = ServerProcess(run_dir, args.config, *[x for o in overrides for x in ("-o", o)],
                           "--max-num-seqs", "8", token="domain-shift")
    stop = threading.Event()
    loads: list[dict] = []
    t0 = time.time()
    try:
        server.wait_ready()
        t0 = time.time()
        start_metrics = server.metrics()
        scraper = threading.Thread(target=scrape_loop, args=(server.url, run_dir / "scrapes.jsonl", 5.0),
                                   kwargs={"stop": stop}, daemon=True)
        scraper.start()

        def traffic() -> None:
            batch = 0
            while not stop.is_set():
                loads.append(run_load(LoadConfig(
                    base_url=f"{server.url}/v1", prompts="humaneval", split="train", num_prompts=256,
                    num_requests=16, concurrency=4, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=batch, progress=False)))
                batch += 1

        sender = threading.Thread(target=traffic, daemon=True)
        sender.start()
        deadline = t0 + args.minutes * 60
        steps = 0.0
        while time.time() < deadline:
            time.sleep(10)
            metrics = server.metrics()
            steps = metrics.get("online_opd_trainer_steps_total", 0.0)
            logger.info("%s: %.0f s, trainer step %.0f, promotions %.0f", name, time.time() - t0, steps,
                        metrics.get("online_opd_gate_promotions_total", 0.0))
            if steps >= args.steps:
                time.sleep(20)  # let the reloader pick up a last promotion
                break
        final_metrics = server.metrics()
        t_end = time.time()
        stop.set()
        sender.join(600)
    finally:
        stop.set()
        server.stop()
    registry = DrafterRegistry(run_dir / "registry")
    history = registry.history()
    return {"name": name, "objective": objective, "keep_up": keep_up(start_metrics, final_metrics, t_end - t0),
            "run_dir": str(run_dir), "t0": t0, "wall_s": t_end - t0, "trainer_steps": steps,
            "trainer_step_seconds": final_metrics.get("online_opd_trainer_step_seconds_total"), "history": history, "final_metrics": {
                k: v for k, v in final_metrics.items() if k.startswith(("online_opd_", "vllm:spec_decode"))},
            "requests_failed": sum(s.get("requests_failed", 0) for s in loads),
            "requests_ok": sum(s.get("requests_ok", 0) for s in loads), "registry": registry}


def keep_up(start: dict, end: dict, wall_s: float) -> dict:
    """Served and trained tokens per second between two /metrics samples ``wall_s`` apart."""
    def delta(key: str) -> float:
        return end.get(key, 0.0) - start.get(key, 0.0)

    served, trained = delta("vllm:generation_tokens_total"), delta("online_opd_trainer_trained_tokens_total")
    train_s = delta("online_opd_trainer_step_seconds_total")
    return {"served_tokens_per_s": round(served / wall_s, 3), "trained_tokens_per_s": round(trained / wall_s, 3),
            "keep_up": round(trained / served, 4) if served > 0 else None,
            "trained_tokens_per_trainer_s": round(trained / train_s, 3) if train_s > 0 else None,
            "trainer_busy_share": round(train_s / wall_s, 4),
            "served_blocks": delta("vllm:spec_decode_num_drafts_total"),
            "hidden_records": delta("online_opd_hidden_records_captured_total"),
            "first_position_acceptance_seen_by_trainer": end.get("online_opd_trainer_first_position_acceptance"),
            "objective_switches": delta("online_opd_trainer_objective_switches_total")}


def timeline(arm: dict, tau_of) -> list[dict]:
    """(seconds since the arm started, version serving, held-out tau) at each switch of `current`."""
    points = []
    registry: DrafterRegistry = arm["registry"]
    for event in arm["history"]:
        if event["event"] in ("promote", "rollback"):
            version = event["version"]  # for a rollback: the version switched back to
            info = registry.get(version)
            points.append({"t": max(0.0, event["time"] - arm["t0"]), "event": event["event"],
                           "version": version, "step": info.step, "tau_held_out": tau_of(info.path),
                           "gate": (info.metrics or {}).get("gate"), "live": (info.metrics or {}).get("live_check")})
    return points


def plot(static_tau: float, arms: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    end = max(a["wall_s"] for a in arms) if arms else 1.0
    ax.hlines(static_tau, 0, end / 60, colors="grey", linestyles="--", label="(a) static bootstrap")
    labels = {"target_rollout": "online target-rollout KL", "draft_opd": "online Draft-OPD",
              "auto": "online auto (objective from live acceptance)"}
    for arm in arms:
        label = labels.get(arm["objective"], f"online {arm['objective']}")
        xs, ys = [], []
        for p in arm["timeline"]:
            xs.append(p["t"] / 60)
            ys.append(p["tau_held_out"])
        xs.append(arm["wall_s"] / 60)
        ys.append(ys[-1] if ys else static_tau)
        ax.step(xs, ys, where="post", label=label)
    ax.set_xlabel("wall time of the arm (min)")
    ax.set_ylabel("served tau, held-out HumanEval (T=0)")
    ax.set_title("ShareGPT-bootstrapped drafter under HumanEval traffic")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    p.add_argument("--bootstrap", type=Path, default=ROOT / "runs" / "bootstrap",
                   help="bootstrap run folder (holds drafter/)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "domain_shift")
    p.add_argument("--steps", type=int, default=150, help="trainer steps per online arm (equal compute)")
    p.add_argument("--minutes", type=float, default=14.0, help="wall-time cap per online arm")
    p.add_argument("--gate-every", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sequences-per-step", type=int, default=2)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--arms", default="target_rollout,draft_opd",
                   help="comma-separated trainer.objective values, one online arm each (auto too), or "
                        f"{', '.join(ARM_SETTINGS)}")
    p.add_argument("--seed", type=int, default=0, help="trainer.seed of every online arm")
    p.add_argument("--speculation", default="always", choices=["always", "auto"],
                   help="serve.speculation: always = a block at every step, every verified block learnable "
                        "(the most the trainer has to keep up with); auto = the product's policy")
    p.add_argument("--capture-features", action="store_true",
                   help="capture the verifier's top-32 and the target's features for every request")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override of every online arm, after the benchmark's own (repeatable); "
                        "recorded in the JSON's `set`, which domain_shift_seeds.py requires equal across pooled runs")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the traffic (no per-request seed: every repeat of a prompt is "
                        "a fresh sample); the held-out evaluation stays exact at T=0")
    args = p.parse_args()
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.bootstrap / "drafter" / "manifest.json").exists():
        raise SystemExit(f"{args.bootstrap}/drafter missing: run `online-opd bootstrap` first")
    args.out.mkdir(parents=True, exist_ok=True)
    commit, code = source_commit(), code_version()  # before the arms: the code their servers start on
    cfg = load_config(args.config)
    target = resolve_target(cfg, progress=False)
    start = time.time()
    rollouts = humaneval_rollouts(cfg, target, args.eval_prompts, args.max_tokens)
    drafter = load_drafter(args.bootstrap / "drafter")
    tau_of = HeldOutTau(target, rollouts, drafter.target_layer_ids)
    static_tau = tau_of(args.bootstrap / "drafter")
    logger.info("held-out HumanEval: %d rollouts; static tau %.4f", len(rollouts), static_tau)
    arms = []
    names = {"target_rollout": "naive", "draft_opd": "draft_opd"}
    for objective in args.arms.split(","):
        arm = run_arm(names.get(objective, objective), objective, args, args.bootstrap, args.out)
        arm["timeline"] = timeline(arm, tau_of)
        arm.pop("registry")
        arms.append(arm)
        logger.info("%s done: %s", arm["name"], [(round(p["t"]), p["version"], round(p["tau_held_out"], 4))
                                                 for p in arm["timeline"]])
    plot(static_tau, arms, args.out / "domain_shift.png")
    result = {"command": " ".join(sys.argv), "commit": commit, "code_version": code, "seed": args.seed, "capture_features": args.capture_features,
              "speculation": args.speculation, "traffic": traffic_name(args.temperature), "set": args.set,
              "held_out_prompts": len(rollouts), "max_tokens": args.max_tokens,
              "static_tau": static_tau, "steps_per_arm": args.steps, "minutes_per_arm": args.minutes,
              "arms": [{k: v for k, v in a.items() if k != "history"} for a in arms],
              "final_tau": {"static": static_tau, **{a["name"]: (a["timeline"][-1]["tau_held_out"]
                                                                  if a["timeline"] else static_tau)
                                                     for a in arms}},
              "seconds": time.time() - start, "png": str(args.out / "domain_shift.png")}
    text = json.dumps(result, indent=2, default=str)
    (args.out / "domain_shift.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
