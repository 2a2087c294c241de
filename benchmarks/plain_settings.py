"""Plain vLLM on this CPU: which runtime settings serve the target fastest.

Each variant is one plain `vllm serve` (no speculation, no online-opd plugin; serve/launcher.py
``PlainVllmServer``) of the same model and flags; only these change:

- dtype: float32 or bfloat16;
- OpenMP: torch's libgomp (what vLLM preloads by itself) or Intel's libiomp5 from the venv
  (`LD_PRELOAD`, serve/cpu_runtime.py);
- reserved cores: vLLM's default (one core kept for the scheduler and API server) or 0
  (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`: the engine's OpenMP threads bind every core).

Per variant: warm-up requests, then closed-loop loads at each concurrency (held-out ShareGPT
prompts, temperature 0, `ignore_eos`), output tokens/s from serve/loadgen.py. The ratio of each
variant to vLLM's own defaults (float32, libgomp, default reservation) is printed per concurrency.

    python benchmarks/plain_settings.py --out benchmarks/results/plain_settings.json

One JSON object on stdout (also written to --out); logs on stderr. One run on a shared 2-core
machine: differences under ~5% are noise.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve.cpu_runtime import cpu_runtime_env
from serve.launcher import ROOT, PlainVllmServer, emit_result
from serve.loadgen import LoadConfig, run_load

logger = logging.getLogger("plain_settings")


def measure(url: str, concurrencies: list[int], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in concurrencies:
        common = dict(base_url=f"{url}/v1", prompts="sharegpt", split="held_out", num_prompts=256,
                      max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, concurrency=c, progress=False)
        run_load(LoadConfig(**common, seed=1, num_requests=max(args.warmup, c)))
        summary = run_load(LoadConfig(**common, seed=0, num_requests=args.requests_per_worker * c))
        out[str(c)] = {k: summary[k] for k in ("output_tokens_per_s", "requests_ok", "requests_failed", "wall_s")}
        logger.info("  c=%d: %.1f tokens/s", c, summary["output_tokens_per_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml",
                        help="config whose target is served (default: the embedded CPU default)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--openmp", nargs="+", default=["gomp", "iomp"], choices=["gomp", "iomp"])
    parser.add_argument("--reserved", nargs="+", default=["default", "0"],
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU values; 'default' = vLLM's own")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-worker", type=int, default=3, help="measured requests = this x c")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    for name in ("httpx", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from online_opd.config import load_config
    from serve.pipeline import resolve_target

    target = resolve_target(load_config(args.config), progress=False)
    variants = []
    with tempfile.TemporaryDirectory(prefix="plain-settings-") as tmp:
        for i, (dtype, openmp, reserved) in enumerate(itertools.product(args.dtypes, args.openmp, args.reserved)):
            name = f"{dtype}/{openmp}/reserved={reserved}"
            env = cpu_runtime_env(openmp, None if reserved == "default" else int(reserved))
            logger.info("%s: %s", name, env)
            start = time.perf_counter()
            server = PlainVllmServer(Path(tmp) / f"v{i}", target, dtype=dtype, max_num_seqs=args.max_num_seqs,
                                     runtime_env=env)
            try:
                server.wait_ready(timeout=900)
                logger.info("%s: ready in %.0f s", name, time.perf_counter() - start)
                result = measure(server.url, args.concurrency, args)
            finally:
                server.stop()
            variants.append({"name": name, "dtype": dtype, "openmp": openmp, "reserved_cores": reserved,
                             "env": env, "by_concurrency": result})
    base = variants[0]["by_concurrency"]
    for v in variants:
        v["ratio_to_first"] = {c: round(r["output_tokens_per_s"] / base[c]["output_tokens_per_s"], 4)
                               for c, r in v["by_concurrency"].items()}
    best = {str(c): max(variants, key=lambda v: v["by_concurrency"][str(c)]["output_tokens_per_s"])["name"]
            for c in args.concurrency}
    result = {"benchmark": "plain_settings", "target": str(target), "max_tokens": args.max_tokens,
              "max_num_seqs": args.max_num_seqs, "prompts": "sharegpt held_out, temperature 0, ignore_eos",
              "first_variant": variants[0]["name"], "fastest_by_concurrency": best, "variants": variants,
              "note": "one server per variant, run one after another on a shared 2-core machine"}
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
