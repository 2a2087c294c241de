"""serve/pipeline.py rollouts: the greedy pass, then data.rollout_samples sampled passes (vLLM's CPU engine,
the embedded target)."""

from __future__ import annotations

from pathlib import Path

import pytest

from online_opd.config import apply_overrides, load_config
from serve.pipeline import generate_rollouts, resolve_target, rollout_temperatures

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "test-tiny.yaml"


def test_rollout_temperatures_sample_the_train_split_only():
    cfg = load_config(CONFIG, ["data.rollout_samples=2", "data.rollout_temperature=0.9"])
    assert rollout_temperatures(cfg, "train") == [0.0, 0.9, 0.9]
    assert rollout_temperatures(cfg, "train", greedy=False) == [0.9, 0.9]
    assert rollout_temperatures(cfg, "held_out") == [0.0]
    assert rollout_temperatures(apply_overrides(cfg, ["data.rollout_samples=0"]), "train") == [0.0]
    with pytest.raises(ValueError, match="rollout_temperature"):
        apply_overrides(cfg, ["data.rollout_temperature=0"])


@pytest.mark.slow
def test_sampled_rollouts_follow_the_greedy_ones_differ_from_them_and_reproduce():
    """Three prompts, two samples each at T = 1: the greedy pass first, then each sampled pass over the
    same prompts in order; samples differ from the greedy replies and between passes (a seed per pass), and
    a second engine draws the same ones (per-request seeds; vllm_patches/cpu_fixes.py on the CPU)."""
    cfg = load_config(CONFIG, ["data.num_prompts=3", "data.max_new_tokens=12", "data.rollout_samples=2",
                               "data.rollout_temperature=1.0"])
    target = resolve_target(cfg, progress=False)
    sequences = generate_rollouts(cfg, target, progress=False)
    assert len(sequences) == 9
    prompts = [s.tokens[: s.prompt_len].tolist() for s in sequences]
    replies = [s.tokens[s.prompt_len:].tolist() for s in sequences]
    assert prompts[3:6] == prompts[:3] and prompts[6:] == prompts[:3]
    assert replies[3:6] != replies[:3] and replies[6:] != replies[3:6]
    again = generate_rollouts(cfg, target, progress=False)
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in sequences]
