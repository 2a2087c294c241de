"""Reference speculative decoding in plain torch, with block records.

For offline rollouts and tests: the same semantics as vLLM's DFlash proposer
plus its rejection sampler, written for clarity, not speed (every target
forward recomputes the whole prefix; no KV cache). Serving is vLLM's job.

The loop:

1. Target forward on the prompt, sample x_P at P = prompt_len (the first
   output token, the "bonus" token of the prefill step).
2. Anchor a = index of the last verified token. The drafter proposes K
   tokens greedily (argmax of its logits) from the target's aux hidden
   states at positions 0..a-1 and the token x_a.
3. One target forward over tokens[:a+1] + draft gives p(. | x_<=a, d_<k) for
   k = 1..K+1 and the aux hidden states for the next block.
4. Accept r drafts (greedy match at T = 0, rejection sampling at T > 0),
   append them and one target-chosen token, record BlockRecord(a, d, r).

What lives elsewhere: the drafter (online_opd/models/drafters), the target
wrapper (online_opd/models/target_model.py), replay of records (replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from online_opd.models.target_model import TargetModel
from online_opd.traces.records import BlockRecord, SequenceRecord


@dataclass
class SpecDecodeResult:
    tokens: list[int]  # [T] prompt + output ids
    prompt_len: int
    blocks: list[BlockRecord] = field(default_factory=list)  # in drafting order
    num_target_forwards: int = 0

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def to_record(
        self,
        *,
        record_id: str,
        model_id: str,
        drafter_version: str,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> SequenceRecord:
        """The sequence record a serving engine would have captured."""
        return SequenceRecord(
            record_id=record_id, model_id=model_id, drafter_version=drafter_version,
            temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
            tokens=tuple(self.tokens), prompt_len=self.prompt_len, blocks=tuple(self.blocks),
        )


def processed_probs(
    logits: torch.Tensor,  # [N, vocab]
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """Sampling distribution [N, vocab] as vLLM's sampler builds it (T > 0):
    softmax of logits / T restricted to the top-k tokens (k = 0: off) and
    then to the smallest top set whose probability mass reaches top_p."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Sort ascending; drop tokens whose cumulative mass (from the least
        # likely upward) is <= 1 - top_p; the most likely token always stays.
        sorted_logits, order = logits.sort(dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:  # probs: [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(
    draft: torch.Tensor,  # [K] drafted ids
    target_logits: torch.Tensor,  # [K+1, vocab], row k = logits after d_<k
) -> tuple[int, int]:
    """(r, next token): accept while d_k == argmax p_k; then the target's
    argmax at the first mismatch, or the bonus argmax p_{K+1} after K accepts."""
    choice = target_logits.argmax(-1)  # [K+1]
    mismatch = (draft != choice[:-1]).nonzero()
    r = int(mismatch[0]) if mismatch.numel() else draft.shape[0]
    return r, int(choice[r])


def verify_rejection(
    draft: torch.Tensor,  # [K] drafted ids
    probs: torch.Tensor,  # [K+1, vocab] processed target probabilities p_k
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(r, next token) by rejection sampling with a greedy (one-hot) draft q.

    Accept d_k with probability min(1, p(d_k) / q(d_k)) = p(d_k), since
    q(d_k) = 1. On the first rejection sample from the residual
    normalize(max(p - q, 0)) = p with d_k zeroed, renormalised. After K
    accepts sample the bonus token from p_{K+1}. The output is then
    distributed exactly as sampling from p (lossless).
    """
    num_draft = draft.shape[0]
    for k in range(num_draft):
        p = probs[k]
        u = torch.rand((), generator=generator, device=p.device)
        if u < p[draft[k]]:  # accept with probability p(d_k)
            continue
        residual = p.clone()
        residual[draft[k]] = 0.0  # max(p - onehot(d_k), 0)
        if residual.sum() <= 0:  # p was one-hot at d_k: cannot be rejected in exact maths
            residual = p
        return k, _sample(residual / residual.sum(), generator)
    return num_draft, _sample(probs[num_draft], generator)


def _choose(
    logits: torch.Tensor,  # [N, vocab]
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> int:
    """One token from the last row: argmax at T = 0, else a processed sample."""
    if temperature == 0:
        return int(logits[-1].argmax())
    return _sample(processed_probs(logits[-1:], temperature, top_p, top_k)[0], generator)


def _finish(tokens: list[int], prompt_len: int, max_new_tokens: int, eos: set[int]) -> bool:
    """Truncate the output in place after the first eos or at max_new_tokens;
    True when generation is over."""
    for i in range(prompt_len, len(tokens)):
        if tokens[i] in eos:
            del tokens[i + 1 :]
            return True
    if len(tokens) - prompt_len >= max_new_tokens:
        del tokens[prompt_len + max_new_tokens :]
        return True
    return False


def _draft_and_verify(
    target: TargetModel,
    drafter,
    tokens: list[int],
    aux: torch.Tensor,  # [>= len(tokens) - 1, F] target aux hidden, read at positions < anchor
    sampling: tuple[float, float, int],  # (temperature, top_p, top_k)
    generator: torch.Generator | None,
) -> tuple[BlockRecord, int, torch.Tensor]:
    """One block: draft from anchor = len(tokens) - 1, verify with one target
    forward; returns (record, target-chosen next token, aux [anchor+K+1, F])."""
    device, layer_ids = target.embed_weight.device, tuple(drafter.target_layer_ids)
    anchor = len(tokens) - 1
    anchor_t = torch.tensor([anchor], device=device)
    draft = drafter.propose(aux[:anchor], anchor_t, torch.tensor([tokens[anchor]], device=device),
                            torch.tensor(tokens, device=device))[0]  # [K]
    draft = draft.to(device)
    num_draft = draft.shape[0]
    seq = torch.cat([torch.tensor(tokens, device=device), draft])
    logits_at = torch.arange(anchor, anchor + num_draft + 1, device=device)
    out = target.forward(seq, layer_ids, logits_at=logits_at)  # logits: [K+1, vocab]
    temperature, top_p, top_k = sampling
    if temperature == 0:
        r, next_token = verify_greedy(draft, out.logits)
    else:
        r, next_token = verify_rejection(draft, processed_probs(out.logits, temperature, top_p, top_k), generator)
    block = BlockRecord(anchor=anchor, draft_tokens=tuple(int(t) for t in draft), num_accepted=r)
    return block, next_token, out.aux_hidden


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    generator: torch.Generator | None = None,
) -> SpecDecodeResult:
    """Target-verified speculative decoding with ``drafter`` (any object with
    ``target_layer_ids`` and ``propose(aux [a, F], anchors [1], anchor_tokens [1]) -> [1, K]``).

    Lossless: at T = 0 the output equals the target's greedy decode; at
    T > 0 it is a sample from the processed target distribution. Every
    verified block is recorded; a block whose accepted tokens pass eos or
    max_new_tokens keeps the verifier's r while the output is cut.
    """
    _check_sampling(max_new_tokens, temperature, top_p, top_k)
    if len(prompt_ids) < 1:
        raise ValueError("prompt_ids must hold at least one token")
    device, eos = target.embed_weight.device, set(eos_token_ids)
    tokens = [int(t) for t in prompt_ids]
    result = SpecDecodeResult(tokens=tokens, prompt_len=len(tokens))
    last = torch.tensor([len(tokens) - 1], device=device)
    out = target.forward(torch.tensor(tokens, device=device), tuple(drafter.target_layer_ids), logits_at=last)
    result.num_target_forwards = 1
    tokens.append(_choose(out.logits, temperature, top_p, top_k, generator))
    aux = out.aux_hidden  # [>= len(tokens) - 1, F], read at positions < anchor
    while not _finish(tokens, result.prompt_len, max_new_tokens, eos):
        block, next_token, aux = _draft_and_verify(
            target, drafter, tokens, aux, (temperature, top_p, top_k), generator
        )
        result.blocks.append(block)
        result.num_target_forwards += 1
        tokens.extend(list(block.draft_tokens[: block.num_accepted]) + [next_token])
    return result


@torch.no_grad()
def target_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...] | list[int] = (),
) -> list[int]:
    """Greedy decode with the target alone; returns prompt + output ids."""
    _check_sampling(max_new_tokens, 0.0, 1.0, 0)
    device, eos = target.embed_weight.device, set(eos_token_ids)
    tokens = [int(t) for t in prompt_ids]
    prompt_len = len(tokens)
    while True:
        seq = torch.tensor(tokens, device=device)
        logits = target.forward(seq, logits_at=torch.tensor([len(tokens) - 1], device=device)).logits
        tokens.append(int(logits[-1].argmax()))
        if _finish(tokens, prompt_len, max_new_tokens, eos):
            return tokens
