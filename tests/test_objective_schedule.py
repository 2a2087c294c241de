"""``trainer.objective: auto``: the objective schedule on hand-made acceptance histories, its config,
the offline choice, and the online trainer switching, reporting and resuming it on tiny real models."""

from __future__ import annotations

import json

import pytest

from online_opd.config import ConfigError, OnlineOPDConfig, TrainerConfig, load_config
from online_opd.opd.objective_schedule import ObjectiveSchedule, Switch, upper_bound
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.records import BlockRecord, SequenceRecord
from online_opd.train.online import OnlineTrainer
from online_opd.train.opd import objective_fn, offline_objective
from tests.online_world import make_world, online_config, setup_run


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tests/online_world.py's world, built once for this module."""
    return make_world(tmp_path_factory.mktemp("online"))



def _schedule(**kw) -> ObjectiveSchedule:
    settings = {"weak": "target_rollout", "strong": "draft_opd", "up_at": 0.6, "down_at": 0.5,
                "window_blocks": 100, "min_blocks": 20, "min_steps_between_switches": 5, **kw}
    return ObjectiveSchedule(**settings)


def _blocks(a1: float, n: int) -> list[int]:
    """n blocks whose first `round(a1 * n)` accepted 1..3 tokens and the rest none (a1 exactly, for n)."""
    hits = round(a1 * n)
    return [1 + i % 3 for i in range(hits)] + [0] * (n - hits)


def test_a_weak_drafter_stays_on_the_weak_objective():
    schedule = _schedule()
    for step in range(1, 200):
        schedule.observe(_blocks(0.35, 20))  # our drafters' regime: a1 0.26-0.38
        assert schedule.choose(step) == "target_rollout"
    assert schedule.switches == [] and schedule.first_position_acceptance() == pytest.approx(0.35)


def test_no_decision_before_min_blocks():
    schedule = _schedule()
    schedule.observe([2] * 19)  # a1 = 1.0, but 19 < min_blocks = 20
    assert schedule.choose(1) == "target_rollout" and schedule.switches == []
    schedule.observe([2])
    assert schedule.choose(2) == "draft_opd"
    assert schedule.switches == [Switch(2, "target_rollout", "draft_opd", 1.0, 20)]


def test_an_improving_drafter_switches_up_when_the_window_reaches_up_at():
    """A drafter whose blocks go from a1 0.2 to 0.9: the window (100 blocks) mixes old and new blocks,
    so the switch comes when 100 * 0.6 of the newest 100 blocks accept their first token."""
    schedule = _schedule()
    schedule.observe(_blocks(0.2, 100))  # 20 hits in the window
    chosen = []
    for step in range(1, 11):
        schedule.observe([1] * 9 + [0])  # 9 hits in 10 new blocks, while 10 old ones leave (2 of them hits)
        chosen.append(schedule.choose(step))
    # hits in the window after step s: the old 100 blocks were 20 hits then 80 misses, oldest first, so
    # the first 20 leaving are the hits: s <= 2 drops 10 hits each; then misses leave.
    # window hits: s=1 10+9=19, s=2 0+18=18, then 18 + 9 (s-2) ... >= 60 first at s = 7 (63).
    assert chosen == ["target_rollout"] * 6 + ["draft_opd"] * 4
    assert schedule.switches[0].step == 7 and schedule.switches[0].first_position_acceptance == 0.63


def test_hysteresis_keeps_noise_between_the_thresholds_from_flapping():
    schedule = _schedule(min_steps_between_switches=0)
    schedule.observe(_blocks(0.7, 100))
    assert schedule.choose(1) == "draft_opd"
    for step, a1 in enumerate([0.55, 0.52, 0.58, 0.51, 0.59, 0.53] * 5, start=2):
        schedule.observe(_blocks(a1, 100))  # the whole window: a1 exactly, always inside (0.5, 0.6)
        assert schedule.choose(step) == "draft_opd"
    schedule.observe(_blocks(0.5, 100))  # at down_at: back
    assert schedule.choose(100) == "target_rollout"
    for step, a1 in enumerate([0.55, 0.59, 0.51], start=101):
        schedule.observe(_blocks(a1, 100))
        assert schedule.choose(step) == "target_rollout"  # below up_at: stays down
    assert [(s.before, s.after) for s in schedule.switches] == [("target_rollout", "draft_opd"),
                                                                ("draft_opd", "target_rollout")]


def test_min_steps_between_switches():
    schedule = _schedule(min_steps_between_switches=5)
    schedule.observe(_blocks(0.8, 100))
    assert schedule.choose(3) == "draft_opd"
    schedule.observe(_blocks(0.1, 100))  # a collapse right after the switch (a bad version, say)
    assert [schedule.choose(s) for s in range(4, 8)] == ["draft_opd"] * 4  # steps 4-7: < 5 since step 3
    assert schedule.choose(8) == "target_rollout"
    assert [s.step for s in schedule.switches] == [3, 8]


def test_the_window_forgets_old_blocks():
    schedule = _schedule(window_blocks=50, min_blocks=50)
    schedule.observe(_blocks(1.0, 1000))
    schedule.observe(_blocks(0.0, 50))
    assert schedule.num_blocks == 50 and schedule.first_position_acceptance() == 0.0
    assert schedule.choose(1) == "target_rollout"


def test_choose_is_idempotent_for_a_step():
    schedule = _schedule(min_steps_between_switches=0)
    schedule.observe(_blocks(0.9, 100))
    assert schedule.choose(1) == schedule.choose(1) == "draft_opd" and len(schedule.switches) == 1


def test_state_round_trips_through_json_and_refuses_other_objectives():
    schedule = _schedule()
    schedule.observe(_blocks(0.3, 40) + _blocks(0.9, 60))
    schedule.choose(4)
    state = json.loads(json.dumps(schedule.state_dict()))
    again = _schedule()
    again.load_state_dict(state)
    assert again.state_dict() == schedule.state_dict() and again.current == "draft_opd"
    assert again.first_position_acceptance() == schedule.first_position_acceptance()
    assert again.switches == schedule.switches
    with pytest.raises(ValueError, match="neither"):
        _schedule(weak="all_forward").load_state_dict(state | {"current": "target_rollout"})
    before = again.state_dict()
    with pytest.raises(TypeError):  # a torn switch entry: nothing is half-loaded
        again.load_state_dict(state | {"current": "target_rollout", "switches": [{"step": 1}]})
    assert again.state_dict() == before


def test_the_gate_ends_a_failed_trial_of_the_strong_objective():
    """The 30-min domain-shift runs' pattern: after the switch, Draft-OPD candidates score below the
    serving version gate after gate. After trial_gates of them (upper 90% t bound of their mean
    difference <= 0) the schedule goes back to weak and only tries again above the trial's a1 +
    retry_margin."""
    schedule = _schedule(trial_gates=3, retry_margin=0.1, min_steps_between_switches=0)
    schedule.observe(_blocks(0.62, 100))
    assert schedule.choose(1) == "draft_opd"
    assert schedule.gate_outcome(25, False, -0.01) is False
    assert schedule.gate_outcome(50, False, float("nan")) is False  # no blocks: not counted
    assert schedule.gate_outcome(75, False, -0.012) is False  # 2 of 3
    schedule.observe(_blocks(0.65, 100))  # a1 rose during the trial: the new bar is above both
    # mean -0.014, sd 0.0053, t(0.9, 2) 1.886: bound -0.014 + 1.886 * 0.0053 / sqrt(3) = -0.0082 <= 0
    assert schedule.gate_outcome(100, False, -0.02) is True
    assert schedule.current == "target_rollout" and schedule.up_at_now == pytest.approx(0.75)
    assert schedule.switches[-1] == Switch(100, "draft_opd", "target_rollout", 0.65, 100, reason="gate")
    assert schedule.choose(101) == "target_rollout"  # 0.65 >= up_at 0.6, but below the raised bar
    schedule.observe(_blocks(0.75, 100))
    assert schedule.choose(102) == "draft_opd"
    assert schedule.gate_outcome(125, False, -0.05) is False  # a new trial: one gate so far


def test_a_trial_goes_on_while_candidates_improve_plateau_or_get_promoted():
    plateau = _schedule(trial_gates=8, min_steps_between_switches=0)
    plateau.observe(_blocks(0.7, 100))
    plateau.choose(1)
    # target-rollout's 8 gates at steps 250-425 of the 30-min seed-1 run: mean -0.001, bound +0.003
    diffs = [-0.002, -0.002, -0.005, 0.005, 0.006, -0.003, -0.017, 0.008]
    assert not any(plateau.gate_outcome(25 * i, False, d) for i, d in enumerate(diffs, start=1))
    assert upper_bound(diffs, 0.9) == pytest.approx(0.0027, abs=1e-4) and plateau.current == "draft_opd"
    schedule = _schedule(trial_gates=2, min_steps_between_switches=0)
    schedule.observe(_blocks(0.7, 100))
    schedule.choose(1)
    assert not schedule.gate_outcome(25, False, 0.01) and not schedule.gate_outcome(50, False, 0.02)  # > 0
    assert not schedule.gate_outcome(75, False, -0.01)  # the last 2: mean +0.005
    assert not schedule.gate_outcome(100, True, -0.003)  # promoted
    assert not schedule.gate_outcome(125, False, -0.01)  # a promotion started the count again: 1 of 2
    assert schedule.current == "draft_opd"
    weak = _schedule(trial_gates=1)  # on weak the gate decides nothing
    assert not weak.gate_outcome(25, False, -1.0) and weak.current == "target_rollout"
    off = _schedule(trial_gates=0, min_steps_between_switches=0)
    off.observe(_blocks(0.7, 100))
    off.choose(1)
    assert not any(off.gate_outcome(25 * i, False, -1.0) for i in range(1, 20)) and off.current == "draft_opd"


def test_the_trial_state_round_trips_and_old_states_load():
    schedule = _schedule(trial_gates=2, min_steps_between_switches=0)
    schedule.observe(_blocks(0.7, 100))
    schedule.choose(1)
    schedule.gate_outcome(25, False, -0.01)
    schedule.gate_outcome(50, False, -0.01)
    schedule.gate_outcome(75, False, -0.02)  # a fresh trial? no: back on weak after 50, this one is ignored
    state = json.loads(json.dumps(schedule.state_dict()))
    again = _schedule(trial_gates=2)
    again.load_state_dict(state)
    assert again.state_dict() == schedule.state_dict() and again.up_at_now == pytest.approx(0.8)
    assert again.switches[-1].reason == "gate"
    old = {k: v for k, v in state.items() if k not in ("raised_up_at", "trial")}
    old["switches"] = [{k: v for k, v in s.items() if k != "reason"} for s in old["switches"]]
    before_rule = _schedule()
    before_rule.load_state_dict(old)  # a state written before the trial rule
    assert before_rule.up_at_now == 0.6 and before_rule.switches[-1].reason == "acceptance"


@pytest.mark.parametrize("kw, match", [
    ({"strong": "target_rollout"}, "must differ"),
    ({"down_at": 0.6}, "down_at < up_at"),
    ({"up_at": 1.2}, "down_at < up_at"),
    ({"min_blocks": 101}, "min_blocks <= window_blocks"),
    ({"min_steps_between_switches": -1}, ">= 0"),
    ({"trial_gates": -1}, "trial_gates >= 0"),
    ({"retry_margin": 1.5}, "retry_margin <= 1"),
    ({"trial_confidence": 1.0}, "trial_confidence < 1"),
])
def test_settings_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        _schedule(**kw)


@pytest.mark.parametrize("bad", [-1, 1.0, True, None])
def test_observe_refuses_what_is_no_accepted_count(bad):
    with pytest.raises(ValueError, match="accepted count"):
        _schedule().observe([bad])


def test_config_validates_the_auto_section(tmp_path):
    cfg = load_config("configs/default.yaml", ["trainer.objective=auto"])
    assert cfg.trainer.auto.weak == "lk" and cfg.trainer.auto.strong == "draft_opd"
    for overrides, match in [(["trainer.auto.down_at=0.6"], "must be below up_at"),
                             (["trainer.auto.strong=lk"], "must differ"),
                             (["trainer.auto.weak=sft"], "weak"),
                             (["trainer.auto.min_blocks=4096"], "exceeds window_blocks")]:
        with pytest.raises(ConfigError, match=match):
            load_config("configs/default.yaml", ["trainer.objective=auto", *overrides])
    with pytest.raises(ValueError, match="schedule over two objectives"):
        objective_fn(TrainerConfig(objective="auto"))


def _record(i: int, accepted: list[int]) -> SequenceRecord:
    tokens = tuple(range(1, 4 + 5 * len(accepted) + 2))
    blocks = tuple(BlockRecord(anchor=3 + 5 * j, draft_tokens=(7, 7, 7, 7), num_accepted=r)
                   for j, r in enumerate(accepted))
    return SequenceRecord(f"r{i}", "m", "v0001", 0.0, 1.0, 0, tokens, 4, blocks)


def test_offline_auto_chooses_once_from_the_records_blocks():
    cfg = TrainerConfig(objective="auto", auto={"min_blocks": 10, "window_blocks": 100})
    weak = [_record(i, [0, 0, 1, 0, 0]) for i in range(4)]  # a1 = 0.2
    strong = [_record(i, [2, 4, 1, 0, 3]) for i in range(4)]  # a1 = 0.8
    assert offline_objective(cfg, weak, block_size=4) == "lk"
    assert offline_objective(cfg, strong, block_size=4) == "draft_opd"
    assert offline_objective(cfg, strong[:1], block_size=4) == "lk"  # 5 < min_blocks blocks
    assert offline_objective(TrainerConfig(objective="all_forward"), strong, block_size=4) == "all_forward"


def _auto_config(**auto) -> OnlineOPDConfig:
    cfg = online_config()
    # the tiny world's drafter accepts its first token in 13 of 351 blocks (a1 0.037): up_at below it
    cfg.trainer = TrainerConfig.model_validate({
        **cfg.trainer.model_dump(), "objective": "auto",
        "auto": {"up_at": 0.02, "down_at": 0.0, "min_blocks": 32, "window_blocks": 4096,
                 "min_steps_between_switches": 0, **auto}})
    return cfg


def test_online_trainer_switches_reports_and_resumes_the_schedule(world, tmp_path):
    paths = setup_run(world, tmp_path)
    trainer = OnlineTrainer(_auto_config(), **paths)
    assert trainer.stats()["objective"] == "lk"
    assert trainer.stats()["first_position_acceptance"] is None
    kept = trainer.poll()
    blocks = [b.num_accepted for r in world["records"] for b in r.blocks]
    a1 = sum(r >= 1 for r in blocks) / len(blocks)
    assert kept == len(world["records"]) and trainer.schedule.num_blocks == len(blocks)
    assert trainer.stats()["first_position_acceptance"] == pytest.approx(a1) and a1 > 0.02

    first = trainer.step()
    assert first["objective"] == "draft_opd" and trainer.stats()["objective_switches"] == 1
    assert trainer.schedule.switches[0].step == 1
    gate = trainer.gate()
    manifest = DrafterRegistry(paths["registry_dir"]).get(gate["version"]).metrics
    assert manifest["objective"] == "auto"
    assert manifest["objective_schedule"]["current"] == "draft_opd"
    trainer.save()

    resumed = OnlineTrainer(_auto_config(), **paths)
    assert resumed.schedule.state_dict() == trainer.schedule.state_dict()
    assert resumed.stats()["objective"] == "draft_opd" and resumed.stats()["objective_switches"] == 1

    # a state saved with a fixed objective: the window is rebuilt from the resumed pools
    fixed_cfg = online_config()
    fixed_cfg.trainer.objective = "target_rollout"  # (the config's default is auto)
    fixed = OnlineTrainer(fixed_cfg, **setup_run(world, tmp_path / "fixed"))
    fixed.poll()
    fixed.step()
    fixed.save()
    rebuilt = OnlineTrainer(_auto_config(), **setup_run(world, tmp_path / "fixed"))
    assert rebuilt.schedule.num_blocks == len(blocks) and rebuilt.schedule.switches == []
    assert rebuilt.step() is not None and rebuilt.stats()["objective"] == "draft_opd"


def test_a_failed_trial_sends_the_trainer_back_to_the_serving_weights(world, tmp_path):
    """The online trainer reports each gate to the schedule; when the trial ends it restarts from the
    serving version with a fresh optimizer and trains with the weak objective again."""
    cfg = _auto_config(trial_gates=1, retry_margin=0.5)
    cfg.gate.margin = 10.0  # no candidate can pass
    paths = setup_run(world, tmp_path)
    trainer = OnlineTrainer(cfg, **paths)
    trainer.poll()
    assert trainer.objective_name() == "draft_opd"
    optimizer = trainer.optimizer
    gate = trainer.gate()  # the untrained candidate scores exactly the serving version's tau: diff 0
    assert gate["status"] == "rejected" and gate["tau_candidate"] == gate["tau_serving"]
    assert trainer.schedule.current == "lk" and trainer.schedule.switches[-1].reason == "gate"
    assert trainer.schedule.up_at_now == pytest.approx(trainer.stats()["first_position_acceptance"] + 0.5)
    assert trainer.optimizer is not optimizer and trainer.stats()["trained_from"] == gate["serving"]
    serving = DrafterRegistry(paths["registry_dir"]).current()
    assert trainer.objective_name() == "lk" and trainer.stats()["objective_switches"] == 2
    assert trainer.step()["objective"] == "lk" and serving.version == gate["serving"]


def test_online_trainer_with_a_fixed_objective_reports_it(world, tmp_path):
    cfg = online_config()
    cfg.trainer.objective = "target_rollout"
    trainer = OnlineTrainer(cfg, **setup_run(world, tmp_path))
    trainer.poll()
    assert trainer.schedule is None and trainer.step()["objective"] == "target_rollout"
    stats = trainer.stats()
    assert stats["objective"] == "target_rollout" and stats["first_position_acceptance"] is None
