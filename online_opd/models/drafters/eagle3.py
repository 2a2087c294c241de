"""EAGLE-3 drafter in plain torch, in vLLM's `LlamaForCausalLMEagle3` format.

What vLLM 0.32 computes (`vllm/model_executor/models/llama_eagle3.py`,
`vllm/v1/spec_decode/llm_base_proposer.py`), and what this module mirrors:

* Aux hidden states. The target returns the residual stream at the aux
  layer ids of the draft config (`eagle_aux_hidden_state_layer_ids`, vLLM
  convention: id i = HF `hidden_states[i]`, i.e. 0 = embeddings, i = output
  of decoder layer i-1; see `_maybe_add_hidden_state` in
  `vllm/model_executor/models/interfaces.py`, called with `idx + 1` after
  layer `idx`). Here `target_layer_ids` uses the project's convention (layer
  id L = output of decoder layer L = HF `hidden_states[L + 1]`, as in
  `TargetModel.forward(layer_ids=...)` and DFlash), so config.json stores
  `eagle_aux_hidden_state_layer_ids = [L + 1 for L in target_layer_ids]`.
  vLLM sorts the ids and concatenates in ascending layer order; ours must be
  sorted ascending too. vLLM's default when the config has none is
  `(2, n // 2, n - 3)` (`get_eagle3_default_aux_hidden_state_layers`), i.e.
  `(1, n // 2 - 1, n - 4)` here; we always write the ids explicitly.
  `fc` maps the concatenated aux states (3 x hidden) to the drafter hidden.

* Layer 0 (`midlayer`, saved here as `layers.0`): `qkv` reads
  `cat([input_layernorm(embed(x)), hidden_norm(h)])` (2 x hidden), the
  residual stream starts at `h` (un-normed; `norm_before_residual` off);
  then attention (Llama: neox RoPE, no q/k norm), `post_attention_layernorm`
  with the residual add, gated MLP. Further layers (if any) are plain Llama
  layers on the residual stream. The model returns `norm(residual)` (for the
  logits) and the pre-norm residual (fed back as the next step's `h`).

* First pass (teacher-forced, every verified position t): token input is
  shifted by one, `x_{t+1}`, hidden input `fc(aux_t)`, RoPE position `t`;
  at the last verified position `a - 1` the token is the bonus token `x_a`
  (the target's sample there). Its output at `a - 1` gives draft 1 (the
  token at `a + 1`), and its pre-norm hidden at `a - 1` is kept.

* Draft step j = 1 .. K-1: token input = draft j (argmax), hidden input =
  the pre-norm hidden of the previous step, position `a - 1 + j`; the query
  attends to the drafter's KV cache: the first pass at positions `< a` and
  the previous draft steps. Output = draft j+1 (token at `a + 1 + j`).

So with this project's anchor convention (anchor a: last verified token
`x_a`, context = target aux at positions `< a`, drafts for `a+1 .. a+K`),
the chain slot j sits at position `a - 1 + j`; slot 0 takes
`(x_a, fc(aux_{a-1}))`; the shared context is positions `0 .. a-2` with
inputs `(x_{t+1}, fc(aux_t))`, which needs the context *tokens* as well as
the aux states: pass `token_ids` (the sequence, aligned with aux rows).

Embeddings and LM head are the target's, attached with `attach_target` and
never saved: vLLM's Eagle3 loader marks `has_own_lm_head` /
`has_own_embed_tokens` only when the checkpoint carries them, and the
proposer (`_maybe_share_embeddings` / `_maybe_share_lm_head`) shares the
target's otherwise. With `draft_vocab_size` (`SharedHeadDrafter`) the head is
the target's rows of the draft vocabulary, saved as `lm_head.weight` with its
`d2t` map, which vLLM's loader reads as the drafter's own head
(`draft_id_to_target_id`); `compute_logits` places its logits at their target
ids, -inf elsewhere, so the chain feeds each step the target id of the
draft-vocabulary argmax.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from online_opd.models.drafters.dflash import init_weights
from online_opd.models.drafters.layers import (
    GatedMLP,
    RMSNorm,
    SharedHeadDrafter,
    apply_rope,
    check_num_draft_tokens,
    grouped_attention,
    rope_cos_sin,
)


def vllm_default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers `(2, n//2, n-3)` converted to this
    project's convention (id L = output of layer L = HF hidden_states[L+1])."""
    n = num_target_layers
    return tuple(sorted({i - 1 for i in (2, n // 2, n - 3) if 1 <= i <= n}))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]  # project convention: HF hidden_states[L + 1]
    block_size: int  # K, drafted tokens per step (vLLM num_speculative_tokens)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    draft_vocab_size: int | None = None  # None = the target's vocabulary; else a d2t-mapped subset
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.target_layer_ids)
        if not ids or min(ids) < 0 or any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be non-empty, unique, ascending, >= 0: {ids}")
        object.__setattr__(self, "target_layer_ids", ids)

    @property
    def vllm_aux_layer_ids(self) -> list[int]:
        """`eagle_aux_hidden_state_layer_ids` (vLLM: id i = HF hidden_states[i])."""
        return [i + 1 for i in self.target_layer_ids]

    def to_hf_config(self) -> dict:
        """config.json that vLLM loads as an EAGLE-3 speculative model."""
        aux_ids = self.vllm_aux_layer_ids
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "target_hidden_size": self.hidden_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "num_aux_hidden_states": len(aux_ids),
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": aux_ids,
                "use_aux_hidden_state": True,
            },
            "online_opd": {
                "method": "eagle3",
                "block_size": self.block_size,
                "num_speculative_tokens": self.block_size,
                "target_layer_ids": list(self.target_layer_ids),
                **self.extra,
            },
        }

    @staticmethod
    def block_size_from_hf_config(cfg: dict) -> int:
        """K as config.json stores it: `online_opd.block_size` (vLLM reads no top-level
        `block_size` for EAGLE-3), else `online_opd.num_speculative_tokens`, else 8."""
        ours = cfg.get("online_opd") or {}
        return int(ours.get("block_size") or ours.get("num_speculative_tokens") or 8)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "Eagle3Config":
        ours = dict(cfg.get("online_opd") or {})
        aux_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (
            (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        if "target_layer_ids" in ours:
            layer_ids = tuple(ours["target_layer_ids"])
            if aux_ids and [i + 1 for i in layer_ids] != list(aux_ids):
                raise ValueError(
                    f"online_opd.target_layer_ids {list(layer_ids)} disagree with "
                    f"eagle_aux_hidden_state_layer_ids {list(aux_ids)} (expected ids + 1)")
        elif aux_ids:
            layer_ids = tuple(i - 1 for i in aux_ids)
        else:
            raise ValueError("EAGLE-3 config.json needs explicit eagle_aux_hidden_state_layer_ids")
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            target_layer_ids=layer_ids,
            block_size=cls.block_size_from_hf_config(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            draft_vocab_size=None if cfg.get("draft_vocab_size") in (None, cfg["vocab_size"])
            else int(cfg["draft_vocab_size"]),
            extra={k: v for k, v in ours.items()
                   if k not in ("method", "block_size", "num_speculative_tokens", "target_layer_ids")},
        )

    def as_dict(self) -> dict:
        return asdict(self)


class Eagle3Attention(nn.Module):
    """Llama attention (no q/k norm); layer 0 reads 2 x hidden inputs."""

    def __init__(self, cfg: Eagle3Config, input_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(input_size, q_size, bias=False)
        self.k_proj = nn.Linear(input_size, kv_size, bias=False)
        self.v_proj = nn.Linear(input_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        # [N, num_heads * head_dim] -> [num_heads, N, head_dim]
        return x.view(x.shape[0], num_heads, self.cfg.head_dim).transpose(0, 1)

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [H, N, d], k/v [Hkv, N, d] with RoPE on q and k."""
        q = apply_rope(self._heads(self.q_proj(x), self.cfg.num_heads), cos, sin)
        k = apply_rope(self._heads(self.k_proj(x), self.cfg.num_kv_heads), cos, sin)
        return q, k, self._heads(self.v_proj(x), self.cfg.num_kv_heads)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        # [H, N, d] -> [N, hidden]
        return self.o_proj(attn.transpose(0, 1).reshape(attn.shape[1], -1))


class Eagle3Layer(nn.Module):
    """vLLM's `llama_eagle3.LlamaDecoderLayer`. Every layer carries
    `hidden_norm` (vLLM builds it in each layer), only layer 0 uses it."""

    def __init__(self, cfg: Eagle3Config, layer_idx: int) -> None:
        super().__init__()
        self.first = layer_idx == 0
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, (2 if self.first else 1) * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def attn_input(self, embeds, hidden, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) as vLLM forms them before self_attn."""
        if self.first:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
            return x, hidden
        residual = hidden + residual
        return self.input_layernorm(residual), residual

    def finish(self, attn_out, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual) after the attention output."""
        residual = attn_out + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3Drafter(SharedHeadDrafter):
    """EAGLE-3 head: K autoregressive greedy drafts per anchor, as vLLM chains them."""

    method = "eagle3"
    config_cls = Eagle3Config

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.hidden_size * len(cfg.target_layer_ids), cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._init_draft_vocab()  # saved, as vLLM loads them: lm_head.weight and d2t

    @classmethod
    def from_target(cls, drafter_cfg, target_config) -> "Eagle3Drafter":
        """Random init (seeded) for a transformers `target_config`, from the
        `drafter` config section (`online_opd.config.DrafterConfig`)."""
        hidden, heads = target_config.hidden_size, target_config.num_attention_heads
        rope = getattr(target_config, "rope_parameters", None) or {}
        layer_ids = drafter_cfg.target_layer_ids or vllm_default_aux_layer_ids(
            target_config.num_hidden_layers)
        if max(layer_ids) >= target_config.num_hidden_layers:
            raise ValueError(f"target_layer_ids {list(layer_ids)} out of range for a "
                             f"{target_config.num_hidden_layers}-layer target")
        cfg = Eagle3Config(
            hidden_size=hidden,
            num_layers=drafter_cfg.num_layers,
            num_heads=heads,
            num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
            intermediate_size=drafter_cfg.intermediate_size or target_config.intermediate_size,
            vocab_size=target_config.vocab_size,
            target_layer_ids=tuple(layer_ids),
            block_size=drafter_cfg.block_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=target_config.max_position_embeddings,
            draft_vocab_size=drafter_cfg.draft_vocab_size,
        )
        drafter = cls(cfg)
        init_weights(drafter, seed=drafter_cfg.seed)
        return drafter



    def _run_layers(self, embeds, hidden, cos, sin, attend):
        """One pass of all layers over rows `embeds/hidden`; `attend(i, q, k, v)`
        does layer i's attention (and caches k/v). Returns (normed, prenorm)."""
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer.attn_input(embeds, hidden, residual)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            hidden, residual = layer.finish(layer.self_attn.out(attend(i, q, k, v)), residual)
        prenorm = hidden + residual
        return self.norm(prenorm), prenorm

    def _context_kv(self, g, token_ids, num_ctx: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """First pass over the shared context, (x_{t+1}, fc(aux_t)) at position t, causal:
        per layer its K and V [Hkv, num_ctx, d] (empty when there is no context)."""
        cfg, device = self.cfg, g.device
        if num_ctx == 0:
            empty = g.new_zeros(cfg.num_kv_heads, 0, cfg.head_dim)
            return [empty] * cfg.num_layers, [empty] * cfg.num_layers
        ctx_k: list[torch.Tensor] = []
        ctx_v: list[torch.Tensor] = []
        cos, sin = rope_cos_sin(torch.arange(num_ctx, device=device), cfg.head_dim, cfg.rope_theta, g.dtype)
        causal = torch.ones(num_ctx, num_ctx, dtype=torch.bool, device=device).tril_()

        def attend_ctx(i, q, k, v):
            ctx_k.append(k)
            ctx_v.append(v)
            return grouped_attention(q, k, v, causal)

        self._run_layers(self.embed_weight[token_ids[1 : num_ctx + 1]].to(g.dtype), g[:num_ctx], cos, sin,
                         attend_ctx)
        return ctx_k, ctx_v

    def forward_chain(
        self,
        aux_hidden: torch.Tensor,  # [T, len(target_layer_ids) * hidden], positions 0..T-1
        anchors: torch.Tensor,  # [M] int64, 1 <= a <= T
        anchor_tokens: torch.Tensor,  # [M] int64, token x_a at each anchor
        token_ids: torch.Tensor | None = None,  # [>= max(a)] sequence tokens, token_ids[t] = x_t
        draft_tokens: torch.Tensor | None = None,  # [M, K'] logged drafts d_1..d_K' (replay)
        num_draft_tokens: int | None = None,  # K' in 1..K chained steps; None = K
        draft_space: bool = False,
    ) -> torch.Tensor:
        """Draft logits [M, K', vocab] for positions a+1 .. a+K' of every anchor. Step k+1 is fed
        the drafter's own pre-norm hidden and the token d_k: the logged draft when
        ``draft_tokens`` is given, so q_k = q(. | x_<=a, d_<k) sits on the prefix the target
        verified (Draft-OPD eq. 10-13), else the drafter's own greedy draft (vLLM's proposer).
        The chain is causal: K' steps give the first K' rows of K steps. With ``draft_space`` and a
        reduced vocabulary [M, K', draft_vocab_size], column i for target id ``draft_token_ids()[i]``."""
        if self.embed_weight is None:
            raise RuntimeError("attach_target(embed, lm_head) before running the drafter")
        cfg, num_anchors, device = self.cfg, anchors.shape[0], anchors.device
        num_draft = check_num_draft_tokens(num_draft_tokens, cfg.block_size)
        draft_ids = self.draft_token_ids()
        if num_anchors == 0:
            width = cfg.vocab_size if draft_ids is None or not draft_space else len(draft_ids)
            return self.fc.weight.new_zeros(0, num_draft, width)
        max_anchor = int(anchors.max())
        if int(anchors.min()) < 1 or max_anchor > aux_hidden.shape[0]:
            raise ValueError(f"anchors must lie in [1, {aux_hidden.shape[0]}]")
        if draft_tokens is not None and tuple(draft_tokens.shape) != (num_anchors, num_draft):
            raise ValueError(f"draft_tokens must be [M, K'] = [{num_anchors}, {num_draft}], "
                             f"got {list(draft_tokens.shape)}")
        num_ctx = max_anchor - 1  # shared context rows: positions 0 .. max(a) - 2
        if num_ctx > 0 and (token_ids is None or token_ids.shape[0] < max_anchor):
            raise ValueError(
                "EAGLE-3 needs the context tokens: pass token_ids (the sequence, aligned "
                f"with aux_hidden rows, at least max(anchors) = {max_anchor} long)")
        g = self.fc(aux_hidden[:max_anchor].to(self.fc.weight.dtype))  # [max(a), hidden]
        dtype, embed = g.dtype, self.embed_weight
        ctx_k, ctx_v = self._context_kv(g, token_ids, num_ctx)

        # Chain: slot j of anchor a at position a-1+j sees context t < a-1 and its slots 0..j.
        ctx_visible = torch.arange(num_ctx, device=device)[None, :] < (anchors[:, None] - 1)
        own = torch.eye(num_anchors, dtype=torch.bool, device=device)
        chain_k: list[list[torch.Tensor]] = [[] for _ in self.layers]
        chain_v: list[list[torch.Tensor]] = [[] for _ in self.layers]
        tokens, hidden = anchor_tokens, g[anchors - 1]
        logits = []
        for step in range(num_draft):
            cos, sin = rope_cos_sin(anchors - 1 + step, cfg.head_dim, cfg.rope_theta, dtype)
            mask = torch.cat([ctx_visible, own.repeat(1, step + 1)], dim=1)

            def attend_chain(i, q, k, v):
                chain_k[i].append(k)
                chain_v[i].append(v)
                keys = torch.cat([ctx_k[i], *chain_k[i]], dim=1)
                values = torch.cat([ctx_v[i], *chain_v[i]], dim=1)
                return grouped_attention(q, keys, values, mask)

            normed, hidden = self._run_layers(embed[tokens].to(dtype), hidden, cos, sin,
                                              attend_chain)
            step_logits = self.head_logits(normed, draft_space=draft_ids is not None)  # [M, vocab or V']
            logits.append(step_logits)
            if draft_tokens is not None:
                tokens = draft_tokens[:, step]
            else:  # greedy; in a reduced vocabulary the argmax's target id (vLLM's -inf elsewhere)
                best = step_logits.detach().argmax(-1)
                tokens = best if draft_ids is None else draft_ids[best]
        out = torch.stack(logits, dim=1)  # [M, K', vocab or V']
        if draft_ids is None or draft_space:
            return out
        full = out.new_full((num_anchors, num_draft, cfg.vocab_size), float("-inf"))
        return full.index_copy(2, draft_ids, out)

    forward = forward_chain

    @torch.no_grad()
    def propose(
        self,
        aux_hidden: torch.Tensor,  # [T, features]
        anchors: torch.Tensor,  # [M]
        anchor_tokens: torch.Tensor,  # [M]
        token_ids: torch.Tensor | None = None,  # [>= max(a)]
        num_draft_tokens: int | None = None,  # K' in 1..K; None = K
    ) -> torch.Tensor:
        """Greedy drafts [M, K'], as vLLM's EAGLE proposer chains them."""
        return self.forward_chain(aux_hidden, anchors, anchor_tokens, token_ids,
                                  num_draft_tokens=num_draft_tokens).argmax(-1)
