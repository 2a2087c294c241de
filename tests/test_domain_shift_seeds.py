"""benchmarks/domain_shift_seeds.py: the held-out tau each arm ends on, over seeds, from domain_shift.json
files (hand-made here, in the layout benchmarks/domain_shift.py writes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import domain_shift_seeds  # noqa: E402


def run(seed: int, arms: dict[str, list[tuple[str, float]]], **settings) -> dict:
    """A domain_shift.json: per arm its (event, held-out tau) timeline after the static start."""
    base = {"command": "benchmarks/domain_shift.py --minutes 12", "seed": seed, "capture_features": True,
            "speculation": "auto", "held_out_prompts": 32, "max_tokens": 128, "static_tau": 1.4,
            "minutes_per_arm": 12.0, "steps_per_arm": 5000}
    base.update(settings)
    base["arms"] = [{"name": name, "objective": name, "trainer_steps": 100.0 + seed,
                     "keep_up": {"keep_up": 1.0 + seed / 10},
                     "timeline": [{"t": 0.0, "event": "promote", "tau_held_out": 1.4},
                                  *({"t": 60.0 * i, "event": e, "tau_held_out": t}
                                    for i, (e, t) in enumerate(events, 1))]}
                    for name, events in arms.items()]
    return base


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_arms_over_seeds_end_on_their_serving_version_with_paired_differences(tmp_path):
    paths = [write(tmp_path, "s0", run(0, {"auto": [("promote", 1.5)], "naive": [("promote", 1.45)]})),
             write(tmp_path, "s1a", run(1, {"auto": [("promote", 1.6), ("rollback", 1.55)]})),
             write(tmp_path, "s1b", run(1, {"naive": [("promote", 1.5)]})),
             write(tmp_path, "s2", run(2, {"auto": []}))]  # nothing promoted: the static drafter
    out = domain_shift_seeds.summarise(*domain_shift_seeds.collect(paths))
    auto = out["arms"]["auto"]
    assert auto["seeds"] == [0, 1, 2]
    assert [auto["per_seed"][s]["tau"] for s in (0, 1, 2)] == [1.5, 1.55, 1.4]  # a rollback's version serves
    assert [auto["per_seed"][s]["promotions"] for s in (0, 1, 2)] == [1, 1, 0]
    assert auto["tau"]["mean"] == pytest.approx(1.4833, abs=1e-4) and auto["tau"]["n"] == 3
    low, high = auto["tau"]["ci95"]
    assert low < 1.4833 < high and high - low == pytest.approx(2 * 4.3027 * 0.0764 / 3 ** 0.5, rel=1e-2)
    assert auto["ratio_to_static"]["mean"] == pytest.approx(1.4833 / 1.4, abs=1e-4)
    assert auto["keep_up"]["mean"] == pytest.approx(1.1)
    pair = out["paired"]["auto - naive"]
    assert pair["seeds"] == [0, 1] and pair["diff"]["mean"] == pytest.approx(0.05)
    assert pair["diff"]["ci95"] == [0.05, 0.05]  # the same difference at both seeds


def test_runs_that_differ_in_a_setting_or_repeat_an_arm_are_refused(tmp_path):
    first = write(tmp_path, "a", run(0, {"auto": [("promote", 1.5)]}))
    other = write(tmp_path, "b", run(1, {"auto": [("promote", 1.5)]}, speculation="always"))
    with pytest.raises(SystemExit, match="speculation"):
        domain_shift_seeds.collect([first, other])
    older = run(1, {"auto": []}, command="benchmarks/domain_shift.py --minutes 30")
    del older["minutes_per_arm"]  # runs before the field: minutes from the command
    with pytest.raises(SystemExit, match="minutes_per_arm"):
        domain_shift_seeds.collect([first, write(tmp_path, "c", older)])
    with pytest.raises(SystemExit, match="twice"):
        domain_shift_seeds.collect([first, write(tmp_path, "d", run(0, {"auto": []}))])
    rotating = write(tmp_path, "r", run(1, {"auto": []}, traffic="humaneval-train-rotating-16"))
    with pytest.raises(SystemExit, match="humaneval-train-first-16"):  # runs without the field: the old traffic
        domain_shift_seeds.collect([first, rotating])
    later = write(tmp_path, "e", run(1, {"auto": [("promote", 1.5)]}, commit="c1", code_version="abc"))
    with pytest.raises(SystemExit, match="allow-mixed-commits"):
        domain_shift_seeds.collect([first, later])
    shared, arms = domain_shift_seeds.collect([first, later], allow_mixed_commits=True)
    assert shared["code"] == ["abc", "unknown"] and arms["auto"][1]["code"] == "abc"
    same_code = write(tmp_path, "f", run(2, {"auto": []}, commit="c2", code_version="abc"))
    shared, arms = domain_shift_seeds.collect([later, same_code])  # commits differ, the code does not
    assert shared["code"] == ["abc"] and sorted(arms["auto"]) == [1, 2]
    # --by-code: the same arm on two code versions is two arms, paired seed by seed
    old_code = write(tmp_path, "g", run(1, {"auto": [("promote", 1.45)]}, commit="c0", code_version="old"))
    out = domain_shift_seeds.summarise(*domain_shift_seeds.collect([later, old_code], by_code=True))
    assert sorted(out["arms"]) == ["auto@abc", "auto@old"]
    assert out["paired"]["auto@abc - auto@old"]["diff"]["mean"] == pytest.approx(0.05)
    with pytest.raises(SystemExit, match="auto@abc at seed 1 appears twice"):
        domain_shift_seeds.collect([later, later], by_code=True)
    # --same-code: a code version read as another joins its arm; each seed keeps the code it recorded
    other_seed = write(tmp_path, "h", run(2, {"auto": [("promote", 1.5)]}, commit="c3", code_version="old2"))
    out = domain_shift_seeds.summarise(*domain_shift_seeds.collect([later, old_code, other_seed], by_code=True,
                                                                   same_code={"old2": "old"}))
    assert sorted(out["arms"]) == ["auto@abc", "auto@old"]
    _, arms = domain_shift_seeds.collect([old_code, other_seed], same_code={"old2": "old"})
    assert sorted(arms["auto"]) == [1, 2] and arms["auto"][2]["code"] == "old2"
    with pytest.raises(SystemExit, match="no runs"):
        domain_shift_seeds.collect([])


def test_runs_with_other_overrides_are_other_arms_with_by_set(tmp_path):
    plain = [write(tmp_path, f"p{s}", run(s, {"auto": [("promote", 1.5 + s / 100)]})) for s in (1, 2)]
    widened = [write(tmp_path, f"w{s}", run(s, {"auto": [("promote", 1.6 + s / 100)]},
                                            set=["trainer.widen_share=1.0"])) for s in (1, 2)]
    with pytest.raises(SystemExit, match="set"):  # without --by-set: not comparable
        domain_shift_seeds.collect([*plain, *widened])
    shared, arms = domain_shift_seeds.collect([*plain, *widened], by_set=True)
    assert shared["set"] == [[], ["trainer.widen_share=1.0"]]
    assert sorted(arms) == ["auto", "auto+trainer.widen_share=1.0"]
    out = domain_shift_seeds.summarise(shared, arms)
    pair = out["paired"]["auto - auto+trainer.widen_share=1.0"]
    assert pair["seeds"] == [1, 2] and pair["diff"]["mean"] == pytest.approx(-0.1)
    with pytest.raises(SystemExit, match="speculation"):  # the other settings must still match
        domain_shift_seeds.collect([*plain, write(tmp_path, "x", run(3, {"auto": []}, speculation="always",
                                                                     set=["a=1"]))], by_set=True)


def with_steps(data: dict, steps: dict[str, tuple[float, list[int]]]) -> dict:
    """`data` with each arm's final trainer steps and its timeline points' version steps (after the static)."""
    for arm in data["arms"]:
        final, version_steps = steps[arm["name"]]
        arm["trainer_steps"] = final
        for point, step in zip(arm["timeline"][1:], version_steps, strict=True):
            point["step"] = step
    return data


def test_pairs_at_equal_trainer_steps_use_the_versions_each_arm_had_by_the_fewer_steps(tmp_path):
    # seed 0: lk ran 300 steps (promoted at 50, 200, 280), naive 150 (promoted at 50, 125): at 150 steps
    # lk had its step-50 version (1.45), naive its step-125 one (1.48)
    s0 = with_steps(run(0, {"lk": [("promote", 1.45), ("promote", 1.55), ("promote", 1.6)],
                            "naive": [("promote", 1.42), ("promote", 1.48)]}),
                    {"lk": (300, [50, 200, 280]), "naive": (150, [50, 125])})
    # seed 1: a rollback to the step-25 version; naive promoted nothing: the static drafter at step 0
    s1 = with_steps(run(1, {"lk": [("promote", 1.5), ("promote", 1.44), ("rollback", 1.5)], "naive": []}),
                    {"lk": (90, [25, 75, 25]), "naive": (120, [])})
    out = domain_shift_seeds.summarise(*domain_shift_seeds.collect([write(tmp_path, "s0", s0),
                                                                    write(tmp_path, "s1", s1)]))
    pair = out["paired"]["lk - naive"]
    assert pair["diff"]["mean"] == pytest.approx(((1.6 - 1.48) + (1.5 - 1.4)) / 2)  # the final versions
    equal = pair["equal_steps"]
    assert equal["seeds"] == [0, 1] and equal["steps"] == [150, 90]
    assert equal["taus"] == [[1.45, 1.48], [1.5, 1.4]]
    assert equal["diff"]["mean"] == pytest.approx(((1.45 - 1.48) + (1.5 - 1.4)) / 2)
    assert equal["ratio"]["mean"] == pytest.approx((1.45 / 1.48 + 1.5 / 1.4) / 2, abs=1e-4)


def test_version_steps_come_from_the_registry_for_runs_without_them_and_unknown_steps_drop_the_seed(tmp_path):
    data = run(0, {"lk": [("promote", 1.5)], "naive": [("promote", 1.45)]})
    for arm, step in zip(data["arms"], (40, 60), strict=True):
        arm["run_dir"] = str(tmp_path / arm["name"])
        arm["timeline"][1]["version"] = "v0002"
        manifest = tmp_path / arm["name"] / "registry" / "versions" / "v0002" / "manifest.json"
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"version": "v0002", "step": step}))
    paths = [write(tmp_path, "s0", data)]
    equal = domain_shift_seeds.summarise(*domain_shift_seeds.collect(paths))["paired"]["lk - naive"]["equal_steps"]
    assert equal["steps"] == [100.0] and equal["taus"] == [[1.5, 1.45]]  # trainer_steps 100 + seed, both arms
    (tmp_path / "naive" / "registry" / "versions" / "v0002" / "manifest.json").unlink()  # folder gone
    assert domain_shift_seeds.summarise(*domain_shift_seeds.collect(paths))["paired"]["lk - naive"]["equal_steps"] is None
