"""Promotion gate: simulated served acceptance of two drafters on held-out traffic.

A trained candidate replaces the serving drafter only if it would have been
accepted more on recent traffic the trainer never saw. For every held-out
record and every logged anchor a (the same anchors for both drafters, so the
comparison is paired), each drafter proposes its greedy block d_1..d_K from
the logged context tokens[:a+1], and the target "verifies" it analytically
under the record's own sampling parameters:

    E[r] = sum_{k=1..K} prod_{j<=k} p_j(d_j)

where p_j is the target's processed distribution (temperature, top-k, top-p,
``specdec.processed_probs``) at position a+j given tokens[:a+1] + d_<j. The
drafter is greedy, so q is one-hot and rejection sampling accepts d_j with
probability min(1, p/q) = p_j(d_j); the sum is the expected accepted count.
At T = 0, p_j is one-hot at the target argmax and E[r] is exactly the count
that greedy verification accepts; since the accepted prefix is then the
target's own greedy continuation, which a T = 0 record's tokens are (serving
is lossless), that count is read off the tokens with no target forward
(``greedy_accepted``; a position past the record's last token counts as
rejected: the request ended there). The served acceptance length per block is
tau = 1 + E[r] (vLLM's definition: the target always adds one token). An
expectation instead of a sampled r removes the verifier's sampling noise from
the comparison, and blocks where both drafters propose the same tokens
contribute exactly zero difference.

Block lengths. A server that changes the number of speculative tokens per
step logs blocks of K_m tokens; at such an anchor each drafter drafts
min(K_m, K_d) tokens, as vLLM would (a DFlash block of fewer tokens has fewer
mask slots), and E[r] sums k <= min(K_m, K_d) only: the score is the served
acceptance under the same K schedule. Records without any logged block
(served with speculation off) have no logged anchors: they are scored at the
blocks of the serving drafter's own greedy walk a -> a + r + 1 over the
record (``walk_blocks``, rollout.py), the anchors that serving it would have
logged (exactly at T = 0; an exact sample at T > 0), each K_d long.

Cost per record: one target forward for the drafters' context features (none
for a record that carries them, ``gate.captured_features``: the served target's
rows, bfloat16 where it serves in bfloat16; a forward over the prompt positions
a prefix-cache hit left out of them), one
batched ``propose`` per drafter (per distinct block length), and, for a
record served at T > 0, one packed target forward (replay.py) over the
sequence plus the union of both drafters' distinct blocks, unless the record's
captured top-k rows (``gate.captured_teacher``: the verifier's own, at each
logged block's drafted positions and along the sequence) hold every row both
drafters' blocks need, which they do wherever a drafter re-proposes the logged
block or stays on the sampled tokens (``captured_block_logits``); a record
without blocks adds the walk (one target forward and one ``propose`` at every
output position). Measured on 32 served HumanEval records with features, 32
blocks each, one thread: 48.7 s per evaluation before the T = 0 and feature
shortcuts, 17.7 s with the T = 0 one, 9.9 s with both; at T = 0.7, on the 64
newest held-out records of a served run, 80.7 s with the forward and 42.8 s
with the rows (45 of 64 records on them; E[r] within 0.006 per block on
average of the forward's: top-k truncation and bfloat16) (benchmarks/gate_cost.py).
That was the end of a run, when the serving version had logged most held-out
records; through the gates of 30-min runs, with a new candidate every 25 steps
and records logged by older versions, the rows covered 23-36% of the records and
the gate took as long as before (README).
The evaluation runs in the trainer's thread, so this is time it does not train.

Decision: let g_i be held-out prompt i's tau difference (candidate -
serving): the mean over its records of each record's mean difference over its
blocks. With n distinct held-out prompts, mean g, standard error s/sqrt(n),
and the one-sided Student-t lower bound L = mean - t_{c, n-1} s / sqrt(n) at
confidence c, the candidate passes iff n >= min_records and L > margin. With
margin 0 a candidate must be better with confidence c: equal is not enough.
Prompts, not blocks or records, are the unit: blocks of one record share a
context, and records of one prompt (the held-out key below: repeats, n > 1
siblings, a conversation's turns) share it too; at T = 0 a repeated prompt
is the same sequence again. Counting such records as independent shrinks the
error by up to sqrt(records per prompt): measured on the domain-shift
benchmark's first traffic (16 prompts repeated for 12 minutes), a candidate
passed "over 32 records" that were 2 distinct prompts, and lowered the
held-out tau of unseen prompts.

Held-out rule: ``is_held_out`` puts a record on the held-out side by a hash of
its first ``split_prefix_tokens`` prompt tokens (all of a shorter prompt), so
the trainer and the gate agree without sharing state, and records that share
content share a side: the n > 1 siblings of a request and repeated prompts
(same prompt; at T = 0 the same output, an exact label leak if split), and
the later turns of a conversation, whose prompts start with the first turn's
prompt, whenever that first prompt is at least ``split_prefix_tokens`` long.
A shorter first turn is keyed by all of it and its later turns may land on
the other side; blocks lie in outputs only, so what such a pair shares is
context (the earlier turn), never a trained-on block. A prefix shared by all
traffic (a long fixed system prompt) puts everything on one side: the prefix
must reach past it. A record id says nothing about content and is not used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from scipy import stats
from tqdm.auto import tqdm

from online_opd.config import GateConfig
from online_opd.models.target_model import TargetModel
from online_opd.opd.replay import packed_target_forward, sequence_aux
from online_opd.opd.rollout import propose_all, simulated_record
from online_opd.opd.specdec import processed_probs
from online_opd.opd.teacher_rows import captured_rows_logits
from online_opd.traces.records import BlockRecord, SequenceRecord, acceptance_length, path_rows
from online_opd.train.sequences import TrainSequence

DEFAULT_MAX_TOKENS = 4096  # context kept per record; bounds the packed forward's N x N mask


@dataclass
class GateResult:
    """Outcome of one gate evaluation (``to_dict`` goes into the manifest and metrics)."""

    n_records: int  # records with at least one evaluated block
    n_blocks: int  # blocks per drafter (the same anchors for both)
    tau_candidate: float  # block-weighted mean of 1 + E[r]
    tau_serving: float
    diff_mean: float  # tau_candidate - tau_serving (block-weighted)
    # per held-out prompt (records sharing a held-out key pooled, module docstring); names kept from when
    # the unit was the record, as manifests and /metrics read them
    record_diff_mean: float  # mean over prompts of the per-prompt mean tau difference
    record_diff_stderr: float  # its standard error (inf with fewer than 2 prompts)
    record_diff_lower: float  # one-sided lower confidence bound at `confidence`
    confidence: float
    margin: float
    passed: bool
    reason: str
    seconds: float
    n_records_walked: int = 0  # of n_records, those without logged blocks: scored on the serving walk
    n_prompts: int = 0  # distinct held-out keys among the n_records: the decision's sample size
    n_records_teacher: int = 0  # of n_records, T > 0 ones scored from their captured teacher rows (no forward)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict: non-finite floats become None."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in asdict(self).items()}


def held_out_key(record: SequenceRecord, num_prefix_tokens: int) -> bytes:
    """sha256 of the record's first ``num_prefix_tokens`` prompt tokens (the split key)."""
    prefix = record.tokens[: min(record.prompt_len, num_prefix_tokens)]
    return hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in prefix)).digest()


def is_held_out(record: SequenceRecord, fraction: float, num_prefix_tokens: int) -> bool:
    """Whether a record belongs to the gate's held-out share (module docstring): its key, read as a
    number in [0, 1), is below ``fraction``, so shares nest and every process decides the same."""
    return int.from_bytes(held_out_key(record, num_prefix_tokens)[:8], "big") / 2**64 < fraction


def split_held_out(
    records: Sequence[SequenceRecord], fraction: float, num_prefix_tokens: int
) -> tuple[list[SequenceRecord], list[SequenceRecord]]:
    """(train, held_out) by ``is_held_out``, order kept."""
    train, held_out = [], []
    for rec in records:
        (held_out if is_held_out(rec, fraction, num_prefix_tokens) else train).append(rec)
    return train, held_out


def gate_blocks(record: SequenceRecord, max_blocks: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[BlockRecord]:
    """Logged blocks to simulate: 1 <= a and a + 1 <= max_tokens (so the
    sequence is cut right after an anchor), at most ``max_blocks`` of them,
    evenly spread over the record so late context is not left out."""
    usable = [b for b in record.blocks if 1 <= b.anchor < min(len(record.tokens), max_tokens)]
    if len(usable) <= max_blocks:
        return usable
    picks = torch.linspace(0, len(usable) - 1, max_blocks).round().long().unique().tolist()
    return [usable[i] for i in picks]


def gate_anchors(record: SequenceRecord, max_blocks: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[int]:
    """The anchors of ``gate_blocks``."""
    return [b.anchor for b in gate_blocks(record, max_blocks, max_tokens)]


def walk_blocks(target: TargetModel, serving, record: SequenceRecord, max_blocks: int,
                max_tokens: int = DEFAULT_MAX_TOKENS, captured_features: bool = True) -> list[BlockRecord]:
    """For a record without logged blocks (served without speculation): the blocks of the serving
    drafter's own greedy walk a -> a + r + 1 over its first ``max_tokens`` tokens (rollout.py: what
    serving it would have logged; exact at T = 0, an exact sample at T > 0), picked as ``gate_blocks``."""
    cut = dataclasses.replace(record, tokens=record.tokens[:max_tokens])
    return gate_blocks(simulated_record(target, serving, cut, captured_features), max_blocks, max_tokens)


def draft_token_probs(
    logits: torch.Tensor,  # [M, K, vocab] target logits at positions a+1 .. a+K
    drafts: torch.Tensor,  # [M, K]
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """[M, K] p_j(d_j): the acceptance probability of a greedy draft token.
    At T = 0: 1 where d_j is the target argmax, else 0 (greedy verification).
    Rows are processed in chunks: the processed distribution is a full
    vocabulary-sized float tensor per row."""
    if temperature == 0:
        return (logits.argmax(-1) == drafts).float()
    flat, ids = logits.reshape(-1, logits.shape[-1]), drafts.reshape(-1, 1)
    out = [processed_probs(flat[lo:lo + chunk_rows], temperature, top_p, top_k)
           .gather(1, ids[lo:lo + chunk_rows]) for lo in range(0, flat.shape[0], chunk_rows)]
    return torch.cat(out).view(drafts.shape)


def expected_accepted(accept_probs: torch.Tensor, num_drafted: torch.Tensor | None = None) -> torch.Tensor:
    """[M] E[r] = sum_{k <= K_m} prod_{j<=k} p_j(d_j) from [M, K] acceptance probabilities;
    ``num_drafted`` [M] K_m (default K): a block of K_m tokens accepts at most K_m."""
    survive = accept_probs.cumprod(dim=1)  # [M, K] P(r >= k)
    if num_drafted is not None:
        survive = survive * (torch.arange(survive.shape[1], device=survive.device) < num_drafted[:, None])
    return survive.sum(dim=1)


def _propose_blocks(drafter, seq: TrainSequence, anchors: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """[M, K] greedy blocks, block m drafted K'_m = widths[m] tokens long (zero beyond)."""
    out = torch.zeros(anchors.shape[0], drafter.cfg.block_size, dtype=torch.int64, device=anchors.device)
    for width in widths.unique().tolist():
        idx = (widths == width).nonzero().squeeze(1)
        out[idx, :width] = propose_all(drafter, seq, anchors[idx], num_draft_tokens=width).to(out.device)
    return out


def _layer_columns(layer_ids: list[int], wanted: Sequence[int], hidden: int) -> torch.Tensor:
    """Column indices of `wanted` layers inside features captured at `layer_ids`."""
    return torch.cat([torch.arange(hidden) + layer_ids.index(lid) * hidden for lid in wanted])


class Simulation(NamedTuple):
    """``simulate_record``'s result."""

    expected: torch.Tensor  # [len(drafters), M] E[r]
    proposals: list[torch.Tensor]  # each drafter's [M, K_d] greedy blocks
    from_teacher: bool  # the blocks were verified on the record's captured rows, not a target forward


@torch.no_grad()
def simulate_record(
    target: TargetModel,
    drafters: Sequence,
    record: SequenceRecord,
    anchors: Sequence[int],
    lengths: Sequence[int] | None = None,
    *,
    captured_features: bool = True,
    greedy_from_tokens: bool = False,
    captured_teacher: bool = False,
) -> Simulation:
    """E[r] [len(drafters), M] and each drafter's proposals [M, K_d] at `anchors` (``Simulation``).

    ``lengths``: the number of tokens the server drafted at each anchor (its
    logged block's length, which may vary per step); a drafter then drafts
    min(length, K_d) tokens there, as vLLM drafts fewer (zero beyond them in
    the proposals), and E[r] counts those only. None: every drafter drafts
    its own K_d. Drafters may read different target layers and draft
    different K: features are captured once at the union of their layers,
    and blocks are padded to the longest K (a block's rows are causal, so
    padding never changes the rows that are read). Identical (anchor, block)
    pairs are verified once. ``captured_features``: the drafters' context features come from the
    record's captured ones (``SequenceRecord.hidden``) where they cover it (``replay.sequence_aux``).
    ``greedy_from_tokens`` (for a T = 0 record whose tokens are the target's greedy output, as every
    served one is: speculative decoding is lossless): no target forward verifies the blocks; E[r] is
    the number of leading drafted tokens equal to the record's own next tokens (``greedy_accepted``).
    ``captured_teacher`` (a T > 0 record): the blocks are verified on the record's captured top-k rows
    when they hold every row that any drafter's block needs (``captured_block_logits``), else by the
    packed target forward, for all blocks alike: the drafters' scores on one record share one source.
    """
    if not anchors:
        raise ValueError("simulate_record needs at least one anchor")
    device = target.embed_weight.device
    tokens = torch.tensor(record.tokens[: max(anchors) + 1], dtype=torch.int64, device=device)
    anchor_t = torch.tensor(anchors, dtype=torch.int64, device=device)
    layer_ids = sorted({lid for d in drafters for lid in d.target_layer_ids})
    hidden = record.hidden if captured_features else None
    aux, _ = sequence_aux(target, tokens, tuple(layer_ids), hidden)  # [T, L * hidden]
    proposals, widths = [], []
    full = torch.tensor(record.tokens, dtype=torch.int64, device=device) if greedy_from_tokens else None
    for drafter in drafters:
        cols = _layer_columns(layer_ids, drafter.target_layer_ids, target.hidden_size).to(device)
        seq = TrainSequence(tokens, record.prompt_len, aux[:, cols])
        block_size = drafter.cfg.block_size
        width = torch.tensor([block_size] * len(anchors) if lengths is None
                             else [min(n, block_size) for n in lengths], dtype=torch.int64, device=device)
        widths.append(width)
        proposals.append(_propose_blocks(drafter, seq, anchor_t, width))
    if full is not None:
        return Simulation(torch.stack([greedy_accepted(full, anchor_t, p, w) for p, w in zip(proposals, widths)]),
                          proposals, False)
    width = max(p.shape[1] for p in proposals)
    keys = torch.cat([torch.cat([anchor_t[:, None], F.pad(p, (0, width - p.shape[1]))], dim=1)
                      for p in proposals])  # [D * M, 1 + K]
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    logits = None
    if captured_teacher:
        key_widths = torch.zeros(unique.shape[0], dtype=torch.int64, device=device).scatter_reduce(
            0, inverse, torch.cat(widths), reduce="amax")  # [U] the most positions any drafter reads
        logits = captured_block_logits(record, unique[:, 0], unique[:, 1:], key_widths, target.vocab_size)
    from_teacher = logits is not None
    if logits is None:
        logits, _ = packed_target_forward(target, tokens, unique[:, 0], unique[:, 1:], ())  # [U, K, vocab]
    probs = draft_token_probs(logits, unique[:, 1:], record.temperature, record.top_p, record.top_k)
    num = len(anchors)
    expected = torch.stack([expected_accepted(probs[inverse[i * num:(i + 1) * num], : p.shape[1]], widths[i])
                            for i, p in enumerate(proposals)])
    return Simulation(expected, proposals, from_teacher)


def captured_block_logits(
    record: SequenceRecord,
    anchors: torch.Tensor,  # [U]
    drafts: torch.Tensor,  # [U, W] greedy blocks, zero beyond each one's width
    widths: torch.Tensor,  # [U] positions read per block
    vocab_size: int,
) -> torch.Tensor | None:
    """[U, W, vocab] the target's log-probabilities at each block's drafted positions, read from the
    record's captured top-k rows (``capture.teacher_top_k``, the served target's own verification), or
    None when one is missing. Position j of a block at anchor a is conditioned on tokens[:a+1] + d_<j:
    the row of sequence position a + j - 1 (``records.path_rows``: plain steps and logged blocks' rows
    on the sequence) when d_<j are the record's own next tokens, else row j - 1 of the logged block at a
    whose first j - 1 drafts are d_<j. Rows beyond a block's width (never read) repeat its last one.
    Rebuilt as replay does (``teacher_rows.captured_rows_logits``: the tail mass spread uniformly), so the
    acceptance probabilities at T > 0 carry the top-k truncation error (benchmarks/gate_cost.py measures
    it against the forward); with bfloat16 serving, they are the bfloat16 target's."""
    path = path_rows(record)
    logged: dict[int, BlockRecord] = {}
    for block in record.blocks:
        if block.teacher is not None:
            logged.setdefault(block.anchor, block)
    tokens, rows = record.tokens, []
    for anchor, draft, width in zip(anchors.tolist(), drafts.tolist(), widths.tolist()):
        for n in range(drafts.shape[1]):  # the row of drafted position n + 1, after the prefix d_<=n
            if n >= width:
                rows.append(rows[-1])
                continue
            prefix = draft[:n]
            row = path.get(anchor + n) if list(tokens[anchor + 1: anchor + 1 + n]) == prefix else None
            block = logged.get(anchor)
            if row is None and block is not None and n <= len(block.draft_tokens) \
                    and list(block.draft_tokens[:n]) == prefix:
                row = (block.teacher.token_ids[n], block.teacher.logprobs[n])
            if row is None:
                return None
            rows.append(row)
    return captured_rows_logits(rows, vocab_size, anchors.device).view(*drafts.shape, vocab_size)


def greedy_accepted(
    tokens: torch.Tensor,  # [T] a T = 0 record's tokens: the target's greedy output
    anchors: torch.Tensor,  # [M]
    drafts: torch.Tensor,  # [M, K] greedy blocks, zero-padded beyond each block's width
    widths: torch.Tensor,  # [M] tokens drafted per block
) -> torch.Tensor:
    """[M] (float) r of greedy verification without a target forward: at T = 0 the target accepts d_k iff
    it is its argmax after tokens[:a+1] + d_<k, and while d_<k were all accepted that prefix is the
    record's own greedy continuation, so r = the number of leading k with d_k == tokens[a + k]
    (k <= width). A position past the record's last token counts as rejected: the request ended there."""
    K = drafts.shape[1]
    pos = anchors[:, None] + torch.arange(1, K + 1, device=drafts.device)  # [M, K]
    inside = pos < tokens.shape[0]
    ref = torch.where(inside, tokens[pos.clamp(max=tokens.shape[0] - 1)], torch.full_like(pos, -1))
    match = (drafts == ref) & (torch.arange(K, device=drafts.device) < widths[:, None])
    return match.long().cumprod(dim=1).sum(dim=1).float()


def paired_lower_bound(diffs: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """(mean, standard error, one-sided Student-t lower bound) of independent paired differences
    (the gate's: one per held-out prompt). Fewer than two give no error estimate: the bound is -inf."""
    n = len(diffs)
    if n == 0:
        return math.nan, math.inf, -math.inf
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, math.inf, -math.inf
    stderr = statistics.stdev(diffs, mean) / math.sqrt(n)
    if stderr == 0:
        return mean, stderr, mean
    return mean, stderr, mean - float(stats.t.ppf(confidence, n - 1)) * stderr


def most_recent(records: Sequence[SequenceRecord], count: int) -> list[SequenceRecord]:
    """The `count` newest records by ``captured_at`` (ties: later in the input is newer), oldest first."""
    order = sorted(range(len(records)), key=lambda i: (records[i].captured_at, i))
    return [records[i] for i in order[-count:]] if count > 0 else []


def _simulation_inputs(rec: SequenceRecord) -> tuple:
    """What ``evaluate_gate``'s simulation of a record depends on: equal inputs, equal expectations."""
    return (rec.tokens, rec.prompt_len, rec.temperature, rec.top_p, rec.top_k, rec.blocks, rec.hidden)


@torch.no_grad()
def evaluate_gate(
    target: TargetModel,
    candidate,
    serving,
    records: Sequence[SequenceRecord],
    cfg: GateConfig,
    *,
    max_blocks_per_record: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = False,
) -> GateResult:
    """Simulated acceptance of `candidate` vs `serving` on held-out `records`
    (the newest ``cfg.max_records``) and the promotion decision (module docstring):
    records sharing a held-out key (``held_out_key`` with ``cfg.split_prefix_tokens``) are one
    sample, and ``cfg.min_records`` counts such prompts. ``max_blocks_per_record`` defaults to
    ``cfg.max_blocks_per_record``; records are cut after the last anchor below ``max_tokens``. A record
    whose simulation inputs equal an earlier one's (``_simulation_inputs``) reuses its expectations."""
    start = time.perf_counter()
    cap = max_blocks_per_record or cfg.max_blocks_per_record
    by_prompt: dict[bytes, list[float]] = {}
    sums, n_blocks, n_walked, n_teacher = [0.0, 0.0], 0, 0, 0
    scored: dict[tuple, Simulation | None] = {}  # a record's inputs -> its simulation
    for rec in tqdm(most_recent(records, cfg.max_records), desc="gate", unit="rec", disable=not progress):
        is_walked = not rec.blocks
        inputs = _simulation_inputs(rec)
        if inputs not in scored:  # a repeat (the same request served again, T = 0) is not simulated again
            blocks = (walk_blocks(target, serving, rec, cap, max_tokens, cfg.captured_features) if is_walked
                      else gate_blocks(rec, cap, max_tokens))
            scored[inputs] = None if not blocks else simulate_record(
                target, (candidate, serving), rec, [b.anchor for b in blocks], [b.drafted_width for b in blocks],
                captured_features=cfg.captured_features, greedy_from_tokens=rec.temperature == 0,
                captured_teacher=cfg.captured_teacher)
        if scored[inputs] is None:
            continue
        expected = scored[inputs].expected.double().cpu()  # [2, M]
        n_teacher += scored[inputs].from_teacher
        sums = [sums[0] + float(expected[0].sum()), sums[1] + float(expected[1].sum())]
        n_blocks += expected.shape[1]
        n_walked += is_walked
        by_prompt.setdefault(held_out_key(rec, cfg.split_prefix_tokens), []).append(
            float((expected[0] - expected[1]).mean()))
    taus = [acceptance_length(s, n_blocks) for s in sums]
    tau_c, tau_s = (math.nan if tau is None else tau for tau in taus)
    mean, stderr, lower = paired_lower_bound([statistics.fmean(d) for d in by_prompt.values()], cfg.confidence)
    n, n_records = len(by_prompt), sum(map(len, by_prompt.values()))
    over = f"{n} prompts ({n_records} records)"
    if n < cfg.min_records:
        passed, reason = False, f"not enough held-out prompts: {over}, min_records {cfg.min_records}"
    elif lower > cfg.margin:
        passed, reason = True, (f"tau gain lower bound {lower:.4f} > margin {cfg.margin:g} "
                                f"at {cfg.confidence:g} confidence over {over}")
    else:
        passed, reason = False, (f"tau gain lower bound {lower:.4f} <= margin {cfg.margin:g} "
                                 f"at {cfg.confidence:g} confidence over {over}")
    return GateResult(
        n_records=n_records, n_blocks=n_blocks, tau_candidate=tau_c, tau_serving=tau_s,
        diff_mean=tau_c - tau_s, record_diff_mean=mean, record_diff_stderr=stderr, record_diff_lower=lower,
        confidence=cfg.confidence, margin=cfg.margin, passed=passed, reason=reason,
        seconds=time.perf_counter() - start, n_records_walked=n_walked, n_prompts=n, n_records_teacher=n_teacher,
    )
