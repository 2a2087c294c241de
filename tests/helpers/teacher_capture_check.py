"""Serve the embedded target with vLLM's CPU engine (a DFlash drafter, K = 4, float32) with the
capture's teacher signal and target features on, then check every captured block's top-k
log-probabilities against an independent Hugging Face forward of the target over the block's drafted
prefix, and every record's captured features against the target's aux hidden states on the record's
tokens.

Usage: python teacher_capture_check.py TARGET_DIR OUT_DIR  (writes OUT_DIR/result.json)

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the online-opd plugin and
the capture configured through ``ONLINE_OPD_CAPTURE``, as ``online-opd serve`` configures it.
Requests run at temperature 0 and 0.8: the captured rows are the raw (T = 1) distribution either
way, read before the rejection sampler scales them. For each block at anchor a with drafts
d_1..d_n: HF logits at rows a..a+n of x_<=a + d_1..d_n (n drafted positions and the bonus
position), log_softmax in float32, compared id by id with the captured top-k. The drafter is
vllm_parity_check's (a few Adam steps on the target's continuation of one prompt), so some drafts are
accepted and others rejected: a rejected draft's feature row must be replaced by its position's final one.

Plain steps. The engine serves K = 4 at batch size 1 and K = 0 above it (vLLM's
``num_speculative_tokens_per_batch_size``): each temperature runs the prompts once as one batch (plain
steps until one request is left) and once one by one (drafted blocks). Every record's plain-step rows
(``SequenceRecord.path_teacher``, position p: the row its token p + 1 was sampled from) are checked
against the HF log_softmax at p over the record's own tokens, and at T = 0 their top id against the token.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).parent))

TOP_K = 8
MAX_TOKENS = 48
# Prompt lookup drafts where the context repeats: prompts that make the answer copy their text.
PROMPTS = [
    "Repeat this list exactly three times, separated by commas: red apple, green pear, yellow banana, "
    "purple grape.",
    "Copy the following sentence twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Write the numbers from one to twenty in words, separated by commas.",
    "Say 'hello world' five times, each on its own line.",
    "Spell the word 'banana' letter by letter, then write the word 'banana' three times.",
    "List the days of the week twice, separated by commas.",
]


def main(target: str, out_dir: str) -> None:
    out = Path(out_dir)
    from serve.server import PLUGIN_NAMES
    from vllm_patches import CAPTURE_ENV
    from vllm_patches.capture import CaptureSettings
    from vllm_patches.model_runner import v1_runner_env

    os.environ["VLLM_PLUGINS"] = ",".join(PLUGIN_NAMES)
    os.environ.update(v1_runner_env(os.environ))
    os.environ[CAPTURE_ENV] = CaptureSettings(buffer_dir=str(out / "buffer"), teacher_top_k=TOP_K,
                                              hidden_sample_rate=1.0, flush_interval_s=0.2, seed=0).to_env()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm_parity_check import PROMPT, K, build_drafter, overfit

    from online_opd.models.drafters.checkpoint import save_drafter
    from online_opd.models.target_model import TargetModel
    from online_opd.traces.buffer import BufferReader
    from serve.engine import chat_prompt_ids, generate, make_llm, shutdown
    from vllm_patches import capture_hooks

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = chat_prompt_ids(tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS])
    target_model = TargetModel.from_pretrained(target)
    drafter = build_drafter("dflash", target, target_model)
    drafter.attach_target(target_model.embed_weight, target_model.lm_head_weight)
    overfit(drafter, target_model, chat_prompt_ids(tokenizer, [PROMPT])[0])
    ckpt = save_drafter(drafter, out / "drafter")
    layer_ids = tuple(drafter.target_layer_ids)
    llm = make_llm(target, dtype="float32", max_model_len=512, speculative_config={
        "method": "dflash", "model": str(ckpt), "num_speculative_tokens": K,
        "num_speculative_tokens_per_batch_size": [[1, 1, K], [2, 64, 0]]})
    temperatures = {}
    for temperature in (0.0, 0.8):
        for batch in [prompts] + [[p] for p in prompts]:  # plain steps (b > 1), then drafted blocks (b = 1)
            for g in generate(llm, batch, max_tokens=MAX_TOKENS, temperature=temperature, seed=1, progress=False):
                temperatures[tuple(g.prompt_ids + g.output_ids)] = temperature
    cap = capture_hooks.current()
    stats = cap.stats() if cap is not None else {}
    if cap is not None:
        cap.close()
    shutdown(llm)

    records = list(BufferReader(out / "buffer").iter_records())
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    per_temperature: dict[str, dict] = {}
    hidden = {"records": 0, "with_hidden": 0, "start_zero": 0, "rows": 0, "max_abs_diff": 0.0,
              "max_rel_diff": 0.0}
    for record in records:
        hidden["records"] += 1
        if record.hidden is not None:
            hidden["with_hidden"] += 1
            hidden["start_zero"] += int(record.hidden.start == 0)
            seq = torch.tensor(record.tokens)
            with torch.no_grad():
                aux = target_model.forward(seq, layer_ids, logits_at=seq.new_empty(0)).aux_hidden.float()
            rows = record.hidden.to_tensor().float()
            reference = aux[record.hidden.start:len(seq) - 1]
            if rows.shape != reference.shape:
                raise AssertionError(f"hidden rows {tuple(rows.shape)} for positions "
                                     f"{record.hidden.start}..{len(seq) - 2} of width {aux.shape[1]}")
            hidden["rows"] += rows.shape[0]
            diff = (rows - reference).abs()
            hidden["max_abs_diff"] = max(hidden["max_abs_diff"], float(diff.max()))
            hidden["max_rel_diff"] = max(hidden["max_rel_diff"],
                                         float((diff / reference.abs().clamp(min=1.0)).max()))
        figures = per_temperature.setdefault(str(record.temperature), {
            "records": 0, "blocks": 0, "teacher_blocks": 0, "rows": 0, "max_abs_diff": 0.0,
            "id_mismatches": 0, "near_tie_mismatches": 0, "partial_blocks": 0, "path_records": 0,
            "path_rows": 0, "path_max_abs_diff": 0.0, "path_id_mismatches": 0, "path_near_ties": 0,
            "path_greedy_mismatches": 0})
        figures["records"] += 1
        if record.path_teacher is not None:
            check_path_rows(model, record, figures)
        for block in record.blocks:
            figures["blocks"] += 1
            if block.teacher is None:
                continue
            figures["teacher_blocks"] += 1
            n = len(block.draft_tokens)
            figures["partial_blocks"] += int(block.num_accepted < n)
            seq = torch.tensor(list(record.tokens[:block.anchor + 1]) + list(block.draft_tokens))
            with torch.no_grad():
                logits = model(input_ids=seq[None]).logits[0, block.anchor:block.anchor + n + 1].float()
            logprobs = torch.log_softmax(logits, dim=-1)  # [n + 1, vocab]
            captured_ids = torch.tensor(block.teacher.token_ids)
            captured = torch.tensor(block.teacher.logprobs)
            if captured_ids.shape != (n + 1, TOP_K):
                raise AssertionError(f"teacher shape {tuple(captured_ids.shape)} for a {n}-token block")
            figures["rows"] += n + 1
            reference = logprobs.gather(1, captured_ids)  # HF's log-probabilities of the captured ids
            figures["max_abs_diff"] = max(figures["max_abs_diff"], float((reference - captured).abs().max()))
            top = logprobs.topk(TOP_K, dim=-1)
            for j in range(n + 1):
                if top.indices[j].tolist() != captured_ids[j].tolist():
                    # order differs: only allowed between values HF itself finds within 1e-4
                    gap = float((top.values[j] - reference[j]).abs().max())
                    figures["near_tie_mismatches" if gap <= 1e-4 else "id_mismatches"] += 1
    result = {"capture": stats, "per_temperature": per_temperature, "hidden": hidden, "num_records": len(records),
              "num_requests": len(temperatures), "top_k": TOP_K}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def check_path_rows(model, record, figures: dict) -> None:
    """The record's plain-step rows against the HF log_softmax at their positions over its own tokens."""
    import torch

    positions = list(record.path_teacher.positions)
    seq = torch.tensor(record.tokens)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=seq[None]).logits[0, positions].float(), dim=-1)
    captured_ids = torch.tensor(record.path_teacher.rows.token_ids)
    captured = torch.tensor(record.path_teacher.rows.logprobs)
    reference = logprobs.gather(1, captured_ids)
    figures["path_records"] += 1
    figures["path_rows"] += len(positions)
    figures["path_max_abs_diff"] = max(figures["path_max_abs_diff"], float((reference - captured).abs().max()))
    top = logprobs.topk(TOP_K, dim=-1)
    for j, p in enumerate(positions):
        near_tie = float((top.values[j] - reference[j]).abs().max()) <= 1e-4
        if top.indices[j].tolist() != captured_ids[j].tolist():
            figures["path_near_ties" if near_tie else "path_id_mismatches"] += 1
        if record.temperature == 0 and int(captured_ids[j, 0]) != record.tokens[p + 1] and \
                float(top.values[j, 0] - logprobs[j, record.tokens[p + 1]]) > 1e-4:
            figures["path_greedy_mismatches"] += 1  # the row is not the one the greedy token came from


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
