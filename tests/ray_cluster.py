"""A real Ray cluster for tests, as a user starts one: `ray start --head --block` (and `ray start
--address --block` for more raylets) each in its own session, stopped with its whole process group
(--block: ray start stops what it started)."""

from __future__ import annotations

import json
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
def ray_head(env: dict[str, str], num_cpus: int = 2, resources: dict[str, float] | None = None) -> Iterator[str]:
    """Yields the head's address (127.0.0.1:port). Ray's files go to a short temp folder (its socket
    paths have a length limit)."""
    work = Path(tempfile.mkdtemp(prefix="rhead", dir="/tmp"))
    port = free_port()
    with _raylet(["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={work}"], env,
                 num_cpus, resources):
        yield f"127.0.0.1:{port}"


@contextmanager
def ray_node(env: dict[str, str], address: str, num_cpus: int = 1,
             resources: dict[str, float] | None = None) -> Iterator[None]:
    """A second raylet on this machine joining the head at `address`, as `ray start --address` on
    another node would."""
    with _raylet([f"--address={address}"], env, num_cpus, resources):
        yield


@contextmanager
def _raylet(args: list[str], env: dict[str, str], num_cpus: int,
            resources: dict[str, float] | None) -> Iterator[None]:
    """`ray start --block ARGS` in its own session, stopped with its whole process group."""
    extra = [f"--resources={json.dumps(resources)}"] if resources else []
    node = subprocess.Popen(
        [str(RAY), "start", "--block", *args, f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1",
         "--disable-usage-stats", *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
