"""Building blocks shared by the drafter architectures, in plain torch.

Each block computes exactly what its vLLM counterpart computes (RMSNorm in
float32, neox-style RoPE, SiLU-gated MLP), so that a drafter trained here
proposes the same tokens when vLLM serves it. No vLLM imports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x -> w * x / sqrt(mean(x^2) + eps), computed in float32 like vLLM's."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); vLLM fuses gate/up into gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(
    positions: torch.Tensor,  # [N] int64
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, head_dim] for neox-style (rotate-half) RoPE."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(
    x: torch.Tensor,  # [num_heads, N, head_dim]
    cos: torch.Tensor,  # [N, head_dim]
    sin: torch.Tensor,  # [N, head_dim]
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def grouped_attention(
    q: torch.Tensor,  # [num_heads, Nq, head_dim]
    k: torch.Tensor,  # [num_kv_heads, Nk, head_dim]
    v: torch.Tensor,  # [num_kv_heads, Nk, head_dim]
    mask: torch.Tensor,  # [Nq, Nk] bool, True = may attend
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads: [num_heads, Nq, head_dim]."""
    repeat = q.shape[0] // k.shape[0]
    if repeat > 1:
        k = k.repeat_interleave(repeat, dim=0)
        v = v.repeat_interleave(repeat, dim=0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check_num_draft_tokens(num_draft_tokens: int | None, block_size: int) -> int:
    """K' tokens to draft per block: ``num_draft_tokens`` checked to lie in 1..K, or K when None."""
    if num_draft_tokens is None:
        return block_size
    if not 1 <= num_draft_tokens <= block_size:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} outside 1..K={block_size}: a drafter drafts "
                         "at most its block size (config block_size)")
    return int(num_draft_tokens)


class FrozenHead(nn.Module):
    """A reduced LM head: the target's rows of the draft vocabulary, a buffer (never trained) saved
    as ``lm_head.weight`` so that vLLM loads it as the drafter's own head."""

    def __init__(self, num_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_tokens, hidden_size))


def check_draft_vocab(token_ids: torch.Tensor, size: int, vocab_size: int) -> None:
    """ValueError unless `token_ids` are `size` ascending, unique target ids in 0..vocab_size-1."""
    if token_ids.shape != (size,):
        raise ValueError(f"draft vocabulary has {tuple(token_ids.shape)} ids, expected ({size},)")
    if size and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1}")
    if size > 1 and not bool((token_ids[1:] > token_ids[:-1]).all()):
        raise ValueError("draft vocabulary ids (arange + d2t) must be strictly ascending")


class SharedHeadDrafter(nn.Module):
    """Base of the drafters: reads target features at `cfg.target_layer_ids`
    and shares the target's embeddings and LM head (frozen buffers, never saved).

    With ``cfg.draft_vocab_size`` the drafter scores only that many target tokens (vLLM's
    ``draft_vocab_size``, DFlash and EAGLE-3 alike): its head is the target's rows of them
    (``lm_head.weight``, frozen, saved because vLLM loads it as the drafter's own head) and
    ``d2t`` maps draft index i to target id i + d2t[i]; logits come out over the whole
    vocabulary with -inf outside the draft vocabulary, as vLLM's ``compute_logits`` places them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("lm_head_weight", None, persistent=False)

    def _init_draft_vocab(self) -> None:
        """The reduced head and its d2t map when ``cfg.draft_vocab_size`` is set (after ``self.cfg``)."""
        cfg = self.cfg
        if cfg.draft_vocab_size is None:
            return
        if not 2 <= cfg.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} outside 2..vocab_size={cfg.vocab_size}")
        self.lm_head = FrozenHead(cfg.draft_vocab_size, cfg.hidden_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Feature layers in `TargetModel.forward(layer_ids=...)` convention."""
        return self.cfg.target_layer_ids

    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary, ascending ([draft_vocab_size]); None = whole vocabulary."""
        if self.cfg.draft_vocab_size is None:
            return None
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over `token_ids` (target ids, ascending, unique): d2t holds id - index (vLLM's format)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
        check_draft_vocab(token_ids, self.cfg.draft_vocab_size, self.cfg.vocab_size)
        self.d2t.copy_(token_ids - torch.arange(len(token_ids)))
        if self.lm_head_weight is not None:
            self.lm_head.weight.copy_(self.lm_head_weight[token_ids].to(self.lm_head.weight.dtype))

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's embeddings and LM head (frozen, never saved); a reduced head is the
        target's rows of the draft ids."""
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        if self.cfg.draft_vocab_size is not None:
            check_draft_vocab(self.draft_token_ids(), self.cfg.draft_vocab_size, self.cfg.vocab_size)
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_weight[self.draft_token_ids()].to(self.lm_head.weight.dtype))

    def head_logits(self, h: torch.Tensor, draft_space: bool = False) -> torch.Tensor:
        """Logits [N, vocab] of normed states `h` [N, hidden]; with a reduced vocabulary and
        ``draft_space`` [N, draft_vocab_size], column i for target id ``draft_token_ids()[i]``."""
        # 2-d GEMM: a batched matmul against a broadcast [V, H] weight is ~10x slower on CPU
        if self.cfg.draft_vocab_size is None:
            return F.linear(h, self.lm_head_weight.to(h.dtype))
        small = F.linear(h, self.lm_head.weight.to(h.dtype))
        if draft_space:
            return small
        full = small.new_full((small.shape[0], self.cfg.vocab_size), float("-inf"))
        return full.index_copy(1, self.draft_token_ids(), small)
