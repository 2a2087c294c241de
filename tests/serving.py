"""Helpers for the serving tests: the memorising drafter and a server fixture.

`bootstrap` runs `online-opd bootstrap -c configs/test-serve.yaml` once per
test session: six ShareGPT rollouts memorised by a one-layer DFlash drafter, so
requests on those prompts accept whole and partial blocks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serve.launcher import ServerProcess, tau

__all__ = ["Server", "tau", "bootstrap", "CONFIG", "TOKEN"]

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


class Server(ServerProcess):
    """`online-opd serve -c configs/test-serve.yaml` with the test admin token."""

    def __init__(self, run_dir: Path, *args: str, env: dict | None = None):
        super().__init__(run_dir, CONFIG, *args, token=TOKEN, env=env)
