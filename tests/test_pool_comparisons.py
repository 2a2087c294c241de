"""benchmarks/pool_comparisons.py: one paired comparison pooled over several domain_shift_seeds.py summaries
(hand-made here, in the layout domain_shift_seeds.py writes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pool_comparisons  # noqa: E402


def summary(taus: dict[str, dict[str, float]], minutes: float) -> dict:
    """A domain_shift_seeds summary: per arm, per seed (JSON keys are strings), the final held-out tau."""
    return {"settings": {"minutes_per_arm": minutes},
            "arms": {arm: {"per_seed": {s: {"tau": t, "steps": 100.0} for s, t in by_seed.items()}}
                     for arm, by_seed in taus.items()}}


def test_ratios_of_every_summary_s_common_seeds_pool_into_one_interval(tmp_path, capsys):
    short = summary({"auto": {"1": 1.5, "2": 1.4, "3": 1.6}, "naive": {"1": 1.5, "2": 1.6, "3": 1.5}}, 12)
    long = summary({"auto": {"1": 1.8, "2": 1.7}, "naive": {"1": 1.7, "2": 1.7, "9": 2.0}}, 30)
    out = pool_comparisons.pool({"short": short, "long": long}, "auto", "naive", against=1.05)
    expected = [1.0, 1.4 / 1.6, 1.6 / 1.5, 1.8 / 1.7, 1.0]  # seed 9: naive only, left out
    assert out["ratio"]["n"] == 5 and out["ratio"]["mean"] == pytest.approx(sum(expected) / 5, abs=1e-4)
    low, high = out["ratio"]["ci95"]
    assert low < out["ratio"]["mean"] < high
    assert out["comparisons"]["long"]["ratio_per_seed"] == {"1": round(1.8 / 1.7, 4), "2": 1.0}
    assert out["comparisons"]["short"]["settings"] == {"minutes_per_arm": 12}
    assert out["against"]["ratio"] == 1.05 and out["against"]["t"] < 0 and 0 < out["against"]["p"] < 1
    paths = []
    for name, data in (("short", short), ("long", long)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    assert pool_comparisons.main([*map(str, paths), "--json-out", str(tmp_path / "out" / "pooled.json")]) == 0
    written = json.loads((tmp_path / "out" / "pooled.json").read_text())
    assert written == json.loads(capsys.readouterr().out)
    assert written["ratio"] == out["ratio"] and "against" not in written


def test_a_missing_arm_or_no_common_seed_is_named(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(summary({"auto": {"1": 1.5}, "naive": {"2": 1.5}}, 30)))
    with pytest.raises(SystemExit) as exc:
        pool_comparisons.main([str(path)])
    assert exc.value.code == 2 and f"{path}: arms auto and naive share no seed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        pool_comparisons.main([str(path), "--arms", "auto", "lk"])
    assert exc.value.code == 2 and "['lk'] not in this summary" in capsys.readouterr().err
