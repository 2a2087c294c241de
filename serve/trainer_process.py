"""The online trainer in a child process of `online-opd serve`, restarted when it dies.

Ray ends a driver whose cluster head (GCS) is gone, after
``gcs_rpc_server_reconnect_timeout_s``: with the Ray driver inside the API
server, a killed Ray head would take serving down with it. So the server runs
``python -m serve.trainer_process`` as a child instead. The child reads one
JSON line on stdin (``TrainerSpec``), starts (or joins) Ray and the trainer
actor (serve/trainer_actor.py), and writes the actor's ``stats()`` to stdout
as one JSON line every ``POLL_S`` (``null`` while the actor does not answer:
loading, or being restarted by Ray). A line ``stop`` on stdin, stdin closing
(the server died) or SIGINT/SIGTERM stop the trainer (its state saved) and
Ray. The child's own stdout is the protocol only: everything else that
writes there (Ray, the trainer's prints) goes to stderr, the server's log.
The child runs in a session of its own: a signal to the server's process
group (Ctrl-C, ``kill -TERM -PGID``) must not reach Ray's processes before the
server has asked the trainer to save its state and stop. Once the child has
exited, whatever is left in its process group (Ray's agents outlive a lost
head) is killed.

``TrainerProcess`` is the server's side: it reads the lines, answers
``stats()`` for /metrics (``{"up": False, "restarts": ...}`` while the trainer
cannot answer), restarts the child when it exits on its own (the Ray head
was killed, or the actor used up its Ray restarts) with a doubling back-off,
and counts restarts by level: ``actor`` when Ray restarted the actor (its pid
changed), ``ray`` when the child and its Ray were started again. Each
restart is logged once, at WARNING or ERROR. With ``stats_file`` it also
writes each line's ``stats()`` there (JSON, with the wall time ``at``): the
API servers vLLM spawns as processes of their own (``--api-server-count N``)
read the trainer's figures from it (``vllm_patches.endpoint.read_trainer_stats_file``).

Engine load and hibernation (``serve/engine_load.py``): with ``server_url`` in its spec the child
passes the engine's load with its stats polls, and with ``online.hibernate_after_s`` it runs Ray and the
actor only around the engine's idle time (``main``).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict

from online_opd.config_serving import OnlineConfig  # pydantic only: no torch before the cores are set
from serve.cpu_runtime import set_idle_priority, trainer_process_env
from serve.engine_load import HIBERNATING, LOAD_POLL_S, Hibernation, ServerLoad

logger = logging.getLogger("online_opd.trainer_process")

POLL_S = 1.0  # seconds between the child's stats lines
STATS_TIMEOUT_S = 5.0  # the child's wait for the actor's answer
STALE_S = 20.0  # no line for this long: the trainer counts as down
#: No line for this long (from its start, or since its last line): the child is hung, not slow. It
#: writes a line every POLL_S once started; starting (imports, a local Ray) takes seconds to a minute.
HANG_S = 120.0
EXIT_ACTOR_GONE = 3  # the child's exit code when the actor is dead for good
SESSIONS_KEPT = 2  # Ray session folders kept across hibernation cycles (prune_sessions)
HIBERNATE = -1  # ``_report``'s answer once the engines served for online.hibernate_after_s (no exit code)
ROOT = Path(__file__).resolve().parents[1]


class TrainerSpec(BaseModel):
    """What the child needs to start the trainer actor (``start_trainer``'s arguments)."""

    model_config = ConfigDict(extra="forbid")

    config: dict
    target_path: str
    buffer_dir: str
    registry_dir: str
    state_dir: str
    replica: str = ""  # the serving replica (its capture writer id); "" = this host and the server's pid
    cpus: list[int] | None = None  # cores the child (and the Ray it starts) runs on; None = inherited
    server_url: str | None = None  # the server whose /metrics carries the engine's load; None = not read


class TrainerProcess:
    """Runs and supervises the trainer child (module docstring); ``stats`` is safe from any thread."""

    def __init__(self, spec: TrainerSpec, *, backoff_s: tuple[float, float] = (2.0, 60.0),
                 stale_s: float = STALE_S, hang_s: float = HANG_S, command: list[str] | None = None,
                 stats_file: Path | None = None) -> None:
        self.spec = spec
        self.stats_file = stats_file
        self._is_file_failing = False
        self.command = command or [sys.executable, "-m", "serve.trainer_process"]
        self.backoff_s = backoff_s
        self.stale_s = stale_s
        self.hang_s = hang_s
        self._lock = threading.Lock()
        self._latest: dict | None = None
        self._latest_at = 0.0
        self._line_at = 0.0  # the child's latest line, or its start (monotonic)
        self._pid: int | None = None  # the actor's process, to see Ray restart it
        self._restarts = {"actor": 0, "ray": 0}
        self._stopping = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._supervise, name="online-opd-trainer-process", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stats(self) -> dict[str, Any]:
        """The actor's latest figures plus ``up`` and ``restarts``; ``up`` False when stale or none."""
        with self._lock:
            restarts = dict(self._restarts)
            is_fresh = time.monotonic() - self._latest_at < self.stale_s
            if self._latest is None or not is_fresh:
                return {"up": False, "restarts": restarts}
            return {**self._latest, "up": True, "restarts": restarts}

    def stop(self, timeout: float = 90.0) -> dict[str, Any]:
        """Ask the child to stop the trainer (state saved) and Ray; kill it after ``timeout``."""
        last = self.stats()
        with self._lock:  # no child is spawned after this
            self._stopping.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write("stop\n")
                proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.error("online trainer process did not stop in %.0fs: killing it", timeout)
                proc.kill()
                proc.wait(30)
        self._thread.join(10)
        return last

    def _supervise(self) -> None:
        delay = self.backoff_s[0]
        while True:
            started = time.monotonic()
            with self._lock:
                if self._stopping.is_set():
                    return
                proc = self._proc = self._spawn()
            reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
            reader.start()
            code = self._wait(proc)
            _kill_group(proc.pid)  # what its Ray left behind (e.g. agents of a lost head)
            reader.join(5.0)
            with self._lock:
                self._latest, self._pid = None, None
            if self._stopping.is_set():
                return
            if time.monotonic() - started > 10 * self.backoff_s[1]:
                delay = self.backoff_s[0]  # it ran long enough: a fresh failure, not a crash loop
            why = {EXIT_ACTOR_GONE: "its trainer actor is gone for good", -signal.SIGKILL: "it hung, or was killed"}.get(
                code, "Ray's head was lost, or it crashed")
            logger.error("online trainer process exited with code %s (%s); starting it and Ray again in "
                         "%.0fs (serving is unaffected)", code, why, delay)
            if self._stopping.wait(delay):
                return
            delay = min(2 * delay, self.backoff_s[1])
            with self._lock:
                self._restarts["ray"] += 1

    def _wait(self, proc: subprocess.Popen) -> int:
        """The child's exit code. A child silent for ``hang_s`` is hung (it would never come back by
        itself): its threads' stacks go to the log (SIGUSR1, ``faulthandler``), then it is killed."""
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            with self._lock:
                silent_s = time.monotonic() - self._line_at
            if silent_s > self.hang_s and not self._stopping.is_set():
                logger.error("online trainer process (pid %d) wrote nothing for %.0fs: it is hung; its threads' "
                             "stacks follow, then it is killed", proc.pid, silent_s)
                _dump_stacks(proc.pid)
                proc.kill()
                return proc.wait()

    def _spawn(self) -> subprocess.Popen:
        engine = engine_cores(os.getpid())
        cpus = cores_beside(engine)
        proc = subprocess.Popen(self.command, cwd=ROOT, text=True, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=1, start_new_session=True,
                                env=trainer_process_env())
        proc.stdin.write(self.spec.model_copy(update={"cpus": cpus}).model_dump_json() + "\n")
        proc.stdin.flush()
        self._line_at = time.monotonic()  # under self._lock (_supervise)
        if cpus is None:
            logger.info("online trainer process started (pid %d)", proc.pid)
        else:
            logger.info("online trainer process started (pid %d) on cores %s, beside the engine's workers "
                        "on %s", proc.pid, cpus, sorted(engine))
        return proc

    def _read(self, lines: IO[str]) -> None:
        for line in lines:
            try:
                stats = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("online trainer process: unreadable line %r", line[:200])
                continue
            self._observe(stats if isinstance(stats, dict) else None)
            self._write_stats_file()

    def _observe(self, stats: dict | None) -> None:
        with self._lock:
            self._latest, self._latest_at = stats, time.monotonic()
            self._line_at = self._latest_at
            pid = None if stats is None else stats.get("pid")
            if pid is None:
                if stats is not None and stats.get("status") == HIBERNATING:
                    self._pid = None  # the actor was ended on purpose: the next one is no restart
                return
            previous, self._pid = self._pid, pid
            if previous is None or previous == pid:
                return
            self._restarts["actor"] += 1
        logger.warning("online trainer actor restarted by Ray (pid %s -> %s); it resumes from its state",
                       previous, pid)

    def _write_stats_file(self) -> None:
        if self.stats_file is None:
            return
        from online_opd.files import atomic_write_json

        try:
            atomic_write_json(self.stats_file, {**self.stats(), "at": time.time()})
            self._is_file_failing = False
        except OSError as exc:
            if not self._is_file_failing:
                logger.warning("cannot write the trainer's stats to %s: %s", self.stats_file, exc)
            self._is_file_failing = True


def engine_cores(root_pid: int) -> set[int]:
    """Cores the threads of vLLM's CPU workers under ``root_pid`` are bound to, one core a thread
    (vLLM binds each OpenMP thread of a CPU worker to a core of its own); empty without such a worker
    (not started yet, a GPU worker, ``VLLM_CPU_OMP_THREADS_BIND=nobind``)."""
    import psutil

    cores: set[int] = set()
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return cores
    for proc in children:
        try:
            if proc.name() != "VLLM::Worker":
                continue
            for thread in proc.threads():
                mask = os.sched_getaffinity(thread.id)
                if len(mask) == 1:
                    cores |= mask
        except (psutil.Error, OSError):  # gone meanwhile
            continue
    return cores


def cores_beside(engine: set[int]) -> list[int] | None:
    """The cores this process may use that the engine's workers are not bound to; None when there are
    none to give, or nothing to avoid.

    Why: a process that imports torch pins itself to each of its cores in turn (MKL counting cores),
    and here that call waited minutes on a core a busy worker held, so a trainer restarted under
    traffic hung (tests/test_faults.py). Off the engine's cores it also leaves the engine's OpenMP
    threads, which wait on each other every step, undisturbed."""
    if not engine:
        return None
    free = sorted(os.sched_getaffinity(0) - engine)
    return free or None


def _dump_stacks(pid: int, wait_s: float = 2.0) -> None:
    """Have the child write its threads' stacks to its stderr (the server's log) and give it time to."""
    try:
        os.kill(pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return
    time.sleep(wait_s)


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's process group (its session: only its own Ray processes are in it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------- the child


def _watch_stdin(stop: threading.Event) -> None:
    """Stop on a ``stop`` line or when stdin closes (the server is gone)."""
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def _poll(handle, replica: str | None, load: str | None = None) -> tuple[dict | None, bool]:
    """(the actor's stats or None while it does not answer, whether it is dead for good); `load`, the
    engine's as ``ServerLoad`` read it, goes with the poll (``TrainerActor.stats``)."""
    import ray
    from ray.exceptions import ActorDiedError

    try:
        return ray.get(handle.stats.remote(replica, load), timeout=STATS_TIMEOUT_S), False
    except ActorDiedError:
        return None, True
    except Exception as exc:  # timed out, restarting, unavailable
        logger.debug("trainer stats unavailable: %r", exc)
        return None, False


def read_spec(lines: IO[str]) -> TrainerSpec:
    """The child's first step: its spec, the cores it was given (``cores_beside``) and, with
    ``online.cpu_priority: idle``, the SCHED_IDLE class, all taken before torch is imported and Ray
    started: the Ray processes it starts and the trainer actor inherit them, so every thread of the
    trainer's side (the actor's compute and Ray's control plane) runs on CPU time the engine leaves.
    That alone did not keep training from slowing serving here (README, Known issues):
    ``online.duty_cycle`` bounds it."""
    spec = TrainerSpec.model_validate_json(lines.readline())
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if OnlineConfig.model_validate(spec.config.get("online", {})).cpu_priority == "idle" and set_idle_priority([0]):
        logger.info("online trainer process and its Ray on SCHED_IDLE (online.cpu_priority=idle)")
    return spec


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the supervisor's view into a hung child
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # Ray and stray prints: to the log, not the protocol
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = read_spec(sys.stdin)
    from online_opd.config import OnlineOPDConfig
    from online_opd.traces.buffer import default_writer_id
    from serve.signals import stop_on_signals
    from serve.trainer_actor import start_trainer, stop_trainer

    cfg = OnlineOPDConfig.model_validate(spec.config)
    replica = (spec.replica or default_writer_id(os.getppid())) if cfg.online.ray_address is not None else None
    stop = threading.Event()
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    load = ServerLoad(spec.server_url) if spec.server_url else None
    hibernation = Hibernation.of(cfg.online, has_load=load is not None)
    code, last, sessions = 0, None, []
    while not stop.is_set():
        if hibernation is not None:
            with stop_on_signals(stop=stop):
                if not _hibernate(load, hibernation, stop, protocol, last):
                    break
            logger.info("engines idle for %gs: starting Ray and the online trainer", hibernation.idle_after_s)
        handle = start_trainer(cfg, target_path=Path(spec.target_path), buffer_dir=spec.buffer_dir,
                               registry_dir=Path(spec.registry_dir), state_dir=Path(spec.state_dir),
                               replica=replica)
        sessions.append(_ray_session_dir())
        with stop_on_signals(stop=stop):  # after ray.init, which installs handlers of its own
            code, last = _report(handle, stop, protocol, replica, load, hibernation)
            final = stop_trainer(handle, replica=replica) if code in (0, HIBERNATE) else None
        if final:
            last = final
            logger.info("online trainer stopped after %s steps", final.get("steps"))
        import ray

        ray.shutdown()
        if code != HIBERNATE:
            return code
        prune_sessions(sessions)
        logger.info("engines served for %gs: online trainer stopped (state saved) and Ray shut down until "
                    "they are idle again (online.hibernate_after_s)", hibernation.hibernate_after_s)
    return 0


def _ray_session_dir() -> Path | None:
    """The local Ray's session folder (its logs), for ``prune_sessions``; None when unknown."""
    try:
        from ray._private.worker import global_worker

        return Path(global_worker.node.get_session_dir_path())
    except Exception as exc:  # a private API: a Ray that moved it leaves the folders be
        logger.debug("Ray's session folder is unknown: %r", exc)
        return None


def prune_sessions(sessions: list[Path | None], keep: int = SESSIONS_KEPT) -> None:
    """Remove the folders of all but the newest `keep` Ray sessions of the list, which shrinks to those:
    every wake from hibernation starts a session (about 0.5 MB of logs here, the actor's own lines are in
    the server's log), and a server hibernating every few minutes would fill the disk with them."""
    while len(sessions) > keep:
        old = sessions.pop(0)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _write(protocol: IO[str], stats: dict | None, stop: threading.Event) -> None:
    try:
        protocol.write(json.dumps(stats) + "\n")
    except BrokenPipeError:  # the server is gone: stdin closes too
        stop.set()


def _hibernate(load: ServerLoad, hibernation: Hibernation, stop: threading.Event, protocol: IO[str],
               last: dict | None) -> bool:
    """Without Ray or the actor, until the engines have been idle for ``idle_after_s``: read the load every
    ``LOAD_POLL_S`` and write a line every ``POLL_S`` (the last actor's figures, status ``hibernating``, no
    pid), so the server's /metrics keep them. False when stopped meanwhile."""
    line = {**(last or {}), "status": HIBERNATING, "pid": None, "running": False, "engines_idle": 0}
    next_read = 0.0
    while True:
        if time.monotonic() >= next_read:
            next_read = time.monotonic() + LOAD_POLL_S
            hibernation.note(load.read())
        if hibernation.may_wake():
            return True
        _write(protocol, line, stop)
        if stop.wait(POLL_S):
            return False


def _report(handle, stop: threading.Event, protocol: IO[str], replica: str | None,
            load: ServerLoad | None = None, hibernation: Hibernation | None = None) -> tuple[int, dict | None]:
    """Write the actor's stats every ``POLL_S`` until ``stop``, passing the engine's load every
    ``LOAD_POLL_S`` when `load` reads it; (the exit code for ``main``, or ``HIBERNATE`` once
    `hibernation` says so; the actor's last stats)."""
    next_read, last = 0.0, None
    while not stop.wait(POLL_S):
        state = None
        if load is not None and time.monotonic() >= next_read:
            next_read = time.monotonic() + LOAD_POLL_S
            state = load.read()
            if hibernation is not None:
                hibernation.note(state)
        stats, is_gone = _poll(handle, replica, state)
        if is_gone:
            logger.error("online trainer actor is dead and Ray will not restart it (online.max_restarts)")
            return EXIT_ACTOR_GONE, last
        last = stats or last
        _write(protocol, stats, stop)
        if hibernation is not None and hibernation.should_sleep():
            return HIBERNATE, last
    return 0, last


if __name__ == "__main__":
    sys.exit(main())
