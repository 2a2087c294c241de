"""`online-opd serve --draft-trim` on the real vLLM CPU engine.

The memorising drafter (tests/serving.py) is sure of its six training rollouts and unsure of prompts
it never saw; served with K = 4 every step and a fixed trimming threshold of 0.5, some of its blocks
are verified whole and others cut per request (vLLM takes per-request draft lists of any length).
Checked:

- outputs stay the target's greedy outputs, on the memorised prompts and on altered ones;
- the worker's trimming figures (admin /status): blocks trimmed, verified and learnt from;
- vLLM verified fewer draft tokens than it drafted blocks x K;
- every captured drafter block, whole or trimmed, is the first tokens of the block the torch drafter
  drafts at its anchor with the width vLLM drafted (``BlockRecord.drafted_width``), and trimmed blocks
  are recorded as such (``num_drafted``), so replay reads only whole ones; every record passes the
  capture-fidelity check.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.models.target import ensure_embedded_target
from online_opd.models.target_model import TargetModel
from online_opd.opd.rollout import propose_all
from online_opd.opd.specdec import target_generate
from online_opd.traces.buffer import BufferReader
from online_opd.traces.records import check_fidelity
from online_opd.train.opd import replayable_blocks
from online_opd.train.sequences import TrainSequence
from tests.serving import Server, running

pytestmark = pytest.mark.slow
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-trim")
    with running(root / "serve", "--drafter", str(trained_run / "drafter"), "--speculation", "always",
                 "--draft-trim", "-o", "serve.draft_trim.threshold=0.5") as srv:
        yield srv


def complete(server: Server, prompt: list[int]) -> list[int]:
    """Greedy ids of MAX_TOKENS tokens (EOS ignored: every output has the same length)."""
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    reply.raise_for_status()
    return list(reply.json()["choices"][0]["token_ids"])


def test_trimmed_blocks_are_lossless_and_the_drafters_own(server, rollouts, trained_run):
    target = TargetModel.from_pretrained(ensure_embedded_target(progress=False), dtype=torch.float32)
    # the memorised prompts, and the same prompts with their last two tokens swapped (unseen contexts)
    prompts = [p for p, _ in rollouts] + [p[:-2] + [p[-1], p[-2]] for p, _ in rollouts[:3]]
    before = server.metrics()
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda p: complete(server, p), prompts))
    # the memorised prompts' greedy outputs are their rollouts (plain vLLM, EOS may end them early); the
    # altered ones', the torch target's (a full forward per token: the slow part of this test)
    for (_, expected), out in zip(rollouts, outputs):
        assert out[: len(expected)] == expected, "output differs from the target's"
    for prompt, out in zip(prompts[len(rollouts):], outputs[len(rollouts):]):
        assert out == target_generate(target, prompt, MAX_TOKENS)[len(prompt):], "output differs from the target's"
    time.sleep(2.0)  # > capture flush interval and a status poll
    after = server.metrics()
    blocks = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0.0)
    tokens = (after["vllm:spec_decode_num_draft_tokens_total"]
              - before.get("vllm:spec_decode_num_draft_tokens_total", 0.0))
    assert 0 < tokens < 4 * blocks, (tokens, blocks)  # some blocks were verified shorter than K = 4

    trim = server.admin("GET", "/status").json()["draft_trim"]
    assert trim["thresholds"] == [0.0, 0.5] and trim["errors"] == 0, trim
    assert trim["trimmed_blocks"] > 0 and trim["kept_tokens"] < trim["drafted_tokens"], trim
    assert trim["verified_blocks"] > 0 and sum(map(sum, trim["calibration"]["seen"])) > 0, trim

    drafter = load_drafter(trained_run / "drafter")
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    records = list(BufferReader(server.buffer).iter_records())
    whole = trimmed = 0
    for rec in records:
        check_fidelity(rec)
        tokens_t = torch.tensor(rec.tokens)
        feats = target.forward(tokens_t, layer_ids=drafter.target_layer_ids, logits_at=tokens_t[:0]).aux_hidden
        seq = TrainSequence(tokens_t, rec.prompt_len, feats)
        for block in rec.blocks:
            if not block.is_context_pure:
                continue
            mine = propose_all(drafter, seq, torch.tensor([block.anchor]),
                               num_draft_tokens=block.drafted_width)[0].tolist()
            assert list(block.draft_tokens) == mine[: len(block.draft_tokens)], (rec.record_id, block)
            whole += block.num_drafted is None
            trimmed += block.num_drafted is not None
        assert all(b.num_drafted is None for b in replayable_blocks(rec, 4))
    assert whole > 10 and trimmed > 10, (whole, trimmed)
