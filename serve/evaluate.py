"""`online-opd eval`: a drafter's served acceptance and speed on vLLM.

One engine without speculative decoding, one with the drafter and one with
vLLM's built-in ngram speculation (the baseline that needs no training), in
the same process, on the same prompts, at each configured concurrency
(prompts are submitted in groups of that size). Acceptance length comes from vLLM's
own counters: tau = 1 + accepted / drafts. At temperature 0 the outputs of
each speculative engine are also compared with plain's token for token (lossless check).
With ``record`` the drafter's served acceptance goes into its manifest (``metrics.eval``):
`online-opd serve --speculation auto` starts from it until it has measured the drafter live.
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


def _measure(cfg: OnlineOPDConfig, target: Path, prompt_ids, progress: bool, **llm_kwargs) -> tuple[dict, list, dict]:
    """One engine (`llm_kwargs` choose the speculation) over every concurrency level: figures,
    the first level's outputs and the acceptance from vLLM's counters."""
    engine_kwargs = {**cfg.engine, "max_num_seqs": max(cfg.eval.max_num_seqs)}
    llm = engine.make_llm(target, dtype=cfg.model.serving_dtype(), max_model_len=cfg.model.max_model_len,
                          engine_kwargs=engine_kwargs,
                          runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores), **llm_kwargs)
    try:
        before = engine.spec_counters(llm)
        figures, outputs = _run_levels(llm, prompt_ids, cfg, progress)
        counters = engine.spec_counters(llm) - before
    finally:
        engine.shutdown(llm)
    return figures, outputs, _acceptance(counters)


def evaluate(cfg: OnlineOPDConfig, drafter: Path, *, progress: bool = True, record: bool = False) -> dict:
    """Served tau and tokens/s of `drafter`, with a no-speculation baseline and vLLM's ngram
    speculation on the same prompts (`eval.baseline`, `eval.ngram`); with ``record``, the served
    acceptance is written into the drafter's manifest (``recorded_figures``)."""
    from online_opd.models.drafters.checkpoint import (
        read_manifest,
        record_manifest_metrics,
        verify_checkpoint,
    )
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
    result = {"drafter": str(drafter), "version": read_manifest(drafter).get("version"),
              "method": method, "num_speculative_tokens": num_spec, "num_prompts": len(prompt_ids),
              "max_tokens": cfg.eval.max_tokens, "temperature": cfg.eval.temperature}
    baseline_outputs = None
    if cfg.eval.baseline:
        result["baseline"], baseline_outputs, _ = _measure(cfg, target, prompt_ids, progress)
    result["speculative"], spec_outputs, acceptance = _measure(
        cfg, target, prompt_ids, progress, drafter=drafter, num_speculative_tokens=num_spec, method=method)
    result.update(acceptance)
    if record:
        result["recorded"] = recorded_figures(cfg, acceptance, num_spec, len(prompt_ids))
        record_manifest_metrics(drafter, "eval", result["recorded"])
        logger.info("recorded the served acceptance in %s/manifest.json (metrics.eval): tau %.3f",
                    drafter, acceptance["acceptance_length"])
    if cfg.eval.ngram:
        ngram = engine.ngram_speculative_config(num_spec)
        figures, ngram_outputs, ngram_acceptance = _measure(cfg, target, prompt_ids, progress,
                                                            speculative_config=ngram)
        result["ngram"] = {"speculative_config": ngram, **figures, **ngram_acceptance}
    if baseline_outputs is not None:
        result["speedup"] = _ratios(result["speculative"], result["baseline"])
        if cfg.eval.ngram:
            result["ngram"]["speedup"] = _ratios(figures, result["baseline"])
        if cfg.eval.temperature == 0:
            result["identical_outputs"] = _num_identical(baseline_outputs, spec_outputs)
            if cfg.eval.ngram:
                result["ngram"]["identical_outputs"] = _num_identical(baseline_outputs, ngram_outputs)
    return result


def recorded_figures(cfg: OnlineOPDConfig, acceptance: dict, num_spec: int, num_prompts: int) -> dict:
    """What ``record`` stores in the manifest: the served acceptance and what it was measured on."""
    return {"tau": acceptance["acceptance_length"],
            "acceptance_rate_per_position": acceptance["acceptance_rate_per_position"],
            "num_drafts": acceptance["num_drafts"], "num_speculative_tokens": num_spec,
            "prompts": cfg.eval.prompts, "split": cfg.eval.split, "num_prompts": num_prompts,
            "max_tokens": cfg.eval.max_tokens, "temperature": cfg.eval.temperature,
            "dtype": cfg.model.serving_dtype(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _num_identical(baseline: list, outputs: list) -> str:
    return f"{sum(a.output_ids == b.output_ids for a, b in zip(baseline, outputs))}/{len(outputs)}"


def _ratios(figures: dict, baseline: dict) -> dict:
    return {level: round(figures[level]["tokens_per_s"] / fig["tokens_per_s"], 3)
            for level, fig in baseline.items()}


def _acceptance(c: engine.SpecCounters) -> dict:
    drafts = max(c.num_drafts, 1)
    return {
        "acceptance_length": round(c.acceptance_length, 4),
        "num_drafts": c.num_drafts,
        "num_accepted_tokens": c.num_accepted_tokens,
        "acceptance_rate_per_position": [round(a / drafts, 4) for a in c.accepted_per_pos],
    }
