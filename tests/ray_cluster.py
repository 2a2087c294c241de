"""A real Ray head for tests, as a user starts one: `ray start --head --block` in its own session,
stopped with its whole process group (--block: ray start stops what it started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 2) -> Iterator[str]:
    """Yields the head's address (127.0.0.1:port). Ray's files go to a short temp folder (its socket
    paths have a length limit)."""
    work = Path(tempfile.mkdtemp(prefix="rhead", dir="/tmp"))
    port = free_port()
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={work}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
