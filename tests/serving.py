"""Helpers for the serving tests: the memorising drafter and a server fixture.

`bootstrap` runs `online-opd bootstrap -c configs/test-serve.yaml` once per
test session: six ShareGPT rollouts memorised by a one-layer DFlash drafter, so
requests on those prompts accept whole and partial blocks.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from serve.launcher import ServerProcess, tau

__all__ = ["Server", "tau", "bootstrap", "CONFIG", "TOKEN", "memorised_rollouts", "random_drafter",
           "complete_ids", "running"]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "test-serve.yaml"
TOKEN = "test-admin-token"


def bootstrap(run_dir: Path) -> Path:
    """Train (once) the memorising drafter; returns its checkpoint folder."""
    drafter = run_dir / "drafter"
    if not (drafter / "manifest.json").exists():
        proc = subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", "bootstrap", "-c",
                               str(CONFIG), "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True,
                              text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-6000:]
    return drafter


def memorised_rollouts(run_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, non-speculative greedy output ids) of the prompts the drafter memorised."""
    from online_opd.train.sequences import load_sequences

    seqs = load_sequences(run_dir / "rollouts.safetensors")
    return [(s.tokens[: s.prompt_len].tolist(), s.tokens[s.prompt_len:].tolist()) for s in seqs]


def random_drafter(run_dir: Path):
    """The memorising drafter's architecture with random weights (seed 0): acceptance about 0."""
    import torch

    from online_opd.models.drafters.checkpoint import load_drafter

    drafter = load_drafter(run_dir / "drafter")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return drafter


def complete_ids(server: ServerProcess, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy completion of prompt ids through /v1/completions; the output token ids."""
    import httpx

    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True})
    reply.raise_for_status()
    return list(reply.json()["choices"][0]["token_ids"])


class Server(ServerProcess):
    """`online-opd serve -c configs/test-serve.yaml` with the test admin token."""

    def __init__(self, run_dir: Path, *args: str, env: dict | None = None):
        super().__init__(run_dir, CONFIG, *args, token=TOKEN, env=env)


@contextmanager
def running(run_dir: Path, *args: str, env: dict | None = None):
    """A ready ``Server``; stopped on exit, which must end it cleanly (exit 0, or SIGTERM's -15)."""
    srv = Server(run_dir, *args, env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0 or code == -15, srv.tail()
