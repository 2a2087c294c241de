"""Build a fresh drafter for a target from the `drafter` config section."""

from __future__ import annotations

import torch
from torch import nn

from online_opd.config import DrafterConfig
from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.models.drafters.dflash import DFlashConfig, init_weights
from online_opd.models.drafters.registry import drafter_class


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Evenly spread layer ids from 1 to num_target_layers - 3 (DFlash's choice)."""
    low, high = 1, max(1, num_target_layers - 3)
    count = min(num_features, high - low + 1)
    if count == 1:
        return [low]
    return sorted({round(low + i * (high - low) / (count - 1)) for i in range(count)})


def choose_mask_token_id(tokenizer) -> int:
    """A special token the target never emits in chat: the highest-id special
    added token that is not bos/eos/pad/unk; else the last id of the vocabulary."""
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id,
                tokenizer.pad_token_id, tokenizer.unk_token_id}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates = [i for i, tok in added.items() if getattr(tok, "special", False) and i not in reserved]
    return max(candidates) if candidates else len(tokenizer) - 1


def new_drafter(cfg: DrafterConfig, target_config, tokenizer, target_model=None) -> nn.Module:
    """A drafter for `target_config` (a transformers config): from `cfg.init_from`
    when set, else randomly initialised with `cfg.seed` and, when `target_model`
    is given, warm-started from the target's weights (`init_from_target`). A reduced
    draft vocabulary starts as the first `draft_vocab_size` ids: choose it with
    ``set_draft_vocab`` (serve/pipeline.choose_draft_vocab)."""
    if cfg.init_from is not None:
        return load_drafter(cfg.init_from)
    if cfg.method != "dflash":
        return drafter_class(cfg.method).from_target(cfg, target_config)
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    dcfg = DFlashConfig(
        hidden_size=hidden,
        num_layers=cfg.num_layers,
        num_heads=heads,
        num_kv_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        intermediate_size=cfg.intermediate_size or target_config.intermediate_size,
        vocab_size=target_config.vocab_size,
        target_layer_ids=tuple(cfg.target_layer_ids
                               or default_target_layer_ids(target_config.num_hidden_layers)),
        mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None
        else choose_mask_token_id(tokenizer),
        block_size=cfg.block_size,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=float((getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 1e6)),
        max_position_embeddings=target_config.max_position_embeddings,
        draft_vocab_size=cfg.draft_vocab_size,
    )
    drafter = drafter_class("dflash")(dcfg)
    init_weights(drafter, seed=cfg.seed)
    if target_model is not None:
        init_from_target(drafter, target_model)
    return drafter


@torch.no_grad()
def init_from_target(drafter: nn.Module, target_model) -> None:
    """Warm start: the target's final norm (so logits through the shared LM head
    start at the target's scale), the target layers just after the deepest
    feature layer for the drafter's layers, and `fc` selecting that deepest
    feature, so context K/V start as the copied layer would compute them."""
    layers = target_model.model.model.layers
    deepest = drafter.cfg.target_layer_ids[-1]
    drafter.norm.weight.copy_(target_model.model.model.norm.weight)
    for i, layer in enumerate(drafter.layers):
        src = layers[min(deepest + 1 + i, len(layers) - 1)]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        layer.input_layernorm.weight.copy_(src.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
    first = layers[min(deepest + 1, len(layers) - 1)]
    drafter.hidden_norm.weight.copy_(first.input_layernorm.weight)
    hidden = drafter.cfg.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -hidden:] = torch.eye(hidden)
