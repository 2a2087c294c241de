"""`online-opd loadgen`: the command line of the load generator, and its public names.

`add_parser` adds the command, `config_from_args` turns its arguments into a `LoadConfig`, `run` prints
the summary JSON. The traffic itself (arrival models, opt-out rule, failures, Ctrl-C) is
serve/loadgen_runner.py; the settings serve/loadgen_config.py; results and their summary
serve/loadgen_stats.py. Their public names are re-exported here: import them from ``serve.loadgen``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from online_opd.data import SOURCES, SPLITS
from serve.loadgen_config import (
    CLOSED_LOOP_CONCURRENCY,
    DEFAULT_BASE_URL,
    OPEN_LOOP_MAX_IN_FLIGHT,
    LoadConfig,
)
from serve.loadgen_runner import completion_text, opts_out, run_load, select_prompts
from serve.loadgen_stats import RequestResult, summarize

__all__ = ["DEFAULT_BASE_URL", "LoadConfig", "RequestResult", "add_parser", "run", "run_load",
           "select_prompts", "summarize", "opts_out", "completion_text", "config_from_args"]


def _typed(kind: type, check: Any, requirement: str) -> Any:
    """An argparse type: parse with ``kind``, then ``check``; argparse reports ``requirement``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} {requirement}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return parse


_POSITIVE_INT = _typed(int, lambda v: v >= 1, ">= 1")
_POSITIVE_FLOAT = _typed(float, lambda v: math.isfinite(v) and v > 0, "> 0")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``loadgen`` command to ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "loadgen", help="send prompt traffic to an OpenAI-compatible server (openai client)",
        description="Send prompt traffic to an OpenAI-compatible server (e.g. `online-opd serve`) with the "
                    "openai client. Closed loop by default (--concurrency workers); --rate gives an open "
                    "loop of Poisson arrivals. Summary JSON on stdout; progress and logs on stderr.")
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=DEFAULT_BASE_URL, help="default: %(default)s")
    server.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, else EMPTY")
    server.add_argument("--model", default=None, help="default: the first id of GET <base-url>/models")
    server.add_argument("--timeout", type=_POSITIVE_FLOAT, default=600.0,
                        help="per-request timeout in seconds (default: %(default)s); no retries")

    data = p.add_argument_group("prompts")
    data.add_argument("--prompts", choices=SOURCES, default="sharegpt", help="default: %(default)s")
    data.add_argument("--split", choices=SPLITS, default="train", help="default: %(default)s")
    data.add_argument("--num-prompts", type=_POSITIVE_INT, default=256,
                      help="distinct prompts, cycled if more requests are sent (default: %(default)s)")
    data.add_argument("--seed", type=int, default=0,
                      help="prompt shuffle and Poisson arrivals (default: %(default)s)")

    request = p.add_argument_group("requests")
    endpoint = request.add_mutually_exclusive_group()
    endpoint.add_argument("--chat", dest="endpoint", action="store_const", const="chat",
                          help="/chat/completions, the prompt as a user message (default)")
    endpoint.add_argument("--completions", dest="endpoint", action="store_const", const="completions",
                          help="/completions with raw text; humaneval sends the bare function source")
    p.set_defaults(endpoint="chat")
    request.add_argument("--max-tokens", type=_POSITIVE_INT, default=128, help="default: %(default)s")
    request.add_argument("--temperature", type=_typed(float, lambda v: math.isfinite(v) and v >= 0, ">= 0"),
                         default=None, help="default: the server's")
    request.add_argument("--top-p", type=_typed(float, lambda v: 0 < v <= 1, "in (0, 1]"), default=None,
                         help="default: the server's")
    request.add_argument("--ignore-eos", action="store_true",
                         help="vLLM: always generate --max-tokens tokens (fixed-length load)")
    request.add_argument("--stream", action="store_true", help="stream responses; also measures TTFT")
    request.add_argument("--opt-out-fraction", type=_typed(float, lambda v: 0 <= v <= 1, "in [0, 1]"),
                         default=0.0, help="share of requests sent with vllm_xargs online_opd_capture=false, "
                                           "spread evenly (default: %(default)s)")

    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_POSITIVE_INT, default=None,
                      help=f"closed loop: workers (default {CLOSED_LOOP_CONCURRENCY}); with --rate: most "
                           f"requests in flight (default {OPEN_LOOP_MAX_IN_FLIGHT})")
    load.add_argument("--rate", type=_POSITIVE_FLOAT, default=None,
                      help="open loop: Poisson arrivals, requests/s")
    load.add_argument("--num-requests", type=_POSITIVE_INT, default=None,
                      help="stop after this many requests")
    load.add_argument("--duration", type=_POSITIVE_FLOAT, default=None,
                      help="stop issuing after this many seconds (in-flight requests finish); with "
                           "--num-requests, whichever comes first; with neither, each prompt once")
    load.add_argument("--out", type=Path, default=None, help="write one JSON line per request here")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of parsed ``loadgen`` arguments (ValueError on an invalid combination)."""
    return LoadConfig(
        base_url=args.base_url, api_key=args.api_key, model=args.model, prompts=args.prompts,
        split=args.split, num_prompts=args.num_prompts, seed=args.seed, endpoint=args.endpoint,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        ignore_eos=args.ignore_eos, stream=args.stream, concurrency=args.concurrency, rate=args.rate,
        duration=args.duration, num_requests=args.num_requests, opt_out_fraction=args.opt_out_fraction,
        timeout=args.timeout, out=args.out, progress=not getattr(args, "no_progress", False))


def run(args: argparse.Namespace) -> int:
    """CLI entry: print the summary JSON; 0 unless every request failed (1) or Ctrl-C (130)."""
    summary = run_load(config_from_args(args))
    print(json.dumps(summary, indent=2), flush=True)
    if summary["interrupted"]:
        return 130
    return 1 if summary["requests_failed"] and not summary["requests_ok"] else 0

