"""`online-opd eval`: a drafter's served acceptance and speed on vLLM.

One engine without speculative decoding and one with the drafter, in the
same process, on the same prompts, at each configured concurrency (prompts
are submitted in groups of that size). Acceptance length comes from vLLM's
own counters: tau = 1 + accepted / drafts. At temperature 0 the outputs of
the two engines are also compared token for token (lossless check).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from online_opd.config import OnlineOPDConfig
from online_opd.data import load_prompts
from serve import engine
from serve.cpu_runtime import runtime_env_for
from serve.pipeline import load_tokenizer, resolve_target

logger = logging.getLogger(__name__)


def _run_levels(llm, prompt_ids, cfg: OnlineOPDConfig, progress: bool) -> tuple[dict, list]:
    """Generate at every concurrency level; returns figures and the outputs of the first level."""
    figures, first_outputs = {}, None
    for level in cfg.eval.max_num_seqs:
        start, outputs = time.perf_counter(), []
        for lo in range(0, len(prompt_ids), level):
            outputs += engine.generate(llm, prompt_ids[lo:lo + level], max_tokens=cfg.eval.max_tokens,
                                       temperature=cfg.eval.temperature, seed=0, progress=False)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(o.output_ids) for o in outputs)
        figures[f"concurrency_{level}"] = {"output_tokens": num_tokens, "seconds": round(seconds, 2),
                                           "tokens_per_s": round(num_tokens / seconds, 2)}
        logger.info("concurrency %d: %.1f tok/s", level, num_tokens / seconds)
        first_outputs = first_outputs or outputs
    return figures, first_outputs


def evaluate(cfg: OnlineOPDConfig, drafter: Path, *, progress: bool = True) -> dict:
    """Served tau and tokens/s of `drafter`, with a no-speculation baseline."""
    from online_opd.models.drafters.checkpoint import read_manifest, verify_checkpoint
    from online_opd.models.drafters.registry import block_size_for_config, method_for_config

    verify_checkpoint(drafter)
    hf_config = json.loads((drafter / "config.json").read_text())
    method = method_for_config(hf_config)
    num_spec = cfg.eval.num_speculative_tokens or block_size_for_config(hf_config)
    target = resolve_target(cfg, progress=progress)
    prompts = load_prompts(cfg.eval.prompts, num_prompts=cfg.eval.num_prompts, split=cfg.eval.split,
                           held_out_fraction=cfg.data.held_out_fraction, seed=cfg.data.seed)
    prompt_ids = engine.chat_prompt_ids(load_tokenizer(target), [p.messages for p in prompts])
    prompt_ids = [p for p in prompt_ids if len(p) + cfg.eval.max_tokens <= cfg.model.max_model_len]
    engine_kwargs = {**cfg.engine, "max_num_seqs": max(cfg.eval.max_num_seqs)}
    result = {"drafter": str(drafter), "version": read_manifest(drafter).get("version"),
              "method": method, "num_speculative_tokens": num_spec, "num_prompts": len(prompt_ids),
              "max_tokens": cfg.eval.max_tokens, "temperature": cfg.eval.temperature}
    baseline_outputs = None
    if cfg.eval.baseline:
        llm = engine.make_llm(target, dtype=cfg.model.serving_dtype(), max_model_len=cfg.model.max_model_len,
                              engine_kwargs=engine_kwargs,
                              runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores))
        try:
            result["baseline"], baseline_outputs = _run_levels(llm, prompt_ids, cfg, progress)
        finally:
            engine.shutdown(llm)
    llm = engine.make_llm(target, dtype=cfg.model.serving_dtype(), max_model_len=cfg.model.max_model_len,
                          engine_kwargs=engine_kwargs, drafter=drafter,
                          runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores),
                          num_speculative_tokens=num_spec, method=method)
    try:
        before = engine.spec_counters(llm)
        result["speculative"], spec_outputs = _run_levels(llm, prompt_ids, cfg, progress)
        counters = engine.spec_counters(llm) - before
    finally:
        engine.shutdown(llm)
    result.update(_acceptance(counters))
    if baseline_outputs is not None:
        result["speedup"] = {
            level: round(result["speculative"][level]["tokens_per_s"] / fig["tokens_per_s"], 3)
            for level, fig in result["baseline"].items()}
        if cfg.eval.temperature == 0:
            same = sum(a.output_ids == b.output_ids for a, b in zip(baseline_outputs, spec_outputs))
            result["identical_outputs"] = f"{same}/{len(spec_outputs)}"
    return result


def _acceptance(c: engine.SpecCounters) -> dict:
    drafts = max(c.num_drafts, 1)
    return {
        "acceptance_length": round(c.acceptance_length, 4),
        "num_drafts": c.num_drafts,
        "num_accepted_tokens": c.num_accepted_tokens,
        "acceptance_rate_per_position": [round(a / drafts, 4) for a in c.accepted_per_pos],
    }
