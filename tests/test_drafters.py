"""DFlash drafter: block semantics, checkpoint round trip, bad checkpoints, and what the
drafter registry reads from a saved config.json (method, block size) for both methods."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from online_opd.models.drafters.checkpoint import (
    CheckpointError,
    load_drafter,
    read_manifest,
    save_drafter,
    verify_checkpoint,
)
from online_opd.models.drafters.dflash import block_attention_mask
from online_opd.models.drafters.eagle3 import Eagle3Drafter
from online_opd.models.drafters.factory import default_target_layer_ids
from online_opd.models.drafters.registry import (
    block_size_for_config,
    drafter_class_for_config,
    method_for_config,
)
from tests.tiny import VOCAB, tiny_drafter, tiny_eagle3_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def features(target):
    tokens = torch.randint(0, VOCAB - 1, (40,), generator=torch.Generator().manual_seed(1))
    return tokens, target.forward(tokens, layer_ids=(0, 2)).aux_hidden


def test_block_mask_sees_context_before_anchor_and_own_block():
    mask = block_attention_mask(torch.tensor([2, 4]), num_ctx=5, width=2)
    assert mask.shape == (4, 5 + 4)
    assert mask[0, :5].tolist() == [True, True, False, False, False]
    assert mask[2, :5].tolist() == [True, True, True, True, False]
    assert mask[:, 5:].tolist() == [[True, True, False, False], [True, True, False, False],
                                    [False, False, True, True], [False, False, True, True]]


def test_packed_blocks_equal_single_blocks(target, features):
    tokens, aux = features
    drafter = tiny_drafter(target)
    anchors = torch.tensor([5, 11, 20, 33])
    packed = drafter(aux, anchors, tokens[anchors])
    assert packed.shape == (4, drafter.cfg.block_size, VOCAB)
    for i, a in enumerate(anchors.tolist()):
        single = drafter(aux[:a], anchors[i : i + 1], tokens[a : a + 1])
        torch.testing.assert_close(packed[i], single[0], atol=1e-5, rtol=1e-5)


def test_mixed_widths_in_one_pass_equal_narrow_blocks(target, features):
    """block_widths drafts block m from w_m mask slots in the same pass: its rows 1..w_m equal a
    separate num_draft_tokens=w_m forward (what vLLM drafts at K' = w_m), and differ from the first
    w_m rows of a full-width block (the slots see each other)."""
    tokens, aux = features
    drafter = tiny_drafter(target)
    K = drafter.cfg.block_size
    anchors, widths = torch.tensor([5, 11, 20, 33]), torch.tensor([1, K, 2, K - 1])
    mixed = drafter(aux, anchors, tokens[anchors], block_widths=widths)
    assert mixed.shape == (4, K, VOCAB)
    full = drafter(aux, anchors, tokens[anchors])
    for i, w in enumerate(widths.tolist()):
        narrow = drafter(aux, anchors[i : i + 1], tokens[anchors[i : i + 1]], num_draft_tokens=w)
        torch.testing.assert_close(mixed[i, :w], narrow[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed[0, :1], full[0, :1], atol=1e-4)  # one mask slot is not the first of K
    mask = block_attention_mask(torch.tensor([2, 4]), num_ctx=5, width=3, block_widths=torch.tensor([1, 2]))
    assert mask[:, 5:].tolist() == [[True, True, False, False, False, False]] * 3 + [
        [False, False, False, True, True, True]] * 3
    for bad in (torch.tensor([0, 1, 1, 1]), torch.tensor([1, K + 1, 1, 1]), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="block_widths"):
            drafter(aux, anchors, tokens[anchors], block_widths=bad)


def test_sft_on_narrow_blocks_supervises_only_their_positions(target, features):
    from online_opd.train.sequences import TrainSequence
    from online_opd.train.sft import narrow_block_widths, sft_loss

    gen = torch.Generator().manual_seed(0)
    assert narrow_block_widths(6, 4, 0.0, gen).tolist() == [4] * 6
    drawn = narrow_block_widths(2000, 4, 0.5, gen)
    assert set(drawn.tolist()) == {1, 2, 3, 4} and 0.45 < float((drawn < 4).float().mean()) < 0.55
    assert narrow_block_widths(5, 1, 1.0, gen).tolist() == [1] * 5  # K = 1 has no narrower width
    tokens, aux = features
    drafter = tiny_drafter(target)
    seq = TrainSequence(tokens, prompt_len=2)
    seq.aux_hidden = aux
    anchors = torch.tensor([5, 11, 20])
    _, stats = sft_loss(drafter, seq, anchors, decay=7.0, widths=torch.tensor([1, 1, 2]))
    assert stats["supervised_pos1"] == 1.0 and stats["supervised_pos2"] == pytest.approx(1 / 3)
    assert stats["supervised_pos3"] == 0.0
    _, full = sft_loss(drafter, seq, anchors, decay=7.0)
    assert full["supervised_pos3"] == 1.0


def test_draft_ignores_context_at_and_after_anchor(target, features):
    tokens, aux = features
    drafter = tiny_drafter(target)
    anchor = torch.tensor([15])
    noisy = aux.clone()
    noisy[15:] += torch.randn_like(noisy[15:])
    torch.testing.assert_close(drafter(aux, anchor, tokens[anchor]), drafter(noisy, anchor, tokens[anchor]))
    changed = aux.clone()
    changed[14] += 1.0
    assert not torch.allclose(drafter(aux, anchor, tokens[anchor]), drafter(changed, anchor, tokens[anchor]))


def test_save_load_round_trip_is_exact(tmp_path, target, features):
    tokens, aux = features
    drafter = tiny_drafter(target, seed=3)
    path = save_drafter(drafter, tmp_path / "v1", version="v1", step=7, metrics={"tau": 1.5})
    loaded = load_drafter(path)
    loaded.attach_target(target.embed_weight, target.lm_head_weight)
    anchors = torch.tensor([3, 9, 27])
    assert torch.equal(drafter(aux, anchors, tokens[anchors]), loaded(aux, anchors, tokens[anchors]))
    manifest = read_manifest(path)
    assert manifest["version"] == "v1" and manifest["step"] == 7 and manifest["method"] == "dflash"
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    hf = json.loads((path / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]}
    stored = load_file(path / "model.safetensors")
    assert not any("embed" in k or "lm_head" in k for k in stored), "shared tensors must not be saved"
    assert not list(tmp_path.glob(".v1.tmp-*")), "no temporary folder left behind"


def _corrupt(path, mutate):
    tensors = load_file(path / "model.safetensors")
    mutate(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    path = save_drafter(tiny_drafter(), tmp_path / "d")
    _corrupt(path, lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="layers.0.mlp.up_proj.weight"):
        load_drafter(path, verify_hashes=False)


def test_wrong_shape_is_named(tmp_path):
    path = save_drafter(tiny_drafter(), tmp_path / "d")
    _corrupt(path, lambda t: t.__setitem__("fc.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"fc.weight.*\(3, 3\)"):
        load_drafter(path, verify_hashes=False)


def test_hash_mismatch_and_truncation_are_refused(tmp_path):
    path = save_drafter(tiny_drafter(), tmp_path / "d")
    _corrupt(path, lambda t: t["norm.weight"].mul_(2))
    with pytest.raises(CheckpointError, match="sha256 of model.safetensors"):
        verify_checkpoint(path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_drafter(path, verify_hashes=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a drafter checkpoint"):
        load_drafter(tmp_path)


def test_default_layer_ids_spread():
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(4) == [1]


def test_method_and_block_size_are_read_from_a_saved_config(tmp_path, target):
    saved = {"dflash": save_drafter(tiny_drafter(target, block_size=3), tmp_path / "dflash"),
             "eagle3": save_drafter(tiny_eagle3_drafter(target, block_size=5), tmp_path / "eagle3")}
    dflash = json.loads((saved["dflash"] / "config.json").read_text())
    eagle3 = json.loads((saved["eagle3"] / "config.json").read_text())
    assert "block_size" not in eagle3  # EAGLE-3 keeps K under online_opd, not at the top level
    assert (method_for_config(dflash), block_size_for_config(dflash)) == ("dflash", 3)
    assert (method_for_config(eagle3), block_size_for_config(eagle3)) == ("eagle3", 5)
    assert drafter_class_for_config(eagle3) is Eagle3Drafter
    for config in ({"architectures": ["LlamaForCausalLM"]}, {}):
        with pytest.raises(ValueError, match=r"unsupported drafter architectures .*supported: "
                                             r"\['DFlashDraftModel', 'LlamaForCausalLMEagle3'\]"):
            method_for_config(config)
