"""The bootstrap's text feature pass beside its SFT (``bootstrap.overlap_features``).

Without it the bootstrap runs its phases one after another on every core: the
teacher-forced text feature pass (a target forward per conversation) until
``text_feature_share`` of the budget, then SFT. On the 2-core CPU neither phase
uses two threads fully: the feature pass ran at 464 tokens/s on 2 threads and
264 on 1 (1.76x), an SFT step took 0.55 s on 2 threads and 0.90 s on 1 (1.63x).
Run at the same time, one thread each, in two processes, they kept 250 tokens/s
and 0.89 s a step (runs/b35 probes, 2026-12-06): 16% more work per second than
either phase alone on both threads, and the SFT starts minutes earlier on a
pool that keeps growing.

The producer, a spawned process, featurises the text conversations in order
(``serve.pipeline.text_sequences``: deterministic) and writes them in chunks,
``<run>/text_stream/chunk-<first>-<end>.safetensors`` (a temporary name, then a
rename: a reader never sees half a chunk). It stops at its deadline (between
conversations), when the trainer asks (a stop file), when its parent is gone,
or when every conversation is done, and then writes ``end.json`` (why, how many,
how fast; an error's message too). A rerun in the same folder starts after the
last chunk written. The trainer polls the folder between steps and adds each new
chunk to its pool (``FeatureStream.poll``); once the producer has ended, the
trainer gets its threads back.

A pool that grows while training makes the SFT's draws depend on timing: an
overlapped bootstrap is not bit-reproducible (a sequential one with a time
budget is not either: its step count is planned from a measured step time).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from online_opd.train.sequences import TrainSequence, load_sequences

logger = logging.getLogger(__name__)

STREAM_DIR = "text_stream"
END_FILE = "end.json"
STOP_FILE = "stop"
CHUNK_SEQUENCES = 8  # conversations per chunk: ~8 s of the feature pass on one thread here


def chunk_name(first: int, end: int) -> str:
    return f"chunk-{first:06d}-{end:06d}.safetensors"


def chunk_range(path: Path) -> tuple[int, int] | None:
    """(first, end) conversation indices of a chunk file's name; None for any other file."""
    parts = path.name.removesuffix(".safetensors").split("-")
    if len(parts) != 3 or parts[0] != "chunk" or not path.name.endswith(".safetensors"):
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


def chunks(folder: Path) -> list[tuple[int, int, Path]]:
    """The complete chunks in ``folder``, by first index."""
    found = [(r[0], r[1], p) for p in folder.glob("chunk-*.safetensors") if (r := chunk_range(p)) is not None]
    return sorted(found)


def produce(config: dict, target: str, folder: str, layer_ids: tuple[int, ...], deadline: float | None,
            threads: int) -> None:
    """The producer process (module docstring); ``deadline`` is a ``time.monotonic`` reading (the clock is
    system-wide on Linux, so the parent's reading holds here)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which stops this
    torch.set_num_threads(threads)
    out, parent = Path(folder), os.getppid()
    start, done, tokens, reason, error = time.monotonic(), 0, 0, "done", None
    try:
        from online_opd.config import OnlineOPDConfig
        from online_opd.models.target_model import TargetModel
        from online_opd.train.sequences import compute_aux_hidden, save_sequences
        from serve.pipeline import feature_dtype, load_tokenizer, text_sequences

        cfg = OnlineOPDConfig.model_validate(config)
        sequences = text_sequences(cfg, load_tokenizer(Path(target)))
        first = max((end for _, end, _ in chunks(out)), default=0)
        model = TargetModel.from_pretrained(Path(target), dtype=feature_dtype(cfg))
        for lo in range(first, len(sequences), CHUNK_SEQUENCES):
            if (out / STOP_FILE).exists() or os.getppid() != parent:
                reason = "stopped"
                break
            chunk = sequences[lo: lo + CHUNK_SEQUENCES]
            n = compute_aux_hidden(model, chunk, layer_ids, with_labels=True, progress=False, deadline=deadline)
            if n:
                tmp = out / f".tmp-{lo}.safetensors"
                save_sequences(tmp, chunk[:n], layer_ids)
                os.replace(tmp, out / chunk_name(lo, lo + n))
                done += n
                tokens += sum(s.num_tokens for s in chunk[:n])
            if n < len(chunk):
                reason = "deadline"
                break
    except Exception as exc:  # reported to the trainer through end.json; the bootstrap goes on without
        reason, error = "error", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        seconds = time.monotonic() - start
        (out / END_FILE).write_text(json.dumps({
            "reason": reason, "error": error, "sequences": done, "tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None, "threads": threads}))


@dataclass
class FeatureStream:
    """The trainer's side: the producer process, the chunks read so far, the threads to give back."""

    folder: Path
    layer_ids: tuple[int, ...]
    process: multiprocessing.process.BaseProcess
    threads: int  # the trainer's threads when the stream started (given back at the end)
    producer_threads: int
    read: set[Path] = field(default_factory=set)
    ended: dict | None = None
    num_sequences: int = 0
    num_tokens: int = 0

    @classmethod
    def start(cls, cfg, target: Path, run_dir: Path, layer_ids: tuple[int, ...], *,
              deadline: float | None) -> FeatureStream:
        """Start the producer on half the trainer's threads (the trainer keeps the rest until it ends)."""
        folder = run_dir / STREAM_DIR
        folder.mkdir(parents=True, exist_ok=True)
        for stale in (STOP_FILE, END_FILE):
            (folder / stale).unlink(missing_ok=True)
        for tmp in folder.glob(".tmp-*"):
            tmp.unlink()
        threads = torch.get_num_threads()
        producer = max(1, threads // 2)
        process = multiprocessing.get_context("spawn").Process(
            target=produce, name="online-opd text features", daemon=True,
            args=(cfg.model_dump(mode="json"), str(target), str(folder), tuple(layer_ids), deadline, producer))
        process.start()
        torch.set_num_threads(max(1, threads - producer))
        logger.info("text features beside the SFT: a producer process on %d thread(s), the trainer on %d "
                    "(bootstrap.overlap_features), chunks in %s", producer, torch.get_num_threads(), folder)
        return cls(folder, tuple(layer_ids), process, threads, producer)

    def poll(self) -> list[TrainSequence]:
        """Sequences of the chunks written since the last poll; once the producer has ended, gives the
        trainer its threads back and logs why it ended."""
        new: list[TrainSequence] = []
        for _, _, path in chunks(self.folder):
            if path not in self.read:
                self.read.add(path)
                got = load_sequences(path, self.layer_ids)
                self.num_sequences += len(got)
                self.num_tokens += sum(s.num_tokens for s in got)
                new += got
        if self.ended is None and not self.process.is_alive():
            self._end()
            new += self.poll()  # chunks written between the listing and the end
        return new

    def wait_first(self, poll_s: float = 0.5) -> list[TrainSequence]:
        """Block until the first chunk or the producer's end (a pool with nothing to train on yet)."""
        while True:
            new = self.poll()
            if new or self.ended is not None:
                return new
            time.sleep(poll_s)

    def close(self, timeout_s: float = 120.0) -> dict:
        """Ask the producer to stop, wait for it (it looks between chunks: one chunk at most), and return its
        summary."""
        if self.process.is_alive():
            (self.folder / STOP_FILE).touch()
            self.process.join(timeout_s)
            if self.process.is_alive():
                logger.warning("text feature producer did not stop within %.0f s: terminated", timeout_s)
                self.process.terminate()
                self.process.join(10)
        if self.ended is None:
            self._end()
        return self.summary()

    def summary(self) -> dict:
        return {**(self.ended or {}), "sequences_read": self.num_sequences, "tokens_read": self.num_tokens,
                "producer_threads": self.producer_threads}

    def _end(self) -> None:
        try:
            self.ended = json.loads((self.folder / END_FILE).read_text())
        except (OSError, ValueError):
            self.ended = {"reason": "error", "error": f"the producer exited with code {self.process.exitcode} "
                                                      "without a summary"}
        torch.set_num_threads(self.threads)
        log = logger.warning if self.ended.get("reason") == "error" else logger.info
        log("text feature producer ended (%s%s): %s sequences, %s tokens/s; the trainer is back on %d thread(s)",
            self.ended.get("reason"), f": {self.ended['error']}" if self.ended.get("error") else "",
            self.ended.get("sequences"), self.ended.get("tokens_per_s"), self.threads)
