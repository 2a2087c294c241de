"""Tests for the EAGLE-3 drafter (online_opd.models.drafters.eagle3).

Fast tests use a tiny random config. `naive_chain` is an independent
reference: it replays vLLM's proposer literally for one anchor (first pass
over the shifted sequence, then each draft step appended as a new row, the
whole causal stack recomputed every step instead of using a KV cache).
The slow test serves a saved checkpoint with vLLM's CPU engine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from online_opd.models.drafters.checkpoint import load_drafter, save_drafter
from online_opd.models.drafters.eagle3 import Eagle3Config, Eagle3Drafter, vllm_default_aux_layer_ids
from online_opd.models.drafters.layers import grouped_attention, rope_cos_sin
from online_opd.models.drafters.registry import drafter_class, drafter_class_for_config
from online_opd.opd.replay import replay_sequence, replay_sequence_naive
from online_opd.opd.specdec import target_generate
from online_opd.traces.records import BlockRecord
from tests.tiny import VOCAB as TINY_VOCAB
from tests.tiny import tiny_target

HIDDEN, VOCAB, NUM_AUX = 32, 97, 3


def tiny_cfg(num_layers: int = 1, block_size: int = 4) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=HIDDEN, num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=VOCAB, target_layer_ids=(0, 2, 4),
        block_size=block_size, rms_norm_eps=1e-5, rope_theta=10000.0,
    )


def tiny_drafter(num_layers: int = 1, block_size: int = 4, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(tiny_cfg(num_layers, block_size))
    with torch.no_grad():  # larger than init_weights' 0.02 so the drafts vary
        for name, p in drafter.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.3 * torch.randn_like(p))
    drafter.attach_target(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    return drafter


def tiny_inputs(length: int = 12, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(length, NUM_AUX * HIDDEN, generator=gen)
    tokens = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    return aux, tokens


@torch.no_grad()
def naive_chain(drafter: Eagle3Drafter, aux, tokens, anchor: int, fed=None) -> torch.Tensor:
    """[K, V] logits for one anchor, following vLLM's proposer step by step; `fed` (K ids) feeds
    step k+1 the logged draft d_k instead of the drafter's own argmax."""
    cfg = drafter.cfg
    g = drafter.fc(aux)
    # first pass rows t = 0..a-1: token x_{t+1} (x_a = the bonus token), hidden fc(aux_t)
    row_tokens = [int(tokens[t + 1]) for t in range(anchor)]
    row_hidden = [g[t] for t in range(anchor)]
    out = []
    for _ in range(cfg.block_size):
        n = len(row_tokens)
        cos, sin = rope_cos_sin(torch.arange(n), cfg.head_dim, cfg.rope_theta, g.dtype)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        embeds = drafter.embed_weight[torch.tensor(row_tokens)]
        hidden, residual = torch.stack(row_hidden), None
        for layer in drafter.layers:
            x, residual = layer.attn_input(embeds, hidden, residual)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            hidden, residual = layer.finish(
                layer.self_attn.out(grouped_attention(q, k, v, causal)), residual)
        prenorm = hidden + residual
        logits = drafter.norm(prenorm[-1]) @ drafter.lm_head_weight.T
        out.append(logits)
        row_tokens.append(int(logits.argmax()) if fed is None else int(fed[len(out) - 1]))  # next: the draft ...
        row_hidden.append(prenorm[-1])  # ... and own pre-norm hidden, one position on
    return torch.stack(out)


def test_config_json_fields_vllm_needs():
    cfg = tiny_cfg(block_size=5)
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["model_type"] == "llama"
    assert hf["draft_vocab_size"] == hf["vocab_size"] == VOCAB
    # vLLM aux id i = HF hidden_states[i]; ours L = hidden_states[L + 1]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert hf["eagle_config"]["use_aux_hidden_state"] is True
    assert hf["num_aux_hidden_states"] == 3
    assert hf["online_opd"] == {"method": "eagle3", "block_size": 5, "num_speculative_tokens": 5,
                                "target_layer_ids": [0, 2, 4]}
    assert "block_size" not in hf  # not a top-level key: vLLM reads it elsewhere
    assert Eagle3Config.from_hf_config(json.loads(json.dumps(hf))) == cfg
    # a config with only vLLM's ids converts back
    bare = {k: v for k, v in hf.items() if k != "online_opd"}
    assert Eagle3Config.from_hf_config(bare).target_layer_ids == (0, 2, 4)
    bad = dict(hf, eagle_aux_hidden_state_layer_ids=[0, 2, 4])
    with pytest.raises(ValueError, match="disagree"):
        Eagle3Config.from_hf_config(bad)


def test_default_aux_layers_match_vllm():
    # vLLM default (2, n//2, n-3) -> ours (1, n//2 - 1, n - 4)
    assert vllm_default_aux_layer_ids(30) == (1, 14, 26)
    assert [i + 1 for i in vllm_default_aux_layer_ids(32)] == [2, 16, 29]


def test_registry_and_from_target():
    assert drafter_class("eagle3") is Eagle3Drafter
    assert drafter_class_for_config(tiny_cfg().to_hf_config()) is Eagle3Drafter
    target_cfg = SimpleNamespace(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, vocab_size=VOCAB, num_hidden_layers=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        max_position_embeddings=512)
    dcfg = SimpleNamespace(method="eagle3", num_layers=1, block_size=3, target_layer_ids=None,
                           intermediate_size=None, seed=7, draft_vocab_size=None)
    a, b = Eagle3Drafter.from_target(dcfg, target_cfg), Eagle3Drafter.from_target(dcfg, target_cfg)
    assert a.target_layer_ids == (1, 3, 4)
    assert a.cfg.rope_theta == 5000.0 and a.cfg.intermediate_size == 64
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.all(a.layers[0].hidden_norm.weight == 1)
    dcfg.target_layer_ids = [0, 7]
    assert Eagle3Drafter.from_target(dcfg, target_cfg).cfg.to_hf_config()[
        "eagle_aux_hidden_state_layer_ids"] == [1, 8]


def test_state_dict_names_and_shapes():
    drafter = tiny_drafter(num_layers=2)
    names = set(drafter.state_dict())
    assert "fc.weight" in names and "norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared, never saved
    sd = drafter.state_dict()
    assert sd["fc.weight"].shape == (HIDDEN, NUM_AUX * HIDDEN)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (32, 2 * HIDDEN)  # cat(embeds, hidden)
    assert sd["layers.1.self_attn.q_proj.weight"].shape == (32, HIDDEN)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (16, 2 * HIDDEN)
    assert "layers.0.hidden_norm.weight" in names


@pytest.mark.parametrize("num_layers", [1, 2])
def test_forward_matches_naive_vllm_chain(num_layers):
    drafter = tiny_drafter(num_layers=num_layers)
    aux, tokens = tiny_inputs()
    anchors = torch.tensor([1, 4, 7, 12, 5])
    logits = drafter(aux, anchors, tokens[anchors], token_ids=tokens)
    assert logits.shape == (5, 4, VOCAB)
    for m, a in enumerate(anchors.tolist()):
        torch.testing.assert_close(logits[m], naive_chain(drafter, aux, tokens, a),
                                   atol=1e-4, rtol=1e-4)
    drafts = drafter.propose(aux, anchors, tokens[anchors], tokens)
    assert drafts.shape == (5, 4) and drafts.dtype == torch.int64
    assert torch.equal(drafts, logits.argmax(-1))
    assert len({tuple(r) for r in drafts.tolist()}) > 1  # the test is not vacuous


def test_propose_deterministic_and_batch_independent():
    drafter = tiny_drafter()
    aux, tokens = tiny_inputs()
    anchors = torch.tensor([3, 9, 6])
    first = drafter.propose(aux, anchors, tokens[anchors], tokens)
    assert torch.equal(first, drafter.propose(aux, anchors, tokens[anchors], tokens))
    for m, a in enumerate(anchors.tolist()):
        single = drafter.propose(aux[:a], torch.tensor([a]), tokens[[a]], tokens[:a])
        assert torch.equal(single[0], first[m])


def test_causality():
    """Drafts at anchor a depend on aux rows < a, tokens 1..a-1 and the anchor token only."""
    drafter = tiny_drafter()
    aux, tokens = tiny_inputs()
    anchors = torch.tensor([5, 8])
    base = drafter(aux, anchors, tokens[anchors], token_ids=tokens)
    a = 5
    aux2, tokens2 = aux.clone(), tokens.clone()
    aux2[a:] = torch.randn_like(aux2[a:])
    tokens2[a:] = (tokens2[a:] + 1) % VOCAB
    tokens2[0] = (tokens2[0] + 1) % VOCAB  # x_0 is never a drafter input
    out = drafter(aux2, anchors, tokens[anchors], token_ids=tokens2)  # same anchor tokens
    torch.testing.assert_close(out[0], base[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[1], base[1])
    # and it does depend on what is before the anchor
    aux3 = aux.clone()
    aux3[a - 2] += 1.0
    assert not torch.allclose(drafter(aux3, anchors, tokens[anchors], token_ids=tokens)[0], base[0])


def test_gradients_flow_through_chain():
    drafter = tiny_drafter()
    aux, tokens = tiny_inputs()
    anchors = torch.tensor([4, 10])
    logits = drafter(aux, anchors, tokens[anchors], token_ids=tokens)
    logits[:, -1].logsumexp(-1).sum().backward()  # last step only
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_needs_token_ids_for_context():
    drafter = tiny_drafter()
    aux, tokens = tiny_inputs()
    with pytest.raises(ValueError, match="token_ids"):
        drafter(aux, torch.tensor([4]), tokens[[4]])
    assert drafter(aux, torch.tensor([1]), tokens[[1]]).shape == (1, 4, VOCAB)  # no context


def test_save_load_round_trip(tmp_path):
    drafter = tiny_drafter(num_layers=2, block_size=3)
    aux, tokens = tiny_inputs()
    anchors = torch.tensor([2, 6, 11])
    path = save_drafter(drafter, tmp_path / "eagle3", step=3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["method"] == "eagle3"
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    loaded = load_drafter(path)
    assert isinstance(loaded, Eagle3Drafter) and loaded.cfg == drafter.cfg
    loaded.attach_target(drafter.embed_weight, drafter.lm_head_weight)
    torch.testing.assert_close(loaded(aux, anchors, tokens[anchors], token_ids=tokens),
                               drafter(aux, anchors, tokens[anchors], token_ids=tokens),
                               atol=0, rtol=0)


def test_replay_conditions_q_on_the_logged_drafts():
    """Draft-OPD scores q and p on one prefix (x, y<=a, d_<k): packed replay feeds EAGLE-3 step k the
    logged draft d_<k (here drafted by other weights), not its own argmax, exactly as a per-block
    reference (a target forward on x_<=a, then vLLM's chain fed the logged drafts) computes it."""
    target = tiny_target(0, num_layers=3, init_range=0.5)
    cfg = Eagle3Config(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=48, vocab_size=TINY_VOCAB, target_layer_ids=(0, 1, 2),
                       block_size=4, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(cfg)
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    tokens = torch.tensor(target_generate(target, [5, 17, 3, 42, 8, 29], 14))
    gen = torch.Generator().manual_seed(4)
    blocks = [BlockRecord(a, tuple(torch.randint(0, TINY_VOCAB, (4,), generator=gen).tolist()), 0)
              for a in (5, 9, 13)]
    packed = replay_sequence(target, drafter, tokens, blocks)
    own = drafter.propose(target.forward(tokens, cfg.target_layer_ids).aux_hidden,
                          torch.tensor([b.anchor for b in blocks]), tokens[[b.anchor for b in blocks]], tokens)
    assert any(tuple(own[m, :3].tolist()) != b.draft_tokens[:3] for m, b in enumerate(blocks))
    for m, block in enumerate(blocks):
        aux = target.forward(tokens[: block.anchor + 1], cfg.target_layer_ids).aux_hidden
        expected = naive_chain(drafter, aux, tokens, block.anchor, fed=block.draft_tokens)
        torch.testing.assert_close(packed.draft_logits[m], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed.draft_logits, replay_sequence_naive(target, drafter, tokens, blocks)
                               .draft_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eagle3", "eagle3-reduced"])
def test_vllm_serves_eagle3_checkpoint(tmp_path, variant):
    """vLLM's CPU engine loads a `save_drafter` EAGLE-3 checkpoint (briefly
    overfit on the prompt's greedy continuation, so some drafts are accepted)
    and drafts with it; every block it proposes equals `Eagle3Drafter.propose`
    on the same sequence, and its accepted count equals the one predicted
    from our drafts. "eagle3-reduced" drafts over a 256-token vocabulary: vLLM
    loads the saved head rows and d2t map as the drafter's own head, and each
    chained step takes the target id of the draft vocabulary's argmax."""
    from online_opd.models.target import ensure_embedded_target

    target = ensure_embedded_target()
    script = Path(__file__).parent / "helpers" / "vllm_parity_check.py"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(script), variant, str(target), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["info"]["model"] == "Eagle3LlamaForCausalLM"
    vocab = 256 if variant == "eagle3-reduced" else None
    assert result["draft_vocab_size"] == vocab
    assert result["served_head_rows"] == (vocab or 49152)  # vLLM's own reduced head, or the target's
    assert result["info"]["aux_layers"] == result["config_aux_ids"]  # vLLM took our explicit ids
    assert result["num_output_tokens"] > 0
    assert result["output_is_target_greedy"]  # spec decoding stays lossless at T=0
    spec = result["spec"]
    assert spec["num_drafts"] > 0
    assert spec["num_draft_tokens"] == spec["num_drafts"] * result["k"]
    assert result["num_compared"] >= 5 * result["k"]
    assert result["blocks_varying"] > 0.5  # the drafts are not one token repeated
    assert result["draft_match_rate"] >= 0.95, result["details"]
    assert result["anchor_chain_ok"]  # anchors advance by accepted + 1, as recorded
    assert spec["num_accepted_tokens"] > 0  # accepted-token paths exercised
    assert spec["num_accepted_tokens"] == result["predicted_accepted"]
