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


class SharedHeadDrafter(nn.Module):
    """Base of the drafters: reads target features at `cfg.target_layer_ids`
    and shares the target's embeddings and LM head (frozen buffers, never saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("lm_head_weight", None, persistent=False)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Feature layers in `TargetModel.forward(layer_ids=...)` convention."""
        return self.cfg.target_layer_ids

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's embeddings and LM head (frozen, never saved)."""
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
