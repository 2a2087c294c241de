"""The target model as the trainer sees it: a transformers causal LM that
returns logits and the hidden states a drafter reads, for arbitrary
position ids and attention masks (so one forward can replay many blocks).

Layer id L means the residual stream after decoder layer L (HF
`hidden_states[L + 1]`), which is what vLLM hands a DFlash drafter for
`target_layer_ids` and an EAGLE-3 head for its aux layers (vLLM adds 1).
Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [N, vocab]
    aux_hidden: torch.Tensor  # [N, len(layer_ids) * hidden]


class TargetModel:
    """Frozen target LM with aux hidden-state capture."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config = model.config

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "TargetModel":
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation="sdpa"
        )
        return cls(model)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        """The logits' width: rows of the output projection (the captured teacher's ids index them)."""
        return self.lm_head_weight.shape[0]

    def _decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        layer_ids: tuple[int, ...] = (),
        position_ids: torch.Tensor | None = None,  # [N], default 0..N-1
        attention_mask: torch.Tensor | None = None,  # [N, N] bool, default causal
        logits_at: torch.Tensor | None = None,  # [P] row indices to project, default all
    ) -> TargetOutput:
        """One forward of a single (possibly packed) sequence."""
        num_tokens = input_ids.shape[0]
        if position_ids is None:
            position_ids = torch.arange(num_tokens, device=input_ids.device)
        if attention_mask is None:
            attention_mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril_()
        captured: dict[int, torch.Tensor] = {}
        hooks = [
            self._decoder_layers()[lid].register_forward_hook(_capture(captured, lid))
            for lid in layer_ids
        ]
        try:
            out = self.model.model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                attention_mask=attention_mask[None, None].to(input_ids.device),
                use_cache=False,
            )
        finally:
            for hook in hooks:
                hook.remove()
        hidden = out.last_hidden_state[0]
        if logits_at is not None:
            hidden = hidden[logits_at]
        logits = self.model.lm_head(hidden)
        if layer_ids:
            aux = torch.cat([captured[lid][0] for lid in layer_ids], dim=-1)
        else:
            aux = hidden.new_zeros(num_tokens, 0)
        return TargetOutput(logits=logits, aux_hidden=aux)


def _capture(store: dict[int, torch.Tensor], layer_id: int):
    def hook(_module, _inputs, output):
        store[layer_id] = output[0] if isinstance(output, tuple) else output

    return hook
