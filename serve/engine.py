"""vLLM's offline engine, as online-opd uses it: generate target rollouts,
serve a drafter with speculative decoding, read vLLM's own spec-decode
counters. vLLM is imported lazily so that `online-opd --help` stays fast.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from online_opd.traces import records

logger = logging.getLogger(__name__)

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def ngram_speculative_config(num_speculative_tokens: int = 4) -> dict[str, Any]:
    """vLLM's built-in prompt-lookup speculation (no drafter, no training): the baseline every
    speed benchmark reports beside the learned drafter. Lookup 2-4 tokens, as measured in the README."""
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters (differences between two snapshots)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """tau (``records.acceptance_length``); 1.0 without drafts: one token per target forward."""
        tau = records.acceptance_length(self.num_accepted_tokens, self.num_drafts)
        return 1.0 if tau is None else tau

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        per_pos = [a - (other.accepted_per_pos[i] if i < len(other.accepted_per_pos) else 0)
                   for i, a in enumerate(self.accepted_per_pos)]
        return SpecCounters(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            per_pos,
        )


def make_llm(
    target: str | Path,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    drafter: str | Path | None = None,
    num_speculative_tokens: int | None = None,
    method: str = "dflash",
    runtime_env: dict[str, str] | None = None,
    speculative_config: dict[str, Any] | None = None,
):
    """A vLLM `LLM` for `target`, with speculative decoding when `drafter` is given (or with
    `speculative_config` as is, e.g. ``ngram_speculative_config()``). `runtime_env`
    (serve/cpu_runtime.py) goes into this process's environment before vLLM spawns its engine."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries results (JSON)
    os.environ.update(runtime_env or {})
    from vllm import LLM

    kwargs: dict[str, Any] = {"enforce_eager": True, "disable_log_stats": False}
    kwargs.update(engine_kwargs or {})
    if speculative_config is not None:
        kwargs["speculative_config"] = dict(speculative_config)
    elif drafter is not None:
        kwargs["speculative_config"] = {
            "method": method,
            "model": str(drafter),
            "num_speculative_tokens": num_speculative_tokens,
        }
    start = time.perf_counter()
    llm = LLM(model=str(target), dtype=dtype, max_model_len=max_model_len, **kwargs)
    logger.info("vLLM engine ready in %.1fs (drafter=%s)", time.perf_counter() - start, drafter)
    return llm


def chat_prompt_ids(tokenizer, conversations: Sequence[list[dict]]) -> list[list[int]]:
    """Token ids of each conversation under the target's chat template."""
    return [
        list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        for msgs in conversations
    ]


def generate(
    llm,
    prompt_ids: Sequence[list[int]],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    progress: bool = True,
) -> list[Generation]:
    """Generate from token-id prompts; outputs keep the prompts' order."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=progress
    )
    return [
        Generation(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        for o in outputs
    ]


def spec_counters(llm) -> SpecCounters:
    """Snapshot of vLLM's own spec-decode counters (in-process `get_metrics`)."""
    counters = SpecCounters()
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in SPEC_COUNTERS:
            setattr(counters, SPEC_COUNTERS[name], int(metric.value))
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            counters.accepted_per_pos = [int(v) for v in metric.values]
    return counters


def shutdown(llm) -> None:
    """Stop the engine's worker processes now rather than at interpreter exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # best effort: the engine may already be gone
        logger.debug("engine shutdown raised", exc_info=True)
