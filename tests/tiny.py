"""Tiny random models for fast tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from online_opd.models.drafters.dflash import DFlashConfig, DFlashDrafter, init_weights
from online_opd.models.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from online_opd.models.target_model import TargetModel

VOCAB = 64


def tiny_target(seed: int = 0, *, num_layers: int = 4, init_range: float = 0.2) -> TargetModel:
    """Random Llama; a larger `init_range` gives peaked logits, so greedy
    decoding does not collapse into a loop."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=True, max_position_embeddings=512,
                      initializer_range=init_range)
    return TargetModel(LlamaForCausalLM(cfg))


def tiny_drafter(target: TargetModel | None = None, *, block_size: int = 4, seed: int = 0,
                 num_layers: int = 1, std: float = 0.2, draft_vocab: list[int] | None = None) -> DFlashDrafter:
    """`draft_vocab`: draft over these target ids only (a reduced vocabulary)."""
    cfg = DFlashConfig(hidden_size=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=VOCAB, target_layer_ids=(0, 2),
                       mask_token_id=VOCAB - 1, block_size=block_size, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=512,
                       draft_vocab_size=len(draft_vocab) if draft_vocab else None)
    drafter = DFlashDrafter(cfg)
    init_weights(drafter, std=std, seed=seed)
    target = target or tiny_target()
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    if draft_vocab:
        drafter.set_draft_vocab(torch.tensor(draft_vocab))
    return drafter


def tiny_eagle3_drafter(target: TargetModel | None = None, *, block_size: int = 4,
                        seed: int = 0) -> Eagle3Drafter:
    """An EAGLE-3 head over `tiny_target`'s layers 0, 1, 2 (vLLM aux ids 1, 2, 3)."""
    cfg = Eagle3Config(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=VOCAB, target_layer_ids=(0, 1, 2),
                       block_size=block_size, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=512)
    drafter = Eagle3Drafter(cfg)
    init_weights(drafter, seed=seed)
    target = target or tiny_target()
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    return drafter


def greedy_sequences(target: TargetModel, num: int = 3, length: int = 40, prompt_len: int = 3):
    """Target-greedy continuations of a few short prompts, as (tokens, prompt_len)."""
    out = []
    for start in range(num):
        tokens = [start + 1, 7, 11][:prompt_len]
        for _ in range(length):
            tokens.append(int(target.forward(torch.tensor(tokens)).logits[-1].argmax()))
        out.append((torch.tensor(tokens), prompt_len))
    return out


REPLAY_PROMPT = [5, 17, 3, 42, 8, 29]


def replay_models(block_size: int = 4) -> tuple[TargetModel, DFlashDrafter]:
    """The replay tests' pair: a 3-layer target with peaked logits and a DFlash drafter near zero."""
    target = tiny_target(0, num_layers=3, init_range=0.5)
    return target, tiny_drafter(target, block_size=block_size, seed=1, std=0.02)


def mixed_blocks(tokens: list[int], first_anchor: int) -> list:
    """Blocks over a greedy ``tokens`` of K_m = 4, 2, 1, 3, 4 tokens (r = 1, 2, 0, 3, 2), drafts wrong after r,
    with 0, 2, 0, 1, 0 plain steps before the next block."""
    from online_opd.traces.records import BlockRecord

    blocks, anchor = [], first_anchor
    for length, r, plain in ((4, 1, 0), (2, 2, 2), (1, 0, 0), (3, 3, 1), (4, 2, 0)):
        truth = tokens[anchor + 1: anchor + 1 + length]
        draft = truth[:r] + [(t + 1) % VOCAB for t in truth[r:]]
        blocks.append(BlockRecord(anchor=anchor, draft_tokens=tuple(draft), num_accepted=r))
        anchor += r + 1 + plain
    return blocks
