"""Teacher-forced distillation on ShareGPT text (`online-opd bootstrap` with text_conversations):
the conversation loader, greedy labels from the feature pass, the on-path label mask, the config
and a text-only bootstrap on the embedded target (no vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from online_opd import data
from online_opd.config import ConfigError, load_config
from online_opd.data import is_held_out, load_conversations, load_prompts
from online_opd.train.sequences import TrainSequence, compute_aux_hidden, load_sequences, save_sequences
from online_opd.train.sft import block_labels, sft_loss
from tests.tiny import greedy_sequences, tiny_drafter, tiny_target

# position:   0  1  2  3   4   5   6   7
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
GREEDY = [5, 6, 7, 8, 20, 10, 11, 21]  # the text leaves the target's greedy path at 4 and at 7
ROOT = Path(__file__).resolve().parents[1]


def test_block_labels_follow_the_greedy_path_until_the_text_leaves_it():
    labels = block_labels(torch.tensor(TOKENS), torch.tensor([1, 3, 5]), 4, torch.tensor(GREEDY))
    assert labels.tolist() == [
        [7, 8, 20, -100],  # a=1: positions 2, 3 agree; 4 is supervised (greedy 20), 5 follows a miss
        [20, -100, -100, -100],  # a=3: position 4 always supervised, then off the path
        [11, 21, -100, -100],  # a=5: 6 agrees so 7 is supervised; 8, 9 past the end
    ]


def test_block_labels_on_a_greedy_rollout_equal_the_plain_ones():
    tokens = torch.tensor(TOKENS)
    anchors = torch.tensor([1, 3, 5, 6])
    assert torch.equal(block_labels(tokens, anchors, 4, tokens.clone()), block_labels(tokens, anchors, 4))


def test_labels_are_the_targets_argmax_and_equal_a_greedy_rollout():
    target = tiny_target()
    drafter = tiny_drafter(target)
    (tokens, prompt_len), = greedy_sequences(target, num=1, length=20)
    text = tokens.clone()
    text[10] = (text[10] + 1) % 64  # off the target's greedy path from position 10
    seqs = [TrainSequence(tokens, prompt_len), TrainSequence(text, prompt_len)]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, with_labels=True, progress=False)
    assert torch.equal(seqs[0].labels, tokens)
    full = target.forward(text).logits.argmax(-1)  # [T] the greedy next token after text[:t+1]
    expected = torch.cat([text[: prompt_len + 1], full[prompt_len:-1]])
    assert torch.equal(seqs[1].labels, expected)
    assert seqs[1].labels[10] == tokens[10] != text[10]


def test_labels_saved_and_loaded(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    seqs = [TrainSequence(t, p) for t, p in greedy_sequences(target, num=2, length=12)]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, with_labels=True, progress=False)
    seqs[1].labels[5] = 63
    save_sequences(tmp_path / "text.safetensors", seqs, drafter.target_layer_ids)
    back = load_sequences(tmp_path / "text.safetensors", drafter.target_layer_ids)
    assert all(torch.equal(a.labels, b.labels) for a, b in zip(seqs, back))
    assert back[1].labels[5] == 63
    seqs[0].labels = None
    with pytest.raises(ValueError, match="1 of 2 sequences have labels"):
        save_sequences(tmp_path / "mixed.safetensors", seqs, drafter.target_layer_ids)


def test_saved_features_are_shared_views_and_a_feature_pass_that_cannot_fit_is_refused(tmp_path):
    """After save_sequences each sequence's features are a view of the one saved tensor (the
    per-sequence copies are freed: a 4096-conversation text bootstrap was OOM-killed while saving 6.9
    GiB of features); check_feature_memory refuses, before any forward, what would not fit."""
    from online_opd.train.sequences import check_feature_memory, feature_bytes

    target = tiny_target()
    drafter = tiny_drafter(target)
    seqs = [TrainSequence(t, p) for t, p in greedy_sequences(target, num=3, length=12)]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, progress=False)
    before = [s.aux_hidden.clone() for s in seqs]
    save_sequences(tmp_path / "r.safetensors", seqs, drafter.target_layer_ids)
    base = seqs[0].aux_hidden.untyped_storage().data_ptr()
    assert all(s.aux_hidden.untyped_storage().data_ptr() == base for s in seqs)
    assert all(torch.equal(a, s.aux_hidden) for a, s in zip(before, seqs))
    back = load_sequences(tmp_path / "r.safetensors", drafter.target_layer_ids)
    assert all(torch.equal(a, b.aux_hidden) for a, b in zip(before, back))
    assert [p.name for p in tmp_path.iterdir()] == ["r.safetensors"]  # no temporary left
    num_features = before[0].shape[1]
    num_tokens = sum(s.num_tokens for s in seqs)
    need = 2 * feature_bytes(num_tokens, num_features)  # kept and saved
    check_feature_memory(seqs, num_features, "text features", available=int(need / 0.9) + 1)
    with pytest.raises(MemoryError, match=rf"text features \(x=1\): 3 sequences, {num_tokens} tokens x {num_features} features"):
        check_feature_memory(seqs, num_features, "text features (x=1)", available=need)


def test_sft_loss_masks_off_path_positions_and_reports_their_share():
    target = tiny_target()
    drafter = tiny_drafter(target)
    anchors = torch.tensor([1, 3, 5])
    plain = TrainSequence(torch.tensor(TOKENS), 1)
    compute_aux_hidden(target, [plain], drafter.target_layer_ids, progress=False)
    text = TrainSequence(plain.tokens, 1, plain.aux_hidden, labels=torch.tensor(GREEDY))
    loss, stats = sft_loss(drafter, text, anchors, decay=7.0)
    assert [stats[f"supervised_pos{k}"] for k in (1, 2, 3, 4)] == pytest.approx([1, 2 / 3, 1 / 3, 0])
    with torch.no_grad():
        logits = drafter(plain.aux_hidden[:5], anchors, plain.tokens[anchors], plain.tokens).float()
    labels = torch.tensor([[7, 8, 20, -100], [20, -100, -100, -100], [11, 21, -100, -100]])
    weights = torch.exp(-torch.arange(4.0) / 7.0)[None, :] * (labels != -100)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), ignore_index=-100,
                                           reduction="none").view(3, 4)
    assert float(loss.detach()) == pytest.approx(float((ce * weights).sum() / weights.sum()), rel=1e-5)
    same = TrainSequence(plain.tokens, 1, plain.aux_hidden, labels=plain.tokens.clone())
    with torch.no_grad():
        assert sft_loss(drafter, same, anchors, decay=7.0) == sft_loss(drafter, plain, anchors, decay=7.0)


def test_first_exchange_takes_the_reply_right_after_the_first_human_turn():
    turns = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
             {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"}]
    assert data._first_exchange({"conversations": turns}) == ("hi", "hello")
    assert data._first_exchange({"conversations": turns[:2] + turns[3:]}) == ("hi", "")
    assert data._first_exchange({"conversations": turns[:1]}) == ("", "")


def test_conversations_have_replies_and_respect_the_split():
    train = load_conversations(num_conversations=None)
    held_out = load_conversations(num_conversations=None, split="held_out")
    assert len(train) > 5000 and len(held_out) > 1000
    assert not any(is_held_out(c.id) for c in train) and all(is_held_out(c.id) for c in held_out)
    assert all(c.reply.strip() and c.prompt.strip() for c in train[:200])
    prompts = {p.id: p.messages[0]["content"] for p in load_prompts("sharegpt", num_prompts=None)}
    assert all(prompts[c.id] == c.prompt for c in train[:200])
    first = load_conversations(num_conversations=20, seed=3)
    assert first == load_conversations(num_conversations=40, seed=3)[:20]
    assert [c.id for c in first] != [c.id for c in load_conversations(num_conversations=20, seed=4)]


def test_bootstrap_without_rollouts_needs_text():
    with pytest.raises(ConfigError, match="text_conversations"):
        load_config(overrides=["bootstrap.rollouts=false"])
    assert load_config(overrides=["bootstrap.rollouts=false", "bootstrap.text_conversations=2"])


def test_text_only_bootstrap_trains_on_labelled_text_and_resumes(tmp_path, monkeypatch):
    from serve import pipeline
    from serve.pipeline import bootstrap

    cfg = load_config(ROOT / "configs/test-tiny.yaml", ["bootstrap.rollouts=false", "bootstrap.text_conversations=3",
                                                 "bootstrap.text_max_tokens=12", "bootstrap.num_steps=2"])
    drafter = bootstrap(cfg, tmp_path, progress=False)
    seqs = load_sequences(tmp_path / "text_sequences.safetensors")
    assert len(seqs) == 3 and not (tmp_path / "rollouts.safetensors").exists()
    assert all(s.num_tokens - s.prompt_len == 12 and s.labels is not None for s in seqs)
    assert all(torch.equal(s.labels[: s.prompt_len + 1], s.tokens[: s.prompt_len + 1]) for s in seqs)
    manifest = json.loads((drafter / "manifest.json").read_text())
    assert manifest["metrics"]["num_text_sequences"] == 3
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and metrics[0]["supervised_pos1"] == 1.0
    assert all(0 <= m["supervised_pos4"] <= m["supervised_pos2"] <= 1 for m in metrics)
    monkeypatch.setattr(pipeline, "compute_aux_hidden", _fail)  # resumed: the features file is reused
    longer = cfg.model_copy(update={"bootstrap": cfg.bootstrap.model_copy(update={"num_steps": 3})})
    bootstrap(longer, tmp_path, progress=False)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]


def test_feature_pass_runs_in_the_serving_dtype(tmp_path, monkeypatch):
    """bootstrap.feature_dtype auto = bfloat16 where the target serves in bfloat16 (the features vLLM
    serves with), else float32; an explicit value wins; the text bootstrap's target runs in it."""
    from serve import pipeline

    def dtype(*overrides):
        return pipeline.feature_dtype(load_config(ROOT / "configs/test-tiny.yaml", list(overrides)))

    assert dtype() == torch.float32  # test-tiny serves in float32
    assert dtype("model.dtype=bfloat16") == torch.bfloat16
    assert dtype("model.dtype=float16") == torch.float32
    assert dtype("model.dtype=bfloat16", "bootstrap.feature_dtype=float32") == torch.float32
    assert dtype("bootstrap.feature_dtype=bfloat16") == torch.bfloat16
    with pytest.raises(ConfigError, match="bootstrap.feature_dtype.*auto.*float32.*bfloat16"):
        dtype("bootstrap.feature_dtype=float16")
    loaded = []
    original = pipeline.TargetModel.from_pretrained

    def spy(path, dtype=torch.float32):
        loaded.append(dtype)
        return original(path, dtype=dtype)

    monkeypatch.setattr(pipeline.TargetModel, "from_pretrained", spy)
    cfg = load_config(ROOT / "configs/test-tiny.yaml", ["model.dtype=bfloat16", "bootstrap.rollouts=false",
                                                     "bootstrap.text_conversations=2", "bootstrap.text_max_tokens=8",
                                                     "bootstrap.num_steps=1"])
    pipeline.bootstrap(cfg, tmp_path, progress=False)
    assert loaded == [torch.float32, torch.bfloat16]  # the drafter's init from the target, then the feature pass
    seqs = load_sequences(tmp_path / "text_sequences.safetensors")
    assert len(seqs) == 2 and all(s.aux_hidden.dtype == torch.bfloat16 and s.labels is not None for s in seqs)


def _fail(*args, **kwargs):
    raise AssertionError("text features recomputed on resume")


@pytest.mark.slow
def test_bootstrap_mixes_rollouts_and_text_in_one_pool(tmp_path):
    """The CLI's bootstrap with both sources: rollouts from vLLM plus two labelled text sequences."""
    proc = subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", "bootstrap", "-c",
                           str(ROOT / "configs/test-tiny.yaml"), "--run-dir", str(tmp_path),
                           "bootstrap.text_conversations=2", "bootstrap.text_max_tokens=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rollouts = load_sequences(tmp_path / "sequences.safetensors")
    text = load_sequences(tmp_path / "text_sequences.safetensors")
    assert rollouts and all(s.labels is None for s in rollouts)
    assert len(text) == 2 and all(s.labels is not None for s in text)
    manifest = json.loads((Path(json.loads(proc.stdout)["drafter"]) / "manifest.json").read_text())
    assert (manifest["metrics"]["num_sequences"], manifest["metrics"]["num_text_sequences"]) == \
        (len(rollouts) + 2, 2)
