"""benchmarks/objective_sweep.py: settings of one objectives.py arm compared seed by seed (hand-made
objectives.py results here, in the layout it writes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import objective_sweep  # noqa: E402


def result(arm: str, taus: dict[int, float], rates: list[float]) -> dict:
    """objectives.py's JSON for `--arms <arm>`: per seed the arm's held-out tau and per-position rates."""
    return {"per_seed": {str(s): {arm: {"tau": t, "acceptance_rate_per_position": rates}} for s, t in taus.items()}}


def test_summarise_pairs_each_setting_with_the_first_by_seed_for_the_named_arm():
    results = {"lr3e-4": result("lk", {0: 1.50, 1: 1.48, 2: 1.52}, [0.4, 0.1]),
               "lr1e-3": result("lk", {0: 1.53, 1: 1.50, 2: 1.53}, [0.5, 0.2])}
    settings = {"lr3e-4": [], "lr1e-3": ["trainer.lr=1e-3"]}
    summary = objective_sweep.summarise(results, settings, [0, 1, 2], arm="lk")
    assert summary["lr3e-4"]["tau"]["mean"] == pytest.approx(1.5)
    assert "paired_diff_vs_lr3e-4" not in summary["lr3e-4"]
    diff = summary["lr1e-3"]["paired_diff_vs_lr3e-4"]
    assert diff["mean"] == pytest.approx((0.03 + 0.02 + 0.01) / 3, abs=1e-4)
    assert diff["ci95"][0] < diff["mean"] < diff["ci95"][1] and diff["n"] == 3
    assert summary["lr1e-3"]["overrides"] == ["trainer.lr=1e-3"]
    assert summary["lr1e-3"]["acceptance_rate_per_position"] == [0.5, 0.2]


def test_summarise_reads_only_the_named_arm():
    results = {"a": result("draft_opd", {0: 1.4, 1: 1.5}, [0.3]), "b": result("draft_opd", {0: 1.5, 1: 1.5}, [0.3])}
    with pytest.raises(KeyError, match="lk"):
        objective_sweep.summarise(results, {"a": [], "b": []}, [0, 1], arm="lk")
    assert objective_sweep.summarise(results, {"a": [], "b": []}, [0, 1])["b"]["paired_diff_vs_a"]["mean"] == 0.05


def test_parse_setting():
    assert objective_sweep.parse_setting("lr1e-3=trainer.lr=1e-3,trainer.gamma=1") == (
        "lr1e-3", ["trainer.lr=1e-3", "trainer.gamma=1"])
    assert objective_sweep.parse_setting("default=") == ("default", [])


def test_objectives_refuses_a_cache_made_with_other_data_settings(tmp_path, caplog):
    """objectives.py caches rollouts under --out; a run with other data settings (here
    data.num_prompts) stops with both settings named instead of silently reusing them."""
    import objectives  # noqa: PLC0415 (heavy: the serving pipeline)

    from online_opd.config import apply_overrides, load_config  # noqa: PLC0415

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    folder = tmp_path / "train"
    objectives.checked_cache(folder, cfg, Path("model"), "train")
    stamp = (folder / objectives.CACHE_STAMP).read_text()
    objectives.checked_cache(folder, cfg, Path("model"), "train")  # the same settings: reused
    with pytest.raises(SystemExit, match="'num_prompts': 32"):
        objectives.checked_cache(folder, apply_overrides(cfg, ["data.num_prompts=32"]), Path("model"), "train")
    assert (folder / objectives.CACHE_STAMP).read_text() == stamp
    legacy = tmp_path / "old"
    legacy.mkdir()
    (legacy / "sequences.safetensors").write_bytes(b"")
    objectives.checked_cache(legacy, cfg, Path("model"), "train")
    assert "without data.json" in caplog.text and not (legacy / objectives.CACHE_STAMP).exists()


def test_the_greedy_cache_ignores_the_sampling_settings_and_the_sampled_cache_does_not(tmp_path):
    """Sampled rollouts (data.rollout_samples) are cached apart from the greedy ones: a greedy cache is
    shared by runs with and without samples, a sampled cache refuses other sampling settings."""
    import objectives  # noqa: PLC0415 (heavy: the serving pipeline)

    from online_opd.config import apply_overrides, load_config  # noqa: PLC0415

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    sampled_cfg = apply_overrides(cfg, ["data.rollout_samples=3"])
    objectives.checked_cache(tmp_path / "train", cfg, Path("model"), "train")
    objectives.checked_cache(tmp_path / "train", sampled_cfg, Path("model"), "train")  # the same greedy rollouts
    objectives.checked_cache(tmp_path / "sampled", sampled_cfg, Path("model"), "sampled")
    with pytest.raises(SystemExit, match="'rollout_temperature': 1.0"):
        objectives.checked_cache(tmp_path / "sampled", apply_overrides(sampled_cfg, ["data.rollout_temperature=1.0"]),
                                 Path("model"), "sampled")
