"""Which drafter `online-opd serve` starts with (serve/server.py ``resolve_drafter``): --drafter, else
the registry's current version, else drafter.init_from, else the bootstrap output, else a fresh
drafter warm-started from the target and published as v0001. Real tiny checkpoints, a real registry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from online_opd.config import load_config
from online_opd.files import sha256_file
from online_opd.models.drafters.checkpoint import load_drafter, save_drafter
from online_opd.release.registry import DrafterRegistry
from serve.server import resolve_drafter
from tests.tiny import VOCAB, tiny_drafter, tiny_target

MASK_ID = VOCAB - 2  # the one special token that is not eos, pad or unk


def _save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: t0..t59, then <unk>, <eos>, <mask>, <pad>."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 4)}
    vocab.update({"<unk>": VOCAB - 4, "<eos>": VOCAB - 3, "<mask>": MASK_ID, "<pad>": VOCAB - 1})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                        unk_token="<unk>", eos_token="<eos>", pad_token="<pad>",
                                        additional_special_tokens=["<mask>"])
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A saved tiny target (with a tokenizer) and three drafter checkpoints of it."""
    root = tmp_path_factory.mktemp("resolve")
    target = tiny_target(seed=1)
    target.model.save_pretrained(root / "target")
    _save_tokenizer(root / "target")
    drafters = {name: save_drafter(tiny_drafter(target, seed=seed), root / name, version=name)
                for name, seed in (("registered", 2), ("init", 3), ("bootstrapped", 4))}
    return {"target": root / "target", "target_model": target, **drafters}


def _config(tmp_path: Path, *overrides: str):
    return load_config(overrides=[f"serve.run_dir={tmp_path / 'serve'}", f"bootstrap.output_dir={tmp_path / 'boot'}",
                                  "drafter.num_layers=1", "drafter.block_size=4", *overrides])


def _with_bootstrap_output(world, tmp_path: Path) -> None:
    save_drafter(load_drafter(world["bootstrapped"]), tmp_path / "boot" / "drafter", version="bootstrap")


def _registered(world, cfg) -> DrafterRegistry:
    registry = DrafterRegistry(cfg.serve.registry)
    registry.promote(registry.publish(world["registered"]).version, reason="earlier run")
    return registry


def _same_weights(a: Path, b: Path) -> bool:
    return sha256_file(a / "model.safetensors") == sha256_file(b / "model.safetensors")


def test_explicit_drafter_comes_first_and_leaves_the_registry_alone(world, tmp_path, monkeypatch):
    cfg = _config(tmp_path, f"drafter.init_from={world['init']}")
    registry = _registered(world, cfg)
    monkeypatch.chdir(world["init"].parent)
    chosen = resolve_drafter(cfg, world["target"], Path(world["bootstrapped"].name), progress=False)
    assert chosen == world["bootstrapped"].resolve()  # a relative --drafter, resolved
    assert [v.version for v in registry.list()] == ["v0001"] and registry.current().version == "v0001"


def test_the_registry_current_version_comes_before_init_from_and_bootstrap(world, tmp_path):
    cfg = _config(tmp_path, f"drafter.init_from={world['init']}")
    _with_bootstrap_output(world, tmp_path)
    registry = _registered(world, cfg)
    registry.promote(registry.publish(world["init"]).version, reason="newer")  # v0002 serves
    assert resolve_drafter(cfg, world["target"], None, progress=False) == registry.path("v0002").resolve()
    assert len(registry.list()) == 2  # nothing published


def test_init_from_comes_before_the_bootstrap_output(world, tmp_path):
    cfg = _config(tmp_path, f"drafter.init_from={world['init']}")
    _with_bootstrap_output(world, tmp_path)
    chosen = resolve_drafter(cfg, world["target"], None, progress=False)
    current = DrafterRegistry(cfg.serve.registry).current()
    assert (current.version, current.status_reason) == ("v0001", f"initial drafter from {world['init']}")
    assert chosen == current.path.resolve() and _same_weights(chosen, world["init"])


def test_the_bootstrap_output_when_there_is_no_init_from(world, tmp_path):
    cfg = _config(tmp_path)
    _with_bootstrap_output(world, tmp_path)
    chosen = resolve_drafter(cfg, world["target"], None, progress=False)
    current = DrafterRegistry(cfg.serve.registry).current()
    assert current.version == "v0001" and chosen == current.path.resolve()
    assert _same_weights(chosen, tmp_path / "boot" / "drafter")


def test_else_a_fresh_drafter_warm_started_from_the_target_is_v0001(world, tmp_path):
    cfg = _config(tmp_path)
    (tmp_path / "boot" / "drafter").mkdir(parents=True)  # a bootstrap folder with no checkpoint in it
    chosen = resolve_drafter(cfg, world["target"], None, progress=False)
    current = DrafterRegistry(cfg.serve.registry).current()
    assert (current.version, current.status_reason, current.metrics) == \
        ("v0001", "initial fresh drafter", {"origin": "fresh"})
    drafter = load_drafter(chosen)
    assert drafter.cfg.mask_token_id == MASK_ID
    assert list(drafter.cfg.target_layer_ids) == [1]  # spread over 4 target layers: 1 .. 4 - 3
    assert drafter.cfg.block_size == 4
    # warm start: the target's final norm, and its layer after the deepest feature layer (layer 2)
    assert torch.equal(drafter.norm.weight, world["target_model"].model.model.norm.weight)
    source = world["target_model"].model.model.layers[2]
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, source.self_attn.q_proj.weight)


def test_a_fresh_reduced_vocabulary_drafter_saves_the_targets_rows_as_its_head(world, tmp_path):
    """drafter.draft_vocab_size: the fresh drafter's vocabulary is chosen (ShareGPT replies through the
    target's tokenizer, end-of-turn always in) and its saved head, which vLLM loads as the drafter's own,
    is the target's rows of it (it was left at zeros before the fresh path attached the target)."""
    cfg = _config(tmp_path, "drafter.draft_vocab_size=8")
    chosen = resolve_drafter(cfg, world["target"], None, progress=False)
    current = DrafterRegistry(cfg.serve.registry).current()
    assert current.metrics["origin"] == "fresh" and current.metrics["draft_vocab_size"] == 8
    assert current.metrics["draft_vocab_source"] == "ShareGPT replies"
    drafter = load_drafter(chosen)
    ids = drafter.draft_token_ids()
    assert len(ids) == 8 and VOCAB - 3 in ids.tolist()  # <eos>
    assert torch.equal(drafter.lm_head.weight, world["target_model"].lm_head_weight[ids])
