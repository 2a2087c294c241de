"""Greedy and sampled requests in the same speculative batches on vLLM's CPU engine.

Usage: python mixed_batch_check.py TARGET_DIR OUT_DIR  (writes OUT_DIR/result.json)

Runs one workload twice, on the non-speculative engine and on an ngram
speculative engine (vLLM's rejection sampler with real acceptance: the prompts
repeat themselves). The workload is a list of greedy requests on repetitive
prompts, followed by NUM_SAMPLES seeded T=0.8 requests for SAMPLED_PROMPT, so
continuous batching keeps the greedy requests in batches with sampled ones.
The result holds both engines' greedy outputs, the first NUM_SAMPLED_TOKENS
tokens of every sample, and the speculative engine's spec-decode counters.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

GREEDY_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog",
    "one two three four five, one two three four five, one two three",
    "<li>apple</li>\n<li>pear</li>\n<li>plum</li>\n<li>apple</li>\n<li>pear</li>\n",
    "A: hello\nB: hi\nA: hello\nB: hi\nA: hello\nB:",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw =",
]
SAMPLED_PROMPT = "red green blue, red green blue, red green blue, red green blue, red"
NUM_SAMPLES = 200
NUM_SAMPLED_TOKENS = 3
GREEDY_MAX_TOKENS = 24
TEMPERATURE = 0.8
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def workload(tokenizer):
    """(prompt ids, SamplingParams) per request: greedy first, then the seeded samples."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS)
    requests = [(tokenizer.encode(p), greedy) for p in GREEDY_PROMPTS]
    sampled_ids = tokenizer.encode(SAMPLED_PROMPT)
    requests += [(sampled_ids, SamplingParams(temperature=TEMPERATURE, max_tokens=NUM_SAMPLED_TOKENS,
                                              seed=seed, ignore_eos=True))
                 for seed in range(NUM_SAMPLES)]
    return requests


def run(target: str, speculative_config: dict | None) -> dict:
    """Outputs of the workload on one engine (greedy outputs, samples, spec counters)."""
    from vllm import LLM, TokensPrompt

    from serve.engine import shutdown, spec_counters

    llm = LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=32,
              distributed_executor_backend="uni", disable_log_stats=False, speculative_config=speculative_config, seed=0)
    requests = workload(llm.get_tokenizer())
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in requests],
                           [params for _, params in requests], use_tqdm=False)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    counters = asdict(spec_counters(llm))
    shutdown(llm)
    return {"greedy": token_ids[:len(GREEDY_PROMPTS)], "samples": token_ids[len(GREEDY_PROMPTS):],
            "spec": counters}


def main(target: str, out_dir: str) -> None:
    result = {"reference": run(target, None), "speculative": run(target, NGRAM)}
    (Path(out_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
