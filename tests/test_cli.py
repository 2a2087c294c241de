"""The `online-opd` command line: help, config, clear errors, and (slow) the
offline pipeline end to end on the real vLLM CPU engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from online_opd.config import load_config
from serve.cli import main

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


def test_each_subcommand_dispatches_to_its_own_runner(monkeypatch):
    from serve import buffer_cli, drafters_cli, loadgen, report, scrape, server

    seen = []
    for name, module in {"buffer": buffer_cli, "drafters": drafters_cli, "loadgen": loadgen,
                         "report": report, "scrape": scrape}.items():
        monkeypatch.setattr(module, "run", lambda args, name=name: seen.append((name, args.command)) or 7)
    argv = {"buffer": ["buffer", "stats", "/nowhere"], "drafters": ["drafters", "list"],
            "loadgen": ["loadgen"], "report": ["report", "--out", "/x.png"], "scrape": ["scrape", "--out", "/x"]}
    for name, args in argv.items():
        assert main(args) == 7, name
    assert seen == [(name, name) for name in argv]
    monkeypatch.setattr(server, "serve", lambda cfg, **kw: seen.append(("serve", kw["passthrough"])) or 0)
    assert main(["serve", "--dry-run", "--max-num-seqs", "64"]) == 0
    assert seen[-1] == ("serve", ["--max-num-seqs", "64"])  # unknown flags go to `vllm serve`


def test_unknown_flags_are_refused_outside_serve(caplog):
    assert main(["config", "show", "--enforce-eager"]) == 2
    assert "unrecognized arguments: --enforce-eager" in caplog.text


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_real_command_prints_results_on_stdout_and_names_bad_values_on_stderr(tmp_path):
    tiny = ROOT / "configs/test-tiny.yaml"
    shown = _run("config", "show", "-c", str(tiny), "drafter.block_size=2")
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "shown.yaml").write_text(shown.stdout)
    assert load_config(tmp_path / "shown.yaml") == load_config(tiny, ["drafter.block_size=2"])

    refused = _run("config", "show", "drafter.block_size=64")
    assert (refused.returncode, refused.stdout) == (2, "")
    assert "drafter.block_size: Input should be less than or equal to 32 (got 64)" in refused.stderr

    env = {k: v for k, v in os.environ.items() if k != "ONLINE_OPD_ADMIN_TOKEN"}
    no_token = _run("reload", str(tmp_path), env=env)
    assert (no_token.returncode, no_token.stdout) == (2, "")
    assert "set ONLINE_OPD_ADMIN_TOKEN to the server's admin token" in no_token.stderr


def _cli(*args: str, cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_offline_pipeline_end_to_end(trained_run, tmp_path):
    """bootstrap -> rollout -> train (Draft-OPD) -> eval, on the tiny CI config. The bootstrap is the
    session's `trained_run`: `online-opd bootstrap` run as a command (tests/serving.py), whose drafter
    has the tiny config's architecture (DFlash, one layer, block 4)."""
    cfg = ["-c", str(ROOT / "configs/test-tiny.yaml")]
    drafter = trained_run / "drafter"
    assert (drafter / "config.json").exists() and (drafter / "manifest.json").exists()
    rollout = _cli("rollout", *cfg, "--drafter", str(drafter), "--out", str(tmp_path / "rec"), cwd=ROOT)
    assert rollout["num_records"] > 0 and rollout["num_blocks"] > 0
    trained = _cli("train", *cfg, "--records", str(tmp_path / "rec"), "--init", str(drafter),
                   "--run-dir", str(tmp_path / "opd"), cwd=ROOT)
    manifest = json.loads((Path(trained["drafter"]) / "manifest.json").read_text())
    assert manifest["parent_version"] == "drafter" and manifest["step"] == 4
    result = _cli("eval", *cfg, "--drafter", trained["drafter"], "--out", str(tmp_path / "eval.json"),
                  "--record", "eval.max_num_seqs=[4]", cwd=ROOT)
    drafts, accepted, rates = result["num_drafts"], result["num_accepted_tokens"], \
        result["acceptance_rate_per_position"]
    assert drafts > 0 and result["num_speculative_tokens"] == len(rates) == 4  # the drafter's block size
    assert result["acceptance_length"] == round(1 + accepted / drafts, 4)  # tau from vLLM's counters
    assert rates == sorted(rates, reverse=True)  # position k is accepted only after position k - 1
    assert sum(round(rate * drafts) for rate in rates) == accepted
    assert result["identical_outputs"] == f"{result['num_prompts']}/{result['num_prompts']}"
    assert result["speculative"]["concurrency_4"]["output_tokens"] == \
        result["baseline"]["concurrency_4"]["output_tokens"]
    assert set(result["speedup"]) == {"concurrency_4"}
    ngram = result["ngram"]  # vLLM's prompt-lookup speculation, same prompts, same block size
    assert ngram["speculative_config"]["method"] == "ngram" and ngram["speculative_config"]["num_speculative_tokens"] == 4
    drafts = ngram["num_drafts"]  # 0 when no prompt n-gram ever matched: then tau is 1
    assert ngram["acceptance_length"] == (round(1 + ngram["num_accepted_tokens"] / drafts, 4) if drafts else 1.0)
    assert ngram["identical_outputs"] == result["identical_outputs"]  # lossless at T=0
    assert ngram["concurrency_4"]["output_tokens"] == result["baseline"]["concurrency_4"]["output_tokens"]
    assert set(ngram["speedup"]) == {"concurrency_4"}
    # --record: the drafter's served acceptance in its manifest, the checkpoint still verifies
    from online_opd.models.drafters.checkpoint import verify_checkpoint

    recorded = verify_checkpoint(trained["drafter"])["metrics"]["eval"]
    assert recorded == result["recorded"] and recorded["num_drafts"] == result["num_drafts"]
    assert recorded["acceptance_rate_per_position"] == rates and recorded["tau"] == result["acceptance_length"]
    assert recorded["prompts"] == "sharegpt" and recorded["temperature"] == 0 and recorded["num_speculative_tokens"] == 4
    assert manifest["metrics"].items() <= verify_checkpoint(trained["drafter"])["metrics"].items()
