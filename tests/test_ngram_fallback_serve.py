"""`online-opd serve --ngram-fallback` on the real vLLM CPU engine.

The server drafts with a drafter of random weights (acceptance about 0), so wherever a request's
context has a prompt-lookup match the chooser takes the match. Checked:

- outputs stay the target's greedy outputs (the bootstrap's rollouts);
- ngram blocks are verified and accepted (``online_opd_ngram_fallback_*`` on /metrics), far better
  than the random drafter's;
- every captured block tagged ``ngram`` is exactly what vLLM's prompt-lookup matcher proposes from the
  record's tokens up to its anchor, and every record still passes the capture-fidelity check;
- live acceptance per drafter version leaves the ngram blocks out: the random drafter's served tau
  stays about 1 while vLLM's own counters, which count every block, show the ngram blocks' gain.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from online_opd.models.drafters.checkpoint import save_drafter
from online_opd.traces.buffer import BufferReader
from online_opd.traces.records import check_fidelity
from tests.serving import Server, complete_ids, random_drafter, running

pytestmark = pytest.mark.slow
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram-fallback")
    random_path = save_drafter(random_drafter(trained_run), root / "random", version="random")
    with running(root / "serve", "--drafter", str(random_path), "--ngram-fallback", "--no-train") as srv:
        yield srv


def complete(server: Server, prompt: list[int]) -> list[int]:
    return complete_ids(server, prompt, MAX_TOKENS)


def test_ngram_fallback_drafts_where_the_context_repeats(server, rollouts):
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as match

    for rounds in range(2):
        for k, (prompt, expected) in enumerate(rollouts):
            assert complete(server, prompt) == expected, f"prompt {k}: output differs from the target's"
    time.sleep(2.0)  # capture flush (0.5 s) and status polls (0.5 s)
    m = server.metrics()
    ngram_blocks = m["online_opd_ngram_fallback_blocks_total{proposer=ngram}"]
    ngram_accepted = m["online_opd_ngram_fallback_accepted_tokens_total{proposer=ngram}"]
    drafter_blocks = m["online_opd_ngram_fallback_blocks_total{proposer=drafter}"]
    drafter_accepted = m["online_opd_ngram_fallback_accepted_tokens_total{proposer=drafter}"]
    assert ngram_blocks >= 10 and drafter_blocks >= 10, server.tail()
    assert ngram_accepted / ngram_blocks > 0.3 > drafter_accepted / drafter_blocks, m
    assert m["online_opd_ngram_fallback_errors_total"] == 0
    assert m["online_opd_ngram_fallback_matches_total"] >= ngram_blocks

    # live acceptance of the drafter version: its own blocks only
    vllm_drafts = m["vllm:spec_decode_num_drafts_total"]
    vllm_tau = 1 + m["vllm:spec_decode_num_accepted_tokens_total"] / vllm_drafts
    served_tau = m["online_opd_served_acceptance_length{version=random}"]
    assert served_tau < 1.15 < vllm_tau, (served_tau, vllm_tau)
    assert vllm_drafts == pytest.approx(ngram_blocks + drafter_blocks, abs=2)

    records = list(BufferReader(server.buffer).iter_records())
    assert len(records) == 2 * len(rollouts)
    tagged = 0
    for rec in records:
        assert check_fidelity(rec) == [], rec.record_id
        for block in rec.blocks:
            if block.proposer != "ngram":
                continue
            context = np.asarray(rec.tokens[: block.anchor + 1], dtype=np.int32)
            expected = match(context, 2, 4, 1024, len(block.draft_tokens)).tolist()
            assert list(block.draft_tokens) == expected, (rec.record_id, block)
            tagged += 1
    assert tagged == pytest.approx(ngram_blocks, abs=2)
    assert "online-opd ngram fallback installed: prompt lookup 2-4" in server.tail(1_000_000)
