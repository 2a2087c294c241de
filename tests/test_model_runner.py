"""The model-runner choice (vllm_patches/model_runner.py): online-opd serve runs vLLM's V1 model
runner, which capture and hot reload hook, and refuses Model Runner V2 with a message that names
the fix. vLLM's own VllmConfig decides; on this CPU (no Triton) it picks V1 unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patches.model_runner import V2_ENV, ModelRunnerV2Unsupported, check_v1_runner, v1_runner_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("environ, expected", [
    ({}, {V2_ENV: "0"}),
    ({V2_ENV: ""}, {V2_ENV: "0"}),
    ({V2_ENV: "0"}, {V2_ENV: "0"}),
    ({V2_ENV: " 0 "}, {V2_ENV: "0"}),
    ({"OTHER": "1"}, {V2_ENV: "0"}),
])
def test_v1_is_chosen_unless_v2_was_asked_for(environ, expected):
    assert v1_runner_env(environ) == expected


@pytest.mark.parametrize("raw, says", [("1", "asks vLLM for Model Runner V2"), ("2", "asks vLLM"),
                                       ("true", "is not an integer")])
def test_asking_for_v2_is_refused_with_the_fix(raw, says):
    with pytest.raises(ModelRunnerV2Unsupported) as info:
        v1_runner_env({V2_ENV: raw})
    assert says in str(info.value) and "set it to 0" in str(info.value)


def test_the_engine_config_check_follows_vllms_own_choice(monkeypatch):
    from vllm.config import VllmConfig

    config = VllmConfig()
    monkeypatch.delenv(V2_ENV, raising=False)
    assert config.use_v2_model_runner is False  # no Triton on this CPU: V1
    check_v1_runner(config)
    monkeypatch.setenv(V2_ENV, "0")
    check_v1_runner(config)
    monkeypatch.setenv(V2_ENV, "1")  # what watermarking or HiSparse would force whatever the variable says
    assert config.use_v2_model_runner is True
    with pytest.raises(ModelRunnerV2Unsupported, match="vLLM chose Model Runner V2"):
        check_v1_runner(config)


def test_serve_refuses_v2_before_any_set_up(tmp_path):
    env = {**os.environ, V2_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", "serve", "-c",
                           str(ROOT / "configs/test-tiny.yaml"), f"serve.run_dir={tmp_path / 'serve'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"{V2_ENV}=1 asks vLLM for Model Runner V2" in done.stderr
    assert not (tmp_path / "serve").exists()  # refused before the registry or drafter were touched


def test_serve_env_runs_the_v1_runner(tmp_path, monkeypatch):
    from online_opd.config import load_config
    from serve.server import serve_env

    monkeypatch.delenv(V2_ENV, raising=False)
    env = serve_env(load_config(None, []), Path("/models/t"), tmp_path, capture=False)
    assert env[V2_ENV] == "0"
