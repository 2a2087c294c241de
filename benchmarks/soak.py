"""The long soak: `online-opd serve` with its trainer under mixed traffic and hot reloads.

Setup. A bootstrap run of configs/test-serve.yaml (`--run-dir`; trained first
if missing, ~25 min here): its drafter memorised six target rollouts and is
the registry's first version. Prompts: those six plus `--extra-prompts`
held-out ShareGPT prompts under the chat template. References: plain vLLM's
greedy outputs of every prompt (an offline engine without speculation,
stopped before the server starts).

Server: configs/test-online.yaml (trainer, gate and reloader on, starting
from the bootstrap drafter), its buffer and registry under `--work-dir`.

Traffic (serve/soak.py) for `--duration-s` at `--concurrency`: T=0 and T=0.8,
streamed or not, 10% opted out, `--max-tokens` each; an admin hot reload every
`--reload-every-s`, alternating between v0001 and the registry's current
version (the trainer promotes versions too, which the reloader follows).

Required (the "problems" entry is empty): 0 failed requests; every ok request
that did not opt out is exactly one buffer record, matched on (prompt ids,
output ids); 0 corrupt segments; every reload ok (admin replies and the
`online_opd_reloads_total` series); greedy outputs identical to plain vLLM's.

    python benchmarks/soak.py --out benchmarks/results/soak.json

One JSON object on stdout (also written to --out); logs on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from online_opd.config import load_config
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.buffer import BufferReader
from online_opd.train.sequences import load_sequences
from serve.cpu_runtime import runtime_env_for
from serve.launcher import ROOT, ServerProcess
from serve.soak import TrafficSettings, check_soak, problems, run_reloads, run_traffic

logger = logging.getLogger("soak")

TOKEN = "soak-bench"
SERVE_CONFIG = ROOT / "configs" / "test-serve.yaml"
ONLINE_CONFIG = ROOT / "configs" / "test-online.yaml"


def bootstrap_run(run_dir: Path) -> Path:
    """The memorising bootstrap run (trained once); returns ``run_dir``."""
    if not (run_dir / "drafter" / "manifest.json").exists():
        logger.info("training the bootstrap drafter in %s (once)", run_dir)
        subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", "bootstrap", "-c", str(SERVE_CONFIG),
                        "--run-dir", str(run_dir)], cwd=ROOT, check=True)
    return run_dir


def soak_prompts(run_dir: Path, num_extra: int, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, plain vLLM greedy output ids): the run's six prompts, then ``num_extra`` held-out ones."""
    from online_opd.data import load_prompts
    from serve import engine
    from serve.pipeline import load_tokenizer, resolve_target

    cfg = load_config(SERVE_CONFIG)
    target = resolve_target(cfg, progress=False)
    prompts = [s.tokens[: s.prompt_len].tolist() for s in load_sequences(run_dir / "rollouts.safetensors")]
    if num_extra:
        extra = load_prompts("sharegpt", num_prompts=num_extra, seed=1, split="held_out")
        prompts += engine.chat_prompt_ids(load_tokenizer(target), [p.messages for p in extra])
    prompts = [p for p in prompts if len(p) + max_tokens <= cfg.model.max_model_len]
    llm = engine.make_llm(target, dtype=cfg.model.serving_dtype(), max_model_len=cfg.model.max_model_len,
                          engine_kwargs=cfg.engine,
                          runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores))
    try:
        outputs = [g.output_ids for g in engine.generate(llm, prompts, max_tokens=max_tokens, progress=False)]
    finally:
        engine.shutdown(llm)
    return prompts, outputs


def run_soak(args: argparse.Namespace, work: Path, prompts: list[list[int]], references: list[list[int]]) -> dict:
    server = ServerProcess(work / "serve", ONLINE_CONFIG, "-o", f"bootstrap.output_dir={args.run_dir}", token=TOKEN)
    settings = TrafficSettings(base_url=server.url, prompts=prompts, concurrency=args.concurrency,
                               duration_s=args.duration_s, max_tokens=args.max_tokens)
    stop, reloads = threading.Event(), []
    try:
        server.wait_ready()
        registry = DrafterRegistry(server.run_dir / "registry")
        choose = lambda turn: "v0001" if turn % 2 else registry.current().version  # noqa: E731
        reloader = threading.Thread(target=lambda: reloads.extend(
            run_reloads(server.admin, choose, args.reload_every_s, stop)))
        before = server.metrics()
        start = time.monotonic()
        reloader.start()
        requests = run_traffic(settings)
        wall = time.monotonic() - start
        stop.set()
        reloader.join(600)
        time.sleep(5.0)  # the last records reach the buffer (capture.flush_interval_s is 0.5 s)
        after = server.metrics()
        reader = BufferReader(server.buffer)
        records = list(reader.iter_records())
        corrupt = reader.stats()["corrupt_segments"]
    finally:
        stop.set()
        code = server.stop()
    figures = check_soak(settings, requests, records, references=dict(enumerate(references)),
                         corrupt_segments=corrupt, reloads=reloads)
    return {"figures": figures, "wall_s": round(wall, 1), "server_exit_code": code,
            "metrics": metric_deltas(before, after), "reloads": reloads}


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """online_opd_* counters and vLLM's spec-decode counters: change over the soak."""
    keys = [k for k in after if k.startswith(("online_opd_", "vllm:spec_decode_num_"))
            and (k.endswith("_total") or "_total{" in k)]
    return {k: after[k] - before.get(k, 0.0) for k in sorted(keys)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    figures, metrics = result["figures"], result["metrics"]
    failed_reload_series = {k: v for k, v in metrics.items() if k.startswith("online_opd_reloads_total{")
                            and "result=ok" not in k and v}
    found = problems(figures) | ({"reloads_not_ok_on_metrics": failed_reload_series} if failed_reload_series else {})
    if result["server_exit_code"] not in (0, -15):
        found["server_exit_code"] = result["server_exit_code"]
    drafts = metrics.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    return {"problems": found, "output_tokens_per_s": round(figures["output_tokens"] / result["wall_s"], 2),
            "served_tau": round(1 + accepted / drafts, 4) if drafts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reload-every-s", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--extra-prompts", type=int, default=26, help="held-out ShareGPT prompts (default 26)")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "test-serve-bootstrap",
                        help="bootstrap run of configs/test-serve.yaml (trained if missing)")
    parser.add_argument("--work-dir", type=Path, default=None, help="server folders (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.run_dir = bootstrap_run(args.run_dir.resolve())
    prompts, references = soak_prompts(args.run_dir, args.extra_prompts, args.max_tokens)
    logger.info("%d prompts, plain vLLM references ready; soaking for %.0fs at concurrency %d",
                len(prompts), args.duration_s, args.concurrency)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        result = run_soak(args, args.work_dir or Path(tmp), prompts, references)
    out = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "num_prompts": len(prompts), **summarize(result), **result}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
