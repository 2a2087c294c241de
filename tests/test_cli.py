"""The `online-opd` command line: help, config, clear errors, and (slow) the
offline pipeline end to end on the real vLLM CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("setup", "config", "bootstrap", "rollout", "train", "eval"):
        assert command in out


def test_config_show_applies_overrides(capsys):
    assert main(["config", "show", "-c", str(ROOT / "configs/default.yaml"), "trainer.lr=1e-4",
                 "drafter.block_size=4"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["lr"] == 1e-4 and shown["drafter"]["block_size"] == 4
    assert shown["bootstrap"]["objective"] == "sft"


def test_unknown_key_is_named(caplog):
    assert main(["config", "show", "trainer.lrr=1"]) == 2
    assert "trainer.lrr" in caplog.text


def test_train_without_records_is_a_clear_error(tmp_path, caplog):
    rc = main(["train", "--records", str(tmp_path / "none"), "--init", str(tmp_path)])
    assert rc == 2
    assert "no *.jsonl record files" in caplog.text


def test_every_subcommand_has_help():
    parser = build_parser()
    actions = [a for a in parser._actions if a.dest == "command"][0]
    for name, sub in actions.choices.items():
        assert sub.format_help(), name


def _cli(*args: str, cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_offline_pipeline_end_to_end(tmp_path):
    """bootstrap -> rollout -> train (Draft-OPD) -> eval, on the tiny CI config."""
    cfg = ["-c", str(ROOT / "configs/test-tiny.yaml")]
    boot = _cli("bootstrap", *cfg, "--run-dir", str(tmp_path / "boot"), cwd=ROOT)
    drafter = Path(boot["drafter"])
    assert (drafter / "config.json").exists() and (drafter / "manifest.json").exists()
    rollout = _cli("rollout", *cfg, "--drafter", str(drafter), "--out", str(tmp_path / "rec"), cwd=ROOT)
    assert rollout["num_records"] > 0 and rollout["num_blocks"] > 0
    trained = _cli("train", *cfg, "--records", str(tmp_path / "rec"), "--init", str(drafter),
                   "--run-dir", str(tmp_path / "opd"), cwd=ROOT)
    manifest = json.loads((Path(trained["drafter"]) / "manifest.json").read_text())
    assert manifest["parent_version"] == "drafter" and manifest["step"] == 4
    result = _cli("eval", *cfg, "--drafter", trained["drafter"], "--out", str(tmp_path / "eval.json"),
                  "eval.max_num_seqs=[4]", cwd=ROOT)
    assert result["num_drafts"] > 0 and result["acceptance_length"] >= 1.0
    assert result["identical_outputs"] == f"{result['num_prompts']}/{result['num_prompts']}"
    assert set(result["speedup"]) == {"concurrency_4"}
