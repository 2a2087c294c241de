"""vLLM's real CPU engine serves a DFlash checkpoint saved by this project,
and drafts exactly what the project's torch drafter drafts (parity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dflash", "dflash-reduced"])
def test_vllm_drafts_what_the_trainer_drafts(tmp_path, variant):
    """The drafter is briefly overfit on the prompt's greedy continuation so
    that vLLM accepts some blocks in full, some in part and rejects others.
    Every block vLLM drafts (recorded in the worker) equals our greedy block
    at the same anchor; anchors advance by accepted + 1; vLLM's accepted count
    equals the count predicted from those blocks; output stays the target's. "dflash-reduced"
    drafts over a 256-token vocabulary: vLLM loads the saved head rows and d2t map, and drafts take
    their argmax over the draft vocabulary as online-opd serve installs it (draft_sample.py)."""
    from online_opd.models.target import ensure_embedded_target

    target = ensure_embedded_target()
    script = Path(__file__).parent / "helpers" / "vllm_parity_check.py"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(script), variant, str(target), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["info"]["proposer"] == "DFlashProposer"
    assert result["info"]["model"] == "DFlashQwen3ForCausalLM"
    assert result["info"]["draft_space_argmax"] == (variant == "dflash-reduced")  # draft_sample.py
    assert result["info"]["aux_layers"] == result["config_aux_ids"]
    vocab = 256 if variant == "dflash-reduced" else None
    assert result["draft_vocab_size"] == vocab
    assert result["served_head_rows"] == (vocab or 49152)  # vLLM's own reduced head, or the target's
    assert result["output_is_target_greedy"]
    spec = result["spec"]
    assert spec["num_draft_tokens"] == spec["num_drafts"] * result["k"]
    assert result["num_compared"] >= 5 * result["k"]
    assert result["draft_match_rate"] == 1.0, result["details"]
    assert result["anchor_chain_ok"]
    accepted = [d["accepted"] for d in result["details"]]
    assert any(0 < r < result["k"] for r in accepted), accepted  # partial blocks occur
    assert spec["num_accepted_tokens"] == result["predicted_accepted"] > 0
