"""The source a benchmark ran on, for results that are compared across runs (domain_shift.py's seeds)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("online_opd", "vllm_patches", "serve", "configs")  # what the servers and trainers run


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def source_commit() -> str | None:
    """HEAD's commit, with "+dirty" when the code under CODE differs from it; None outside a git checkout."""
    try:
        head, dirty = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--", *CODE)
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def code_version() -> str | None:
    """An id of the code under CODE at HEAD (the same for two commits that changed only benchmarks, tests or
    docs), with "+dirty" when the working tree differs from it; None outside a git checkout."""
    try:
        trees, dirty = _git("ls-tree", "HEAD", "--", *CODE), _git("status", "--porcelain", "--", *CODE)
    except (OSError, subprocess.SubprocessError):
        return None
    return hashlib.sha1(trees.encode()).hexdigest()[:12] + ("+dirty" if dirty else "")


def print_result(result: dict, json_out: Path | None = None) -> None:
    """Print ``result`` as indented JSON on stdout, and with ``json_out`` also write it there (folders made)."""
    text = json.dumps(result, indent=2)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
    print(text)
