"""The target's captured top-k rows as teacher distributions: rebuilt rows, and teachers along the sequence.

The capture hook (vllm_patches/capture.py) stores, for each verified block and each plain step, the
verifier's k most likely ids and their log-probabilities (``top_k_logprobs``: the hook's own math on vLLM's
logits; ``traces.target_signal.TeacherTopK``). Replay (replay.py) and the gate (release/gate.py) read them
instead of running the target. A rebuilt row (``reconstruct_rows``) keeps its k captured log-probabilities,
and the rest of the mass, 1 - their sum (floored at ``TAIL_MASS_FLOOR``), goes to the other V - k ids in one
of two shapes (replay's ``teacher_tail``):

- "uniform" (the default): evenly, capped at the row's smallest captured
  value. It says "p is small there", which is what most of a language model's
  tail is, though not flat: the forward KL pulls q toward uniform over the
  tail, the reverse KL charges q's tail mass at that small p.
- "student": in proportion to the drafter's own q over those ids (detached).
  Every objective of losses.py then computes, value and gradient, exactly its
  collapsed (k+1)-way form: the k ids and one "rest" outcome with mass 1 - S
  under p and Q_rest under q (forward KL's tail term (1 - S) log((1 - S) /
  Q_rest), reverse KL's Q_rest log(Q_rest / (1 - S))), claiming nothing about
  the shape of p's tail. It also drops what the tail says: against the full
  teacher's gradient it measured worse than "uniform" at every k from 4 to 32
  (cosine 0.73 against 0.89 at k = 32, gradient norm 0.57x against 1.01x:
  benchmarks/teacher_replay.py, README "Teacher signal"). Kept for comparison.

The teacher along the sequence. An objective that reads positions k <= r + 1
only (``losses.PATH_ONLY``) needs p_{m,k} only where d_<k are the sequence's own
tokens: the target's next-token row at position a_m + k - 1 of the sequence.
``path_block_teacher`` builds a block's teacher from such rows (``records.path_rows``:
the plain steps' captured rows and the logged blocks' on-path ones), repeating the
last on-path row in the rows past it, which those objectives never read. A
record served mostly without speculation replays on simulated blocks
(opd/rollout.py) with no target forward at all that way.

``teacher_logits`` and ``teacher_truncation`` (the uniform rebuild against the full distribution) serve
tests and benchmarks/teacher_replay.py.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from online_opd.traces.records import BlockRecord
from online_opd.traces.target_signal import TeacherTopK

TAIL_MASS_FLOOR = 1e-6  # least mass a reconstructed teacher row leaves outside its top-k (teacher_logits)
LOGPROB_MIN = -1000.0  # top_k_logprobs' floor: a -inf log-probability, kept finite (exp is 0 all the same)


def top_k_logprobs(
    logits: torch.Tensor,  # [R, V] raw target logits, any float dtype
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, k] int64, log-probabilities [R, k] float32, each row descending): log_softmax in float32
    at temperature 1, then its k largest. The capture hook's math on vLLM's verifier logits
    (vllm_patches/capture.py), so what it stores is what ``TeacherTopK.from_dict`` accepts: values are
    clamped to [LOGPROB_MIN, 0] (log_softmax can round the top entry a hair above 0, and a logit masked
    to -inf would give a non-finite value). NaN (a broken forward) stays NaN, and fails validation."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k needs 1 <= k <= vocab {logits.shape[-1]}, got k={k}")
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # sorted: descending
    return ids, values.clamp_(LOGPROB_MIN, 0.0)


def top_k_teacher(
    logits: torch.Tensor,  # [R, V] raw target logits at a block's K_m + 1 rows
    k: int,
) -> TeacherTopK:
    """The ``TeacherTopK`` the capture records for these logits (tests, the truncation benchmark)."""
    return TeacherTopK.from_tensors(*top_k_logprobs(logits, k))


def reconstruct_rows(
    ids: torch.Tensor,  # [R, k] int64, distinct per row
    logprobs: torch.Tensor,  # [R, k] float32 log p of those ids
    vocab_size: int,
    tail_shape: torch.Tensor | None = None,  # [R, vocab] log-probabilities the tail follows; None = uniform
) -> torch.Tensor:
    """[R, vocab] float32 log-probabilities: the captured entries at their ids, the tail mass
    max(1 - sum exp(logprobs), TAIL_MASS_FLOOR) over the other vocab - k ids, then renormalised
    (log_softmax). The tail is spread uniformly (capped at the row's smallest captured value: no tail id
    above a captured one), or in proportion to ``tail_shape`` over the tail ids (the student's: module
    docstring). With k = vocab there is no tail: the row is the captured one, renormalised."""
    num_rows, k = ids.shape
    if k > vocab_size or (ids.numel() > 0 and int(ids.max()) >= vocab_size):  # scatter_ would assert on a GPU
        raise ValueError(f"teacher ids must lie in the target's vocabulary of {vocab_size} (k={k})")
    others = vocab_size - k
    # float64: the tail is a small difference of numbers near 1
    tail = (1.0 - logprobs.double().exp().sum(-1)).clamp_min(TAIL_MASS_FLOOR)  # [R]
    if others > 0 and tail_shape is not None:
        shape = tail_shape.detach().float()
        shape_tail = (1.0 - shape.gather(1, ids).double().exp().sum(-1)).clamp_min(1e-30)  # [R] its tail mass
        out = shape + (tail.log() - shape_tail.log()).float()[:, None]  # [R, vocab]
    else:
        if others > 0:
            fill = (tail.log() - math.log(others)).float()  # [R] log p of each tail id
            fill = torch.minimum(fill, logprobs.min(-1).values)
        else:
            fill = logprobs.new_full((num_rows,), float("-inf"))  # every entry gets overwritten below
        out = fill[:, None].expand(num_rows, vocab_size).contiguous()  # [R, vocab]
    out.scatter_(1, ids, logprobs.float())
    return torch.log_softmax(out, dim=-1)


def captured_rows_logits(
    rows: Sequence[tuple[Sequence[int], Sequence[float]]],
    vocab_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[len(rows), vocab] float32 log-probabilities of captured top-k rows ((ids, logprobs) pairs, each
    row's k free: a record's plain-step and block rows may differ), rebuilt as ``teacher_logits`` does
    (uniform tail)."""
    out = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=device)
    by_k: dict[int, list[int]] = {}
    for i, (ids, _) in enumerate(rows):
        by_k.setdefault(len(ids), []).append(i)
    for idx in by_k.values():
        ids = torch.tensor([rows[i][0] for i in idx], dtype=torch.long, device=device)
        logprobs = torch.tensor([rows[i][1] for i in idx], dtype=torch.float32, device=device)
        out[torch.tensor(idx, device=device)] = reconstruct_rows(ids, logprobs, vocab_size)
    return out


def path_block_teacher(block: BlockRecord, rows: dict[int, tuple[tuple[int, ...], tuple[float, ...]]],
                       ) -> TeacherTopK | None:
    """A teacher for ``block`` (a, d, r) from the target's rows along the sequence (``records.path_rows``):
    row j <= min(r, K_m - 1) (and the bonus row K_m when r = K_m) is the row of position a + j; the rows
    after them repeat the last one. Only for objectives that read positions k <= r + 1 only
    (``losses.PATH_ONLY``): the repeated rows are not the target's distribution there. None when a row
    on the path is missing."""
    n, r = len(block.draft_tokens), block.num_accepted
    on_path = [rows.get(block.anchor + j) for j in range(min(r, n - 1) + 1)]
    if any(row is None for row in on_path):
        return None
    bonus = rows.get(block.anchor + n) if r == n else None
    table = on_path + [on_path[-1]] * (n - len(on_path)) + [bonus or on_path[-1]]
    return TeacherTopK(tuple(ids for ids, _ in table), tuple(lps for _, lps in table))


def teacher_logits(
    teacher: TeacherTopK,
    num_rows: int,
    vocab_size: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[num_rows, vocab] log-probabilities of the captured teacher's first ``num_rows`` rows: the drafted
    positions (``num_rows`` = K_m; the bonus row is trained on by no objective), rebuilt as ``reconstruct_rows``
    says (module docstring). Proper log-distributions, so valid ``target_logits`` for losses.py (which
    softmaxes them again: a no-op on log-probabilities)."""
    if not 1 <= num_rows <= len(teacher.token_ids):
        raise ValueError(f"num_rows must lie in 1..{len(teacher.token_ids)} (the teacher's rows), "
                         f"got {num_rows}")
    ids = torch.tensor(teacher.token_ids[:num_rows], dtype=torch.long, device=device)  # [R, k]
    logprobs = torch.tensor(teacher.logprobs[:num_rows], dtype=torch.float32, device=device)  # [R, k]
    return reconstruct_rows(ids, logprobs, vocab_size).to(dtype)


def teacher_truncation(
    full_logits: torch.Tensor,  # [R, vocab] the target's raw logits at the teacher's first R rows
    teacher: TeacherTopK,
) -> dict[str, torch.Tensor]:
    """What the top-k truncation costs, per row ([R] float32 each): ``kl`` = KL(p_full || p_rebuilt), ``tv``
    = total variation 1/2 sum |p_full - p_rebuilt|, ``captured_mass`` = sum exp(top-k) (what the k ids
    hold; 1 - it is the tail that ``teacher_logits`` had to guess)."""
    num_rows, vocab_size = full_logits.shape
    log_p = torch.log_softmax(full_logits.float(), dim=-1)  # [R, vocab]
    log_r = teacher_logits(teacher, num_rows, vocab_size, device=full_logits.device)  # [R, vocab]
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_r), torch.zeros_like(p)).sum(-1)
    tv = 0.5 * (p - log_r.exp()).abs().sum(-1)
    captured = torch.tensor(teacher.logprobs[:num_rows], dtype=torch.float32, device=full_logits.device)
    return {"kl": kl, "tv": tv, "captured_mass": captured.exp().sum(-1)}
