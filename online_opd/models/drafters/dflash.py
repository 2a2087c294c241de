"""DFlash-style block drafter in plain torch, in vLLM's `DFlashDraftModel` format.

The drafter reads the target's hidden states at `target_layer_ids` (id L is
the residual stream after layer L, i.e. HF `hidden_states[L + 1]`),
concatenates them, projects them with `fc` and `hidden_norm` into context
keys/values for every layer, and drafts a whole block in one forward:
query slots `[x_a, MASK, ..., MASK]` at positions `a, a+1, ..., a+K`, with
non-causal attention inside the block and causal access to the context
`0 .. a-1`. The K mask slots give the logits for positions `a+1 .. a+K`.
This mirrors `vllm/model_executor/models/qwen3_dflash.py` and
`vllm/v1/spec_decode/dflash.py` (context K/V pre-inserted from target
hidden states; bonus token plus mask tokens as queries).

Embeddings and LM head are the target's, attached with `attach_target` and
never saved. With `draft_vocab_size` the drafter scores only that many target
tokens (the most frequent in its training data): `lm_head.weight` (the
target's rows of them, frozen) and `d2t` (target id - draft index, vLLM's
format) are saved and vLLM loads them as the drafter's own head; the logits
still come out over the whole vocabulary, -inf outside the draft vocabulary,
as vLLM's `compute_logits` returns them. What lives elsewhere: checkpoint I/O (`checkpoint.py`),
the target forward (`online_opd/models/target_model.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from online_opd.models.drafters.layers import (
    GatedMLP,
    RMSNorm,
    SharedHeadDrafter,
    apply_rope,
    check_num_draft_tokens,
    grouped_attention,
    rope_cos_sin,
)


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int  # K, drafted tokens per block (vLLM num_speculative_tokens)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict)
    draft_vocab_size: int | None = None  # None = the target's vocabulary; else a d2t-mapped subset

    def to_hf_config(self) -> dict:
        """config.json that vLLM loads as a DFlash speculative model."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "online_opd": {"method": "dflash", **self.extra},
            **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size is not None else {}),
        }

    @staticmethod
    def block_size_from_hf_config(cfg: dict) -> int:
        """K as config.json stores it: the top-level `block_size` (8 when absent)."""
        return int(cfg.get("block_size") or 8)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DFlashConfig":
        dflash = cfg.get("dflash_config") or {}
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=cls.block_size_from_hf_config(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            extra={k: v for k, v in (cfg.get("online_opd") or {}).items() if k != "method"},
            draft_vocab_size=None if cfg.get("draft_vocab_size") in (None, cfg["vocab_size"])
            else int(cfg["draft_vocab_size"]),
        )

    def as_dict(self) -> dict:
        return asdict(self)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        # [N, num_heads * head_dim] -> [num_heads, N, head_dim]
        return x.view(x.shape[0], num_heads, self.cfg.head_dim).transpose(0, 1)

    def context_kv(
        self,
        ctx: torch.Tensor,  # [T, hidden], hidden_norm(fc(aux)) of context tokens
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context positions: k_norm + RoPE on K, no input_layernorm."""
        k = self.k_norm(self._heads(self.k_proj(ctx), self.cfg.num_kv_heads))
        v = self._heads(self.v_proj(ctx), self.cfg.num_kv_heads)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [Nq, hidden], normed query-slot states
        cos: torch.Tensor,  # [Nq, head_dim]
        sin: torch.Tensor,  # [Nq, head_dim]
        ctx_k: torch.Tensor,  # [num_kv_heads, T, head_dim]
        ctx_v: torch.Tensor,  # [num_kv_heads, T, head_dim]
        mask: torch.Tensor,  # [Nq, T + Nq] bool
    ) -> torch.Tensor:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.cfg.num_heads)), cos, sin)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.cfg.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.cfg.num_kv_heads)
        keys, values = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)
        out = grouped_attention(q, keys, values, mask)  # [num_heads, Nq, head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(SharedHeadDrafter):
    """Block drafter: one forward drafts K tokens for each of M anchors."""

    method = "dflash"
    config_cls = DFlashConfig

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        num_features = cfg.hidden_size * len(cfg.target_layer_ids)
        self.fc = nn.Linear(num_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._init_draft_vocab()  # saved, as vLLM loads them: lm_head.weight and d2t

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [T, len(target_layer_ids) * hidden], positions 0..T-1
        anchors: torch.Tensor,  # [M] int64, 1 <= a <= T
        anchor_tokens: torch.Tensor,  # [M] int64, token id at each anchor
        token_ids: torch.Tensor | None = None,  # [>= T] unused: DFlash reads only features
        draft_tokens: torch.Tensor | None = None,  # [M, K] unused: see below
        num_draft_tokens: int | None = None,  # K' in 1..K drafted per block; None = K
        draft_space: bool = False,
        block_widths: torch.Tensor | None = None,  # [M] int in 1..K': block m drafted from w_m mask slots
    ) -> torch.Tensor:
        """Draft logits [M, K', vocab] for positions a+1 .. a+K' of every anchor; with
        ``draft_space`` and a reduced vocabulary [M, K', draft_vocab_size], column i for target id
        ``draft_token_ids()[i]``: the same scores without the -inf columns, which training need not
        build (they were half of a 64-anchor SFT step's time at 8192 tokens).
        `token_ids` and `draft_tokens` keep the signature shared with EAGLE-3, which needs them:
        a DFlash block is drafted in one pass from [x_a, MASK x K'], so q at every position is
        conditioned on x_<=a alone and never on the drafts before it, logged or its own.
        ``num_draft_tokens``: vLLM drafts K' < K tokens with K' mask slots when the server asks
        for fewer (num_speculative_tokens_per_batch_size); the slots see each other, so a
        K'-block is not the first K' rows of a K-block. ``block_widths`` drafts block m as a
        w_m-block in the same pass (its slots beyond w_m hidden from the block): rows 1..w_m equal a
        separate ``num_draft_tokens=w_m`` forward, later rows are meaningless (training masks them)."""
        if self.embed_weight is None:
            raise RuntimeError("attach_target(embed, lm_head) before running the drafter")
        num_draft = check_num_draft_tokens(num_draft_tokens, self.cfg.block_size)
        cfg, num_blocks, width = self.cfg, anchors.shape[0], num_draft + 1
        num_ctx = aux_hidden.shape[0]
        ctx = self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))
        dtype, device = ctx.dtype, ctx.device
        ctx_cos, ctx_sin = rope_cos_sin(
            torch.arange(num_ctx, device=device), cfg.head_dim, cfg.rope_theta, dtype
        )
        offsets = torch.arange(width, device=device)
        positions = (anchors[:, None] + offsets[None, :]).reshape(-1)  # [M * (K+1)]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        ids = torch.full((num_blocks, width), cfg.mask_token_id, device=device)
        ids[:, 0] = anchor_tokens
        h = self.embed_weight[ids.reshape(-1)].to(dtype)
        if block_widths is not None and not (
                block_widths.shape == anchors.shape and bool(((block_widths >= 1) & (block_widths <= num_draft)).all())):
            raise ValueError(f"block_widths must be [M] = [{num_blocks}] widths in 1..{num_draft}")
        mask = block_attention_mask(anchors, num_ctx, width, block_widths)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
            h = layer(h, cos, sin, ctx_k, ctx_v, mask)
        h = self.norm(h).view(num_blocks, width, -1)[:, 1:].reshape(num_blocks * num_draft, -1)
        return self.head_logits(h, draft_space).view(num_blocks, num_draft, -1)

    @torch.no_grad()
    def propose(
        self,
        aux_hidden: torch.Tensor,  # [T, features]
        anchors: torch.Tensor,  # [M]
        anchor_tokens: torch.Tensor,  # [M]
        token_ids: torch.Tensor | None = None,  # [>= T]
        num_draft_tokens: int | None = None,  # K' in 1..K; None = K
    ) -> torch.Tensor:
        """Greedy blocks [M, K'], as vLLM's DFlash proposer drafts them."""
        return self(aux_hidden, anchors, anchor_tokens, token_ids, num_draft_tokens=num_draft_tokens).argmax(-1)


def block_attention_mask(
    anchors: torch.Tensor,  # [M]
    num_ctx: int,
    width: int,
    block_widths: torch.Tensor | None = None,  # [M] mask slots per block, 1..width-1; None = width-1
) -> torch.Tensor:
    """[M*width, num_ctx + M*width] bool: a slot of block m sees context
    positions < a_m and every slot of its own block (non-causal); with `block_widths`
    only the block's slots 0..w_m (the anchor token and w_m mask slots)."""
    device = anchors.device
    block_of_slot = torch.arange(anchors.shape[0], device=device).repeat_interleave(width)
    ctx_visible = torch.arange(num_ctx, device=device)[None, :] < anchors[block_of_slot][:, None]
    same_block = block_of_slot[:, None] == block_of_slot[None, :]
    if block_widths is not None:
        slot = torch.arange(width, device=device).repeat(anchors.shape[0])
        same_block &= (slot <= block_widths[block_of_slot])[None, :]
    return torch.cat([ctx_visible, same_block], dim=1)


def init_weights(module: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Deterministic random init: N(0, std) linears, ones for norms."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(module.named_parameters()):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
