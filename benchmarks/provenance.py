"""The source a benchmark ran on, for results that are compared across runs (domain_shift.py's seeds)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("online_opd", "vllm_patches", "serve", "configs")  # what the servers and trainers run


def source_commit() -> str | None:
    """HEAD's commit, with "+dirty" when the code under CODE differs from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *CODE], cwd=ROOT, capture_output=True,
                               text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")
