"""`online-opd drafters …`: inspect and steer the versioned drafter registry by hand.

The server and trainer use `DrafterRegistry` directly; this command is for operators: list versions,
show one, promote, roll back, mark bad, publish an existing checkpoint folder as a candidate, check
(repair a CURRENT that names a missing or bad version). Results are JSON on stdout; errors are logged and
exit with status 2. The registry folder is `--registry`, else $ONLINE_OPD_REGISTRY, else the config's
`serve.registry` (`-c FILE`; the built-in default is the server's, runs/serve/registry), and its
retention (`serve.registry_keep_unpromoted`) comes from the same config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from online_opd.config import ConfigError, load_config
from online_opd.release.registry import DrafterRegistry, RegistryError

logger = logging.getLogger("online_opd")

REGISTRY_ENV = "ONLINE_OPD_REGISTRY"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `drafters` command (with its actions) to a CLI's subparsers."""
    parser = subparsers.add_parser("drafters", help="versioned drafter registry: list, promote, roll back")
    actions = parser.add_subparsers(dest="drafters_command", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help)
        p.add_argument("--registry", type=Path, default=None,
                       help=f"registry folder (default: ${REGISTRY_ENV}, else the config's serve.registry)")
        p.add_argument("-c", "--config", type=Path, default=None,
                       help="YAML config whose serve section names the registry (default: built-in defaults)")
        return p

    action("list", "all versions, oldest first, with status and which is current")
    action("history", "lifecycle events: publish, promote, reject, mark_bad, rollback")
    p = action("show", "one version: manifest figures, status, weights sha256")
    p.add_argument("version")
    p = action("promote", "make a version current (verifies its hashes; refuses bad versions)")
    p.add_argument("version")
    p.add_argument("--reason", default="manual promote")
    p = action("rollback", "mark the current version bad and return to the previous good one")
    p.add_argument("--reason", default="manual rollback")
    p = action("mark-bad", "never promote a version again (does not move CURRENT)")
    p.add_argument("version")
    p.add_argument("--reason", default="marked bad by hand")
    p = action("publish", "copy an existing checkpoint folder in as a new candidate version")
    p.add_argument("checkpoint_dir", type=Path)
    p.add_argument("--parent", default=None, help="registry version it was trained from")
    p.add_argument("--step", type=int, default=None, help="training step (default: from its manifest)")
    action("check", "repair a CURRENT naming a missing, bad or corrupt version (the server does this at start)")
    parser.set_defaults(func=run)
    return parser


def open_registry(args: argparse.Namespace) -> DrafterRegistry:
    """The registry `--registry` / $ONLINE_OPD_REGISTRY / the config names, with the config's retention."""
    serve = load_config(args.config).serve
    root = args.registry or (Path(os.environ[REGISTRY_ENV]) if os.environ.get(REGISTRY_ENV) else serve.registry)
    return DrafterRegistry(root, keep_unpromoted=serve.registry_keep_unpromoted)


def run(args: argparse.Namespace) -> int:
    """Run one `drafters` action; 0 with JSON on stdout, or 2 with the error logged."""
    try:
        result = _dispatch(open_registry(args), args)
    except (RegistryError, ConfigError) as exc:
        logger.error("%s", exc)
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0


def _dispatch(registry: DrafterRegistry, args: argparse.Namespace) -> dict:
    command = args.drafters_command
    if command == "list":
        current = registry.current()
        return {"registry": str(registry.root), "current": current.version if current else None,
                "versions": [info.to_dict() for info in registry.list()]}
    if command == "history":
        return {"registry": str(registry.root), "events": registry.history()}
    if command == "show":
        info = registry.get(args.version)
        return {**info.to_dict(), "weights_sha256": registry.weights_sha256(args.version)}
    if command == "promote":
        return registry.promote(args.version, reason=args.reason).to_dict()
    if command == "rollback":
        before = registry.current()
        after = registry.rollback(args.reason)
        return {"from": before.version if before else None, "current": after.to_dict()}
    if command == "mark-bad":
        return registry.mark_bad(args.version, args.reason).to_dict()
    if command == "publish":
        return registry.publish(args.checkpoint_dir, parent=args.parent, step=args.step).to_dict()
    if command == "check":
        repair = registry.check()
        current = registry.current()
        return {"registry": str(registry.root), "repaired": repair, "current": current.version if current else None}
    raise RegistryError(f"unknown drafters action {command!r}")
