"""vLLM's CPU runtime: which OpenMP library its engine process preloads, and how many cores it leaves
to the front end.

vLLM's CPU platform starts the engine core with `spawn` (vllm/platforms/cpu.py), so the environment
of the process that starts vLLM decides both:

- `LD_PRELOAD`: when it names no OpenMP library, vLLM preloads torch's libgomp. Intel's libiomp5
  comes with the install (`<venv>/lib/libiomp5.so`, the intel-openmp wheel), and vLLM's CPU worker
  warns that speculative decoding without it causes "significant performance loss".
- `VLLM_CPU_NUM_OF_RESERVED_CPU`: cores kept out of the engine's OpenMP thread binding for the
  scheduler and the API server (vLLM's default on x86: one per worker).

`benchmarks/plain_settings.py` measures the combinations on plain `vllm serve`; the defaults in
`ServeConfig` are the fastest it found, and every speed benchmark gives its plain-vLLM baseline the
same settings (`plain_vllm_env`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Literal, Mapping

logger = logging.getLogger(__name__)

OpenMP = Literal["iomp", "gomp"]
OPENMP_LIBS = ("libiomp", "libomp", "libgomp")
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def find_libiomp() -> Path | None:
    """The Intel OpenMP runtime installed beside this Python (`<prefix>/lib/libiomp5.so`), if any."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = Path(prefix) / "lib" / "libiomp5.so"
        if path.is_file():
            return path
    return None


def cpu_runtime_env(openmp: OpenMP, reserved_cores: int | None, *,
                    environ: Mapping[str, str] = os.environ, libiomp: Path | None = None) -> dict[str, str]:
    """Environment entries to add before vLLM starts its CPU engine.

    An OpenMP library the user already preloads, and a reserved-core count the user already set, are
    kept. `openmp="gomp"` adds nothing: vLLM preloads torch's libgomp by itself."""
    env: dict[str, str] = {}
    preload = environ.get("LD_PRELOAD", "")
    if openmp == "iomp" and not any(lib in preload for lib in OPENMP_LIBS):
        lib = libiomp if libiomp is not None else find_libiomp()
        if lib is None:
            logger.warning("libiomp5.so not found under %s/lib: vLLM falls back to torch's libgomp", sys.prefix)
        else:
            env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    if reserved_cores is not None and RESERVED_ENV not in environ:
        env[RESERVED_ENV] = str(reserved_cores)
    return env


def runtime_env_for(openmp: OpenMP, reserved_cores: int | None) -> dict[str, str]:
    """``cpu_runtime_env`` when vLLM runs on its CPU platform here; nothing on a GPU."""
    return cpu_runtime_env(openmp, reserved_cores) if on_cpu() else {}


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (imports vLLM)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# libiomp5's fork handler (registered when the runtime starts, at `import torch` where it is preloaded)
# sets a forked child's CPU affinity to one core: every process that Ray's driver forks (the Ray
# head, the raylet, and through them the trainer actor) ran bound to core 0, beside the engine's
# busiest OpenMP thread (tests/test_cpu_runtime.py shows it). The trainer's process never forks without
# exec, the case the handler exists for (an OpenMP runtime copied into a child), so it goes.
TRAINER_PROCESS_ENV = {"KMP_INIT_AT_FORK": "false"}


def trainer_process_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment to start the online trainer's process (Ray's driver) with."""
    return {**environ, **TRAINER_PROCESS_ENV}


def set_idle_priority(tids: list[int]) -> list[int]:
    """Move these threads (Linux thread ids; 0 = the caller) to the SCHED_IDLE scheduling class: they
    run only on CPU time that no normal thread wants, and a normal thread that wakes preempts them at
    once. Threads they start and processes they fork inherit the class. Returns the ids moved (a
    thread gone meanwhile is skipped); nothing off Linux."""
    if not hasattr(os, "SCHED_IDLE"):
        return []
    moved = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (ProcessLookupError, PermissionError):
            continue
        moved.append(tid)
    return moved
