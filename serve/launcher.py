"""Run `online-opd serve` as a child process: for benchmarks, tests and scripts.

`ServerProcess` starts the server in its own process group, waits for
/health, scrapes /metrics into a flat dict, calls the admin routes, and stops
it with SIGTERM (vLLM's graceful shutdown), SIGKILL only after a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from online_opd.traces.records import acceptance_length
from serve.scrape import parse_metrics

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`online-opd serve` in its own process group; stopped with SIGTERM (graceful)."""

    def __init__(self, run_dir: Path, config: Path, *args: str, token: str | None = None,
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.buffer = run_dir / "buffer"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "server.log", "w")
        self.token = token
        cmd = [sys.executable, "-m", "serve.cli", "--no-progress", "serve", "-c", str(config),
               "-o", f"serve.port={self.port}", "-o", f"serve.run_dir={run_dir}",
               "-o", f"capture.buffer_dir={self.buffer}", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **({"ONLINE_OPD_ADMIN_TOKEN": token} if token else {}),
                                          **(env or {})},
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 8000) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.run_dir / "server.log").read_text()[-n:]

    def stop(self, stop_timeout: float = 150.0) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {name{labels}: value}, flattened by ``scrape.parse_metrics``."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, f"{self.url}/online-opd/v1{path}", timeout=120,
                             headers={"Authorization": f"Bearer {self.token}"}, **kwargs)


class PlainVllmServer(ServerProcess):
    """`vllm serve TARGET` with no online-opd plugin loaded: the baseline of the speed benchmarks.

    `runtime_env` carries the CPU runtime settings (serve/cpu_runtime.py) the online-opd server gets,
    so that the comparison is against plain vLLM at its fastest, never a slowed-down one. `args` adds
    vLLM flags (`--speculative-config` for vLLM's own ngram speculation)."""

    def __init__(self, run_dir: Path, target: Path, *args: str, dtype: str = "float32",
                 max_model_len: int = 2048, max_num_seqs: int = 32, runtime_env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.token = None
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "server.log", "w")
        argv = ["serve", str(target), "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--served-model-name", target.name, "--enforce-eager",
                "--max-num-seqs", str(max_num_seqs), *args]
        code = f"from serve.server import run_vllm_serve; run_vllm_serve({argv!r})"
        env = {**os.environ, "VLLM_PLUGINS": "", **(runtime_env or {})}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)


def benchmark_logging() -> None:
    """A benchmark's logs: INFO on stderr (stdout carries its JSON), the HTTP clients' request lines off."""
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)


def emit_result(result: dict, out: Path | None) -> None:
    """A benchmark's JSON result on stdout, and also in `out` when given."""
    text = json.dumps(result, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text, flush=True)


def tau(before: dict[str, float], after: dict[str, float]) -> tuple[float, int]:
    """Served acceptance length between two scrapes, from vLLM's own counters."""
    drafts = after["vllm:spec_decode_num_drafts_total"] - before["vllm:spec_decode_num_drafts_total"]
    accepted = (after["vllm:spec_decode_num_accepted_tokens_total"]
                - before["vllm:spec_decode_num_accepted_tokens_total"])
    served = acceptance_length(accepted, drafts)
    return (1.0 if served is None else served), int(drafts)
