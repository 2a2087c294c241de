"""The verifier as teacher (vllm_patches/capture.py ``teacher_top_k``): the capture takes each verified
block's top-k log-probabilities from the verifier's logits rows. By hand on the worker-side events,
and on vLLM's real CPU engine against an independent Hugging Face forward of the target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from online_opd.traces.buffer import BufferReader
from vllm_patches.capture import Capture, CaptureSettings

PROMPT = [10, 11, 12, 13, 14]
VOCAB = 32


def new_request(rid: str) -> SimpleNamespace:
    params = SimpleNamespace(temperature=0.8, top_p=1.0, top_k=0, max_tokens=None, min_tokens=0,
                             stop_token_ids=[], ignore_eos=True, eos_token_id=None, extra_args=None)
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(PROMPT), sampling_params=params,
                           num_computed_tokens=0)


def schedule(cap: Capture, *, new=(), finished=(), scheduled=()) -> None:
    cap.on_schedule(SimpleNamespace(scheduled_new_reqs=list(new), preempted_req_ids=set(),
                                    finished_req_ids=set(finished),
                                    num_scheduled_tokens={rid: 1 for rid in scheduled}))


def run_step(cap: Capture, rids: list[str], num_drafts: list[int], logits: torch.Tensor) -> None:
    """One verification step of `rids` (anchor 4 each, after a prefill of the prompt): every draft
    token is 7 and the verifier accepts the first (so each sampled list is [7, 9], or [9] for none)."""
    schedule(cap, scheduled=rids)
    batch = SimpleNamespace(req_ids=rids, num_computed_tokens_cpu=np.array([len(PROMPT) - 1] * len(rids)))
    drafts = torch.tensor([7] * sum(num_drafts), dtype=torch.long)
    step = cap.snapshot_step(batch, SimpleNamespace(num_draft_tokens=num_drafts, draft_token_ids=drafts), logits)
    cap.on_output(step, rids, [[7, 9] if n else [9] for n in num_drafts])


def test_blocks_carry_the_top_k_of_their_own_logits_rows(tmp_path):
    """Rows per request are n + 1 consecutive ones (drafts, then bonus): "a" (2 drafts) owns rows 0-2,
    "b" (1 draft, not captured) rows 3-4, "c" (no draft this step) row 5, "d" (3 drafts) rows 6-9."""
    cap = Capture(CaptureSettings(buffer_dir=str(tmp_path), teacher_top_k=4, flush_interval_s=0.05, seed=0))
    schedule(cap, new=[new_request(r) for r in ("a", "c", "d")])
    for rid in ("a", "c", "d"):
        cap.on_output(None, [rid], [[6]])  # the prefill's token
    logits = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    run_step(cap, ["a", "b", "c", "d"], [2, 1, 0, 3], logits)
    assert torch.equal(logits, before)  # read only
    schedule(cap, finished=["a", "c", "d"])
    cap.close()
    records = {len(r.blocks[0].draft_tokens) if r.blocks else 0: r for r in BufferReader(tmp_path).iter_records()}
    assert sorted(records) == [0, 2, 3]  # "c" never speculated: a record without blocks
    expected = torch.log_softmax(logits, dim=-1).topk(4, dim=-1)
    for n, rows in ((2, slice(0, 3)), (3, slice(6, 10))):
        [block] = records[n].blocks
        assert block.num_accepted == 1
        assert torch.equal(torch.tensor(block.teacher.token_ids), expected.indices[rows])
        assert torch.allclose(torch.tensor(block.teacher.logprobs), expected.values[rows], atol=1e-6, rtol=0)
    assert cap.stats()["teacher_blocks"] == 2
    # "c"'s plain step: its one row, at the position before the token it sampled (prompt 0-4, 6 at 5, 9 at 6)
    plain = records[0].path_teacher
    assert plain.positions == (len(PROMPT),) and records[0].tokens[len(PROMPT) + 1] == 9
    assert torch.equal(torch.tensor(plain.rows.token_ids), expected.indices[5:6])
    assert torch.allclose(torch.tensor(plain.rows.logprobs), expected.values[5:6], atol=1e-6, rtol=0)
    assert records[2].path_teacher is None and cap.stats()["path_teacher_rows"] == 1


def test_plain_steps_keep_their_rows_by_position_and_only_for_kept_tokens(tmp_path):
    """Prefill (row of the last prompt token), two plain steps, a discarded sample (no row), then a stop
    token: the row that sampled a token after the stop is left out with the token."""
    cap = Capture(CaptureSettings(buffer_dir=str(tmp_path), teacher_top_k=3, flush_interval_s=0.05))
    request = new_request("a")
    request.sampling_params.stop_token_ids = [8]
    schedule(cap, new=[request])
    rows = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    meta = SimpleNamespace(num_draft_tokens=[0], draft_token_ids=torch.zeros(0, dtype=torch.long))
    batch = SimpleNamespace(req_ids=["a"], num_computed_tokens_cpu=np.array([0]))
    for j, sampled in enumerate(([6], [7], [], [8], [9])):
        cap.on_output(cap.snapshot_step(batch, meta, rows[j:j + 1]), ["a"], [sampled])
    schedule(cap, finished=["a"])
    cap.close()
    [record] = BufferReader(tmp_path).iter_records()
    assert record.tokens == tuple(PROMPT) + (6, 7, 8) and not record.blocks
    expected = torch.log_softmax(rows, dim=-1).topk(3, dim=-1)
    assert record.path_teacher.positions == (4, 5, 6)  # the rows that sampled 6, 7 and 8
    assert torch.equal(torch.tensor(record.path_teacher.rows.token_ids), expected.indices[[0, 1, 3]])


def test_teacher_capture_off_or_unsampled_leaves_blocks_without_it(tmp_path):
    for settings in ({"teacher_top_k": 0}, {"teacher_top_k": 4, "teacher_sample_rate": 0.0}):
        folder = tmp_path / str(len(settings))
        cap = Capture(CaptureSettings(buffer_dir=str(folder), flush_interval_s=0.05, **settings))
        schedule(cap, new=[new_request("a")])
        cap.on_output(None, ["a"], [[6]])
        run_step(cap, ["a"], [2], torch.randn(3, VOCAB))
        schedule(cap, finished=["a"])
        cap.close()
        [record] = BufferReader(folder).iter_records()
        assert [b.teacher for b in record.blocks] == [None]


def test_a_block_with_non_finite_logits_keeps_no_teacher_and_its_segment_stays_readable(tmp_path):
    cap = Capture(CaptureSettings(buffer_dir=str(tmp_path), teacher_top_k=4, flush_interval_s=0.05))
    schedule(cap, new=[new_request("a"), new_request("b")])
    cap.on_output(None, ["a", "b"], [[6], [6]])
    logits = torch.randn(6, VOCAB)
    logits[1] = float("nan")  # "a"'s second row
    run_step(cap, ["a", "b"], [2, 2], logits)
    schedule(cap, finished=["a", "b"])
    cap.close()
    teachers = [r.blocks[0].teacher for r in BufferReader(tmp_path).iter_records()]
    assert sorted(t is None for t in teachers) == [False, True]
    assert cap.stats()["errors"] == 0


def test_capture_settings_refuse_bad_teacher_values():
    with pytest.raises(ValueError):
        CaptureSettings(buffer_dir="x", teacher_top_k=-1)
    with pytest.raises(ValueError):
        CaptureSettings(buffer_dir="x", teacher_sample_rate=1.5)


@pytest.mark.slow
def test_captured_top_k_equals_an_hf_forward_of_the_target(tmp_path):
    """vLLM's real CPU engine (float32, a DFlash drafter at K = 4) at T = 0 and T = 0.8: every captured
    block's top-k ids and log-probabilities at its drafted positions and bonus position equal the
    HF target's log_softmax over the block's drafted prefix (rejected drafts included), and every record's
    captured features (capture.hidden_sample_rate) equal the target's aux hidden states on its tokens
    (positions start..T-2: no rejected draft's row left behind). Plain steps (K = 0 above batch size 1):
    each row kept at position p (SequenceRecord.path_teacher) equals the HF log_softmax at p over the
    record's tokens, and at T = 0 its top id is the record's token p + 1."""
    from online_opd.models.target import ensure_embedded_target

    target = ensure_embedded_target()
    script = Path(__file__).parent / "helpers" / "teacher_capture_check.py"
    proc = subprocess.run([sys.executable, str(script), str(target), str(tmp_path)],
                          env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["capture"]["errors"] == 0
    assert set(result["per_temperature"]) == {"0.0", "0.8"}
    hidden = result["hidden"]
    assert hidden["with_hidden"] == hidden["records"] >= 10, hidden
    assert hidden["rows"] == result["capture"]["hidden_rows"] > 0, hidden
    assert hidden["max_rel_diff"] < 1e-3, hidden  # |diff| / max(|value|, 1): float32 summation order only
    for temperature, figures in result["per_temperature"].items():
        assert figures["teacher_blocks"] == figures["blocks"] >= 5, (temperature, figures)
        assert figures["partial_blocks"] > 0, (temperature, figures)  # rows after a rejection too
        assert figures["id_mismatches"] == 0, (temperature, figures)
        assert figures["max_abs_diff"] < 1e-3, (temperature, figures)
        # plain steps (K = 0 above batch size 1): their rows along the record's own tokens
        assert figures["path_records"] >= 6 and figures["path_rows"] >= 50, (temperature, figures)
        assert figures["path_id_mismatches"] == 0 and figures["path_greedy_mismatches"] == 0, (temperature, figures)
        assert figures["path_max_abs_diff"] < 1e-3, (temperature, figures)
    assert result["capture"]["path_teacher_rows"] == sum(f["path_rows"] for f in result["per_temperature"].values())
