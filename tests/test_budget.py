"""The bootstrap's time budget (online_opd/train/budget.py): the step plan by hand, the text feature
pass stopping at its deadline, and `online-opd bootstrap` sized to a budget on the embedded target."""

from __future__ import annotations

import json
import time

import pytest
import torch

from online_opd.config import ConfigError, load_config
from online_opd.train.budget import PLAN_FILE, Budget, StepPlan, planned_steps
from tests.serving import ROOT


def test_planned_steps_by_hand():
    assert planned_steps(3600, 0.5, 1000.0, 90.0) == 1820  # (1000 - 90) / 0.5
    assert planned_steps(1000, 0.5, 1000.0, 90.0) == 1000  # all fit: the configured steps
    assert planned_steps(3600, 0.3, 90.5, 90.0) == 1  # 0.5 s left after the reserve: one step
    assert planned_steps(3600, 0.6, 90.5, 90.0) == 0  # not one
    assert planned_steps(3600, 0.3, -5.0, 90.0) == 0  # the budget already spent
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step time"):
            planned_steps(10, bad, 100.0, 1.0)


def test_budget_clock():
    now = [100.0]
    budget = Budget(1800.0, 100.0, clock=lambda: now[0])
    assert budget.deadline() == 1900.0 and budget.deadline(0.4) == 820.0
    now[0] = 700.0
    assert budget.used_s() == 600.0 and budget.left_s() == 1200.0


def test_step_plan_round_trip_and_a_corrupt_file(tmp_path):
    assert StepPlan.load(tmp_path) is None
    plan = StepPlan(time_budget_s=1800, used_before_training_s=400.0, step_s=0.61, num_steps_configured=3600,
                    num_steps=2147)
    plan.save(tmp_path)
    assert StepPlan.load(tmp_path) == plan
    (tmp_path / PLAN_FILE).write_text('{"num_steps": 5}')
    with pytest.raises(ValueError, match="not a bootstrap step plan.*delete it"):
        StepPlan.load(tmp_path)


def test_budget_settings_are_validated():
    for bad in ("bootstrap.time_budget_s=0", "bootstrap.text_feature_share=0", "bootstrap.text_feature_share=1.5"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    cfg = load_config(ROOT / "configs/default.yaml")
    assert cfg.bootstrap.time_budget_s == 1800 and cfg.bootstrap.text_feature_share == 0.4


def test_feature_pass_stops_at_its_deadline_between_sequences():
    """A clock that reads 0, 1, 2, ...: with the deadline at 1.5 the pass does two sequences (it checks
    before each), and the features it filled equal a pass without a deadline."""
    from online_opd.models.target import ensure_embedded_target
    from online_opd.models.target_model import TargetModel
    from online_opd.train.sequences import TrainSequence, compute_aux_hidden

    target = TargetModel.from_pretrained(ensure_embedded_target(progress=False), dtype=torch.float32)

    def sequences():
        return [TrainSequence(torch.arange(10 + i, 18 + 2 * i), 4) for i in range(4)]

    ticks = iter(range(100))
    cut, full = sequences(), sequences()
    assert compute_aux_hidden(target, cut, (1, 3), with_labels=True, progress=False, deadline=1.5,
                              clock=lambda: next(ticks)) == 2
    assert compute_aux_hidden(target, full, (1, 3), with_labels=True, progress=False) == 4
    assert all(s.aux_hidden is None and s.labels is None for s in cut[2:])
    for a, b in zip(cut[:2], full[:2]):
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.labels, b.labels)


def _text_only(*overrides: str):
    return load_config(ROOT / "configs/test-tiny.yaml", ["bootstrap.rollouts=false", "bootstrap.text_conversations=3",
                                                         "bootstrap.text_max_tokens=12", *overrides])


def test_a_budget_that_fits_trains_every_step_and_records_its_plan(tmp_path):
    from online_opd.models.drafters.checkpoint import read_manifest
    from serve.pipeline import bootstrap

    drafter = bootstrap(_text_only("bootstrap.num_steps=3", "bootstrap.time_budget_s=3600"), tmp_path,
                        progress=False)
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert plan["num_steps"] == plan["num_steps_configured"] == 3 and plan["step_s"] > 0
    assert read_manifest(drafter)["metrics"]["budget"] == plan and read_manifest(drafter)["step"] == 3
    assert read_manifest(drafter)["metrics"]["num_text_sequences"] == 3


def test_a_tight_budget_plans_fewer_steps_and_ends_in_time(tmp_path):
    """100,000 configured steps in a 12 s budget: the plan fits what the measured step time allows
    in what is left, the loop stops at the budget's end at the latest, and the drafter is saved; a
    resumed run keeps the stored plan (its learning-rate schedule)."""
    from online_opd.models.drafters.checkpoint import read_manifest
    from serve.pipeline import bootstrap

    cfg = _text_only("bootstrap.num_steps=100000", "bootstrap.time_budget_s=12", "bootstrap.checkpoint_every=50",
                     "bootstrap.log_every=50")
    start = time.monotonic()
    drafter = bootstrap(cfg, tmp_path, progress=False)
    elapsed = time.monotonic() - start
    plan = StepPlan.load(tmp_path)
    assert 1 <= plan.num_steps < 100000 and plan.num_steps_configured == 100000
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == read_manifest(drafter)["step"] <= plan.num_steps
    assert elapsed < 12 + 5, elapsed  # the budget, plus the final save and the bootstrap's return
    if steps[-1] < plan.num_steps:  # stopped by the budget: a resumed run goes on under the same plan
        bootstrap(cfg, tmp_path, progress=False)
        assert StepPlan.load(tmp_path) == plan


def test_a_budget_spent_before_any_text_says_so(tmp_path):
    from serve.pipeline import bootstrap

    with pytest.raises(RuntimeError, match=r"time budget's text share ended before the first conversation"):
        bootstrap(_text_only("bootstrap.time_budget_s=0.01"), tmp_path, progress=False)
    assert not (tmp_path / "text_sequences.safetensors").exists()
