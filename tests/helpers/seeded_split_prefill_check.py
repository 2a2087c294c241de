"""Seeded sampled requests whose prefill is split over steps, on vLLM's CPU engine.

Usage: python seeded_split_prefill_check.py TARGET_DIR OUT_DIR  (writes OUT_DIR/result.json)

Runs one workload on two engines: the whole prompt in one step (the token
budget holds it) and the prompt split into chunks of SPLIT_BUDGET tokens (the
speculative path: tests/test_serve.py). The workload is NUM_SEEDS seeded T=0.8
requests for a prompt of about 300 tokens, submitted together, so every one of
them samples (and discards) a token from a partial prompt. The result holds
every engine's outputs, or the error that ended it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPT = " ".join(f"Item {i}: the {w} is on the table." for i, w in enumerate(
    ["cup", "book", "lamp", "pen", "plate", "key", "phone", "box", "clock", "vase"] * 3)) + " Now list them:"
NUM_SEEDS = 4
MAX_TOKENS = 16
TEMPERATURE = 0.8
SPLIT_BUDGET = 64  # tokens per step: the prompt's prefill takes several steps


def run(target: str, max_num_batched_tokens: int) -> dict:
    """{"outputs": token ids per seed, "prompt_tokens": n} or {"error": "..."} for one engine."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from serve.engine import shutdown

    llm = LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=NUM_SEEDS,
              max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True,
              enable_prefix_caching=False, distributed_executor_backend="uni",
              seed=0)
    prompt = llm.get_tokenizer().encode(PROMPT)
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)] * NUM_SEEDS,
            [SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True)
             for seed in range(NUM_SEEDS)], use_tqdm=False)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "prompt_tokens": len(prompt)}
    except Exception as exc:  # the defect ends the engine: report it rather than die
        result = {"error": f"{type(exc).__name__}: {exc}", "prompt_tokens": len(prompt)}
    shutdown(llm)
    return result


def main(target: str, out_dir: str) -> None:
    result = {
        "whole": run(target, 2048),
        "split": run(target, SPLIT_BUDGET),
    }
    (Path(out_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
