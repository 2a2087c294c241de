"""Joining an existing Ray cluster (`online-opd serve --ray-address host:port`) with Ray 2.60's token
authentication on. Any earlier local `ray.init()` (online-opd serve's own local Ray, for one) saves a
token in ~/.ray/auth_token; `ray start --head` then runs with token authentication, but ray.init
turns token mode on by itself only for address None/"auto" (serve/trainer_actor.join_auth_env)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from serve.trainer_actor import join_auth_env
from tests.ray_cluster import RAY, ray_head

ROOT = Path(__file__).resolve().parents[1]


def test_token_mode_is_turned_on_only_for_an_explicit_address_with_a_token(tmp_path):
    home = tmp_path / "home"
    assert join_auth_env("10.0.0.1:6379", {}, home) == {}  # no token anywhere: leave Ray's default
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("t" * 32)
    assert join_auth_env("10.0.0.1:6379", {}, home) == {"RAY_AUTH_MODE": "token"}
    assert join_auth_env(None, {}, home) == {}  # a new local cluster: Ray decides
    assert join_auth_env("auto", {}, home) == {}  # Ray already does it for "auto"
    assert join_auth_env("10.0.0.1:6379", {"RAY_AUTH_MODE": "disabled"}, home) == {}  # the user's choice wins
    empty = tmp_path / "empty"
    assert join_auth_env("h:1", {"RAY_AUTH_TOKEN": "abc"}, empty) == {"RAY_AUTH_MODE": "token"}
    assert join_auth_env("h:1", {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}, home) == {}
    (tmp_path / "tok").write_text("x" * 32)
    assert join_auth_env("h:1", {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}, empty) == {"RAY_AUTH_MODE": "token"}


JOIN = """
import sys, ray
from online_opd.config import load_config
from serve.trainer_actor import init_ray
address = sys.argv[1]
if sys.argv[2] == "online-opd":
    init_ray(load_config(None, [f"online.ray_address={address}"]).online)
else:
    ray.init(address=address, include_dashboard=False)
print("answer", ray.get(ray.remote(num_cpus=0)(lambda: 42).remote(), timeout=60))
"""


@pytest.mark.slow
def test_serve_joins_a_ray_head_started_with_token_authentication():
    work = Path(tempfile.mkdtemp(prefix="rjoin", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(work / "home")  # its own ~/.ray/auth_token
    token = work / "home" / ".ray" / "auth_token"
    # what a first local ray.init() leaves behind; `ray start --head` then turns authentication on
    subprocess.run([str(RAY), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=120)
    assert token.exists()
    with ray_head(env, num_cpus=1) as address:

        def join(how: str, timeout: float) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", JOIN, address, how], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=timeout)

        ours = None
        for _ in range(3):  # the head may still be coming up
            ours = join("online-opd", 120)
            if ours.returncode == 0:
                break
            time.sleep(3)
        assert ours.returncode == 0 and "answer 42" in ours.stdout, ours.stderr[-3000:]
        try:  # Ray's own behaviour that made the fix necessary; it retries for a while, then fails
            plain = join("plain", 90)
            assert plain.returncode != 0 and "Authentication token is missing or incorrect" in plain.stderr
        except subprocess.TimeoutExpired:
            pass  # still retrying: it did not connect either
