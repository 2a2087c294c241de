"""Bootstrap a drafter on the embedded default and measure it served by vLLM.

Runs `online-opd bootstrap` (resumable: a finished run folder is reused) and
`online-opd eval` in one process and prints one JSON object: bootstrap wall
time of this invocation, the trainer's own step seconds (from metrics.jsonl),
served tau on held-out ShareGPT prompts, and tokens/s with vs without
speculative decoding at each configured concurrency, for each block size in
--serve-k (the same drafter served with fewer draft tokens).

    python benchmarks/bootstrap_served.py -c configs/default.yaml --run-dir runs/bootstrap --serve-k 4 --serve-k 2
    python benchmarks/bootstrap_served.py --run-dir runs/bt-text --serve-k 4 bootstrap.text_conversations=1024

The speedups of later block sizes are against the first one's baseline figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from online_opd.config import load_config
from serve.evaluate import evaluate
from serve.pipeline import bootstrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bootstrap"))
    parser.add_argument("--serve-k", type=int, action="append", default=None,
                        help="draft tokens per step to serve with, repeatable (default: the drafter's block "
                             "size); one value per flag, so that config overrides may follow")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_config(args.config, args.overrides)
    start = time.perf_counter()
    drafter = bootstrap(cfg, args.run_dir)
    result = {"bootstrap_wall_s_this_run": round(time.perf_counter() - start, 1)}
    steps = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    result["bootstrap_train_s"] = round(sum(s["step_s"] for s in steps), 1)
    result["bootstrap_steps"] = len(steps)
    for i, k in enumerate(args.serve_k or [None]):
        # the no-speculation baseline is measured once, with the first block size
        update = {"num_speculative_tokens": k, "baseline": cfg.eval.baseline and i == 0}
        eval_cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=update)})
        result[f"serve_k_{k or 'default'}"] = evaluate(eval_cfg, drafter)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
