"""The online trainer's record intake: tail the trace buffer into pools, and sample each step's records.

``RecordPools`` is held by ``OnlineTrainer`` (train/online.py) as ``pools``. It owns the buffer's
reader and cursor, the train window, the fresh records and the held-out pool; the trainer owns
everything that trains (drafter, optimizer, steps, gate, registry, state file, duty cycle) and adds
the counts ``poll`` returns to its own counters, so ``stats`` and the state file keep them as before.
Tailing lives here, not in the trainer, because the cursor means "the pools hold what the buffer had
up to here": ``poll`` moves it, ``resume`` refills the pools up to a saved one, and the trainer only
saves and restores its value.

Data. ``poll`` tails the buffer (``BufferReader.tail`` with ``settle_s``). A record with neither a
replayable block (1..K tokens, K = the drafter's block size, passed in by the trainer) nor two output
tokens to simulate one on is counted as ``records_unusable``; every other record is checked against
the capture-fidelity contract (``check_fidelity``): violators are dropped and counted
(``records_invalid``), never trained on. The rest is routed by the gate's stable hash of the prompt's
first tokens (``gate.is_held_out``: siblings, repeated prompts and a conversation's turns stay on one
side) to the held-out pool or to the train window (the newest ``online.window_records``). The held-out
pool keeps the newest record of each held-out prompt (key), for the newest ``gate.max_records`` prompts:
the gate's unit is the prompt (release/gate.py), so a prompt repeated all day fills one slot, not all of
them, and the gate's records stay as many distinct prompts as traffic offers. A train record is *fresh*
until a step has replayed it (or it leaves the window).

Sampling (the replay ratio). Each step replays ``trainer.sequences_per_step`` records:
``round(online.fresh_fraction * n)`` fresh ones, newest first (drafted by the most recent serving
drafter, so the most on-policy), and the rest uniformly from the whole window, with replacement, drawn
with the trainer's generator (the one its state file saves and restores, so a resumed run picks what
an uninterrupted one would have). When fewer fresh records exist the window fills the gap, so an idle
server still gets training on recent traffic.

Resume. ``resume`` rebuilds the pools by re-reading the newest segments up to the saved cursor, only as
many as the pools hold (those records count as already trained on, so none is fresh; retention may
have removed some), and tailing goes on after it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from pathlib import Path

import torch

from online_opd.config import OnlineOPDConfig
from online_opd.release.gate import held_out_key, is_held_out
from online_opd.traces.buffer import BufferReader, CorruptSegment
from online_opd.traces.records import SequenceRecord, check_fidelity
from online_opd.train.opd import replayable_blocks

logger = logging.getLogger(__name__)


class RecordPools:
    """The buffer's records as the online trainer trains on them: ``poll``, ``sample``, ``resume``.

    ``window`` (train, newest ``online.window_records``), ``fresh`` (the window's records no step has
    replayed yet, by id, oldest first) and ``held_out`` (the newest record of each of the newest
    ``gate.max_records`` held-out prompts, oldest first) are read by the
    trainer; ``cursor`` is the last buffer segment read. Not thread-safe (``len`` of the pools is).
    """

    def __init__(self, cfg: OnlineOPDConfig, buffer_dir: Path | str) -> None:
        self.cfg = cfg
        self.reader = BufferReader(buffer_dir)
        self.cursor: str | None = None
        self.window: deque[SequenceRecord] = deque(maxlen=cfg.online.window_records)
        self.fresh: OrderedDict[str, SequenceRecord] = OrderedDict()  # untrained records of the window
        self._held_out: OrderedDict[bytes, SequenceRecord] = OrderedDict()  # held-out key -> newest record
        self._warned_unusable = False

    @property
    def held_out(self) -> list[SequenceRecord]:
        """The gate's records: the newest of each held-out prompt, least recently seen prompt first."""
        return list(self._held_out.values())

    def poll(self, block_size: int) -> tuple[list[SequenceRecord], dict[str, int]]:
        """Read new buffer records into the pools. Returns the records kept (train + held-out, in buffer
        order) and the counts to add to the trainer's counters (``records_seen``, ``records_invalid``,
        ``records_unusable``; none before any server has captured anything)."""
        if not self.reader.exists():  # no server has captured anything yet
            return [], {}
        records, self.cursor = self.reader.tail(self.cursor, settle_s=self.cfg.online.settle_s)
        counts = {"records_seen": len(records), "records_invalid": 0, "records_unusable": 0}
        kept = []
        for record in records:
            verdict = self._route(record, block_size, fresh=True)
            if verdict == "kept":
                kept.append(record)
            else:
                counts[verdict] += 1
        if counts["records_unusable"] and not self.window and not self._warned_unusable:
            self._warned_unusable = True
            logger.warning("online trainer: %d records unusable (no block of 1..K=%d tokens and fewer than "
                           "two output tokens)", counts["records_unusable"], block_size)
        return kept, counts

    def _route(self, record: SequenceRecord, block_size: int, *, fresh: bool) -> str:
        """Put one record in its pool: "kept", or the counter it was dropped under."""
        if not replayable_blocks(record, block_size) and len(record.tokens) - record.prompt_len < 2:
            return "records_unusable"
        errors = check_fidelity(record)
        if errors:
            logger.warning("online trainer: dropping record %s: %s", record.record_id, "; ".join(errors[:3]))
            return "records_invalid"
        gate = self.cfg.gate
        if is_held_out(record, gate.held_out_fraction, gate.split_prefix_tokens):
            key = held_out_key(record, gate.split_prefix_tokens)  # the gate scores any K, walks a blockless one
            self._held_out.pop(key, None)
            self._held_out[key] = record
            if len(self._held_out) > gate.max_records:
                self._held_out.popitem(last=False)
            return "kept"
        if len(self.window) == self.window.maxlen:  # the oldest leaves the window, and with it fresh
            evicted = self.window[0]
            if self.fresh.get(evicted.record_id) is evicted:
                del self.fresh[evicted.record_id]
        self.window.append(record)
        if fresh:
            self.fresh[record.record_id] = record
        return "kept"

    def sample(self, generator: torch.Generator) -> list[SequenceRecord]:
        """This step's records: the fresh share newest first, the rest uniformly from the window, drawn
        with ``generator`` (the trainer's).

        The picked records stop being fresh here, before replay, so a record that makes replay fail
        is not picked again and again as the newest fresh one.
        """
        num = self.cfg.trainer.sequences_per_step
        num_fresh = min(len(self.fresh), round(num * self.cfg.online.fresh_fraction))
        picks = list(self.fresh.values())[len(self.fresh) - num_fresh:][::-1]
        window = list(self.window)
        picks += [window[i] for i in torch.randint(len(window), (num - num_fresh,), generator=generator)]
        for record in picks:
            self.fresh.pop(record.record_id, None)
        return picks

    def resume(self, cursor: str | None, block_size: int) -> list[SequenceRecord]:
        """Go on from a saved ``cursor`` (None: the buffer was never read): rebuild the pools up to it.
        Returns the records put back (oldest first)."""
        self.cursor = cursor
        return self._rebuild(cursor, block_size) if cursor is not None else []

    def _rebuild(self, cursor: str, block_size: int) -> list[SequenceRecord]:
        """Refill the pools from the segments up to ``cursor``, newest first, reading only as many
        segments as the pools hold; these records were trained on already, so none is fresh."""
        if not self.reader.exists():
            return []
        chunks: list[list[SequenceRecord]] = []
        gate = self.cfg.gate
        # held-out: read until max_records of its records (at most that many prompts; a prompt met
        # only further back is left out, so a resume reads a bounded share of the buffer)
        need_train, need_held_out = self.window.maxlen or 0, gate.max_records
        for info in reversed([s for s in self.reader.segments() if s.name <= cursor]):
            try:
                records = self.reader.read_segment(info)
            except (CorruptSegment, OSError):  # counted when it was first read; deleted since
                continue
            chunks.append(records)
            held = sum(is_held_out(r, gate.held_out_fraction, gate.split_prefix_tokens) for r in records)
            need_train, need_held_out = need_train - (len(records) - held), need_held_out - held
            if need_train <= 0 and need_held_out <= 0:
                break
        kept = []
        for records in reversed(chunks):
            kept += [r for r in records if self._route(r, block_size, fresh=False) == "kept"]
        return kept
