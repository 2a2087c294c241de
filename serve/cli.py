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
    parser = argparse.ArgumentParser(
        prog="online-opd",
        description="Online Draft-OPD: speculative-decoding drafters that improve on served traffic.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("setup", help="set up the embedded SmolLM2 target model (idempotent)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $ONLINE_OPD_CACHE or XDG cache")
    p.add_argument("--verify", action="store_true", help="re-hash every file of an existing set-up")

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    _add_config_args(csub.add_parser("show", help="print the resolved configuration as YAML"))

    p = sub.add_parser("bootstrap", help="SFT warm-up of a fresh drafter on target rollouts (vLLM)")
    _add_config_args(p)
    p.add_argument("--run-dir", type=Path, default=None, help="default: bootstrap.output_dir")

    p = sub.add_parser("rollout", help="record T=0 speculative-decoding rollouts of a drafter")
    _add_config_args(p)
    p.add_argument("--drafter", type=Path, required=True, help="drafter checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="records folder to write")

    p = sub.add_parser("train", help="Draft-OPD (or an ablation) on recorded rollouts")
    _add_config_args(p)
    p.add_argument("--records", type=Path, required=True, help="folder of sequence records")
    p.add_argument("--init", type=Path, default=None, help="drafter to start from (default: drafter.init_from)")
    p.add_argument("--run-dir", type=Path, default=None, help="default: trainer.output_dir")

    p = sub.add_parser("eval", help="served acceptance length and tokens/s on vLLM")
    _add_config_args(p)
    p.add_argument("--drafter", type=Path, required=True, help="drafter checkpoint folder")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")

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
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster for the trainer actor (e.g. auto, ray://head:10001; default: local Ray)")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command and environment, exit")

    p = sub.add_parser("reload", help="hot-load a drafter into a running server (admin token required)")
    p.add_argument("path", nargs="?", type=Path, help="checkpoint folder (as the server sees it)")
    p.add_argument("--version", default=None, help="a registry version instead of a path")
    p.add_argument("--sha256", default=None, help="expected sha256 of model.safetensors (default: manifest)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--token-env", default="ONLINE_OPD_ADMIN_TOKEN", help="env var holding the admin token")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the reply")

    from serve import buffer_cli, drafters_cli, loadgen, report, scrape

    for module in (buffer_cli, drafters_cli, loadgen, report, scrape):
        module.add_parser(sub)
    return parser


def _emit(result: dict, out: Path | None = None) -> None:
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


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
    progress = not args.no_progress
    if extra and args.command != "serve":
        raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("buffer", "drafters", "loadgen", "report", "scrape"):
        from serve import buffer_cli, drafters_cli, loadgen, report, scrape

        modules = {"buffer": buffer_cli, "drafters": drafters_cli, "loadgen": loadgen, "report": report,
                   "scrape": scrape}
        return modules[args.command].run(args)
    if args.command == "reload":
        return _reload(args)
    if args.command == "serve":
        from serve.server import serve

        overrides = list(args.override)
        if args.ray_address:
            overrides.append(f"online.ray_address={args.ray_address}")
        cfg = load_config(args.config, overrides)
        return serve(cfg, drafter=args.drafter, capture=not args.no_capture, train=not args.no_train,
                     passthrough=extra,
                     progress=progress, dry_run=args.dry_run)
    if args.command == "setup":
        from online_opd.models.target import ensure_embedded_target

        path = ensure_embedded_target(args.cache_dir, progress=progress, verify=args.verify)
        _emit({"target": str(path)})
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.command == "config":
        sys.stdout.write(dump_config(cfg))
        return 0
    if args.command == "bootstrap":
        from serve.pipeline import bootstrap

        _emit({"drafter": str(bootstrap(cfg, args.run_dir or cfg.bootstrap.output_dir, progress=progress))})
    elif args.command == "rollout":
        from serve.offline_opd import record_rollouts

        _emit(record_rollouts(cfg, args.drafter, args.out, progress=progress))
    elif args.command == "train":
        from serve.offline_opd import train_on_records

        init = args.init or cfg.drafter.init_from
        run_dir = args.run_dir or cfg.trainer.output_dir
        _emit({"drafter": str(train_on_records(cfg, args.records, init, run_dir, progress=progress))})
    elif args.command == "eval":
        from serve.evaluate import evaluate

        _emit(evaluate(cfg, args.drafter, progress=progress), args.out)
    return 0


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
