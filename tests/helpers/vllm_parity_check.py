"""Serve a `save_drafter` checkpoint (DFlash or EAGLE-3) with vLLM's CPU engine
and check, block by block, that vLLM drafts what our torch drafter drafts.

Usage: python vllm_parity_check.py METHOD TARGET_DIR OUT_DIR  (writes OUT_DIR/result.json)
METHOD: dflash, eagle3, dflash-reduced or eagle3-reduced (drafting over a 256-token draft
vocabulary, vLLM's draft_vocab_size with the d2t map; the vocabulary holds the continuation's
tokens; DFlash drafts argmaxed over the draft vocabulary, as online-opd serve installs it:
vllm_patches/draft_sample.py; EAGLE-3 through vLLM's own compute_logits, -inf outside it).

A drafter is first overfit for a few Adam steps on the target's greedy
continuation of the prompt, so that vLLM accepts some of its drafts (and
blocks of partial acceptance occur). Runs the engine in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), wraps the worker's EAGLE proposer
to record every (anchor, drafts) it proposes, then recomputes the same drafts with `Eagle3Drafter.propose` on the HF target's
aux hidden states of the final sequence. Also checks the speculative output
against the target's own greedy choice at every position (teacher-forced
HF forward; near-ties within 1e-4 accepted), vLLM's spec counters against
the acceptance predicted from the drafts, and that the target's aux layers
are the ones written in config.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import torch  # noqa: E402

K = 4
MAX_TOKENS = 40
TRAIN_STEPS = 60
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
REDUCED_VOCAB = 256


def _install_hook(worker):
    drafter = worker.model_runner.drafter
    records = worker._parity_records = []
    original = drafter.propose

    def propose(*args, **kwargs):
        out = original(*args, **kwargs)
        positions = kwargs["target_positions"]
        idx = kwargs["token_indices_to_sample"]
        if idx is None:
            idx = kwargs["common_attn_metadata"].query_start_loc[1:] - 1
            rejected = kwargs.get("num_rejected_tokens_gpu")
            if rejected is not None:  # padded batches: last *valid* context token
                idx = idx - rejected
        records.append({
            "anchors": (positions[idx.long()] + 1).tolist(),
            "anchor_tokens": kwargs["next_token_ids"].tolist(),
            "drafts": out.tolist(),
        })
        return out

    drafter.propose = propose
    return {
        "lm_head_rows": int(getattr(getattr(drafter.model, "lm_head", None), "weight", torch.empty(0)).shape[0]),
        "proposer": type(drafter).__name__,
        "draft_space_argmax": hasattr(type(drafter)._greedy_sample, "__wrapped__"),
        "model": type(drafter.model).__name__,
        "aux_layers": list(worker.model_runner.model.model.aux_hidden_state_layers),
    }


def _records(worker):
    return worker._parity_records


def overfit(drafter, target_model, prompt, steps: int = TRAIN_STEPS) -> None:
    """A few Adam steps of block cross-entropy on the target's own greedy
    continuation of `prompt`, so that vLLM accepts some drafts (the
    accepted-token paths of the proposer get exercised, not just rejections)."""
    import torch.nn.functional as F

    with torch.no_grad():
        seq = target_model.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                          do_sample=False)[0]
        aux = target_model.forward(seq, tuple(drafter.target_layer_ids)).aux_hidden
    anchors = torch.arange(len(prompt), len(seq) - 1)
    idx = anchors[:, None] + 1 + torch.arange(K)[None, :]
    labels = torch.where(idx < len(seq), seq[idx.clamp(max=len(seq) - 1)], -100)
    opt = torch.optim.Adam(drafter.parameters(), lr=2e-3)
    for _ in range(steps):
        logits = drafter(aux, anchors, seq[anchors], token_ids=seq)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.zero_grad(set_to_none=True)


def build_drafter(method: str, target: str, target_model):
    from transformers import AutoConfig, AutoTokenizer

    from online_opd.config import DrafterConfig
    from online_opd.models.drafters.dflash import init_weights
    from online_opd.models.drafters.eagle3 import Eagle3Drafter
    from online_opd.models.drafters.factory import new_drafter

    reduced = method.endswith("-reduced")
    cfg = DrafterConfig(method=method.removesuffix("-reduced"), block_size=K, seed=0,
                        draft_vocab_size=REDUCED_VOCAB if reduced else None)
    if cfg.method == "dflash":
        return new_drafter(cfg, target_model.config, AutoTokenizer.from_pretrained(target), target_model)
    drafter = Eagle3Drafter.from_target(cfg, AutoConfig.from_pretrained(target))
    # std 0.2 instead of 0.02: the drafter's own layers then move its drafts,
    # so the K steps of a block differ and the chain is really compared
    init_weights(drafter, std=0.2, seed=0)
    return drafter


def main(method: str, target: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    from online_opd.models.drafters.checkpoint import load_drafter, save_drafter
    from online_opd.models.target_model import TargetModel
    from serve.engine import chat_prompt_ids, generate, make_llm, shutdown, spec_counters

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = chat_prompt_ids(tokenizer, [PROMPT])[0]
    target_model = TargetModel.from_pretrained(target)
    drafter = build_drafter(method, target, target_model)
    drafter.attach_target(target_model.embed_weight, target_model.lm_head_weight)
    if method.endswith("-reduced"):  # the continuation's tokens, then the lowest ids
        from online_opd.models.drafters.vocab import select_draft_vocab

        with torch.no_grad():
            seq = target_model.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        counts = torch.bincount(seq, minlength=drafter.cfg.vocab_size)
        drafter.set_draft_vocab(select_draft_vocab(counts, REDUCED_VOCAB, required=[tokenizer.eos_token_id]))
    overfit(drafter, target_model, prompt)
    ckpt = save_drafter(drafter, out / f"{method}-drafter")

    if method == "dflash-reduced":  # as online-opd serve drafts: the argmax over the draft vocabulary
        from vllm_patches import draft_sample

        draft_sample.install()
    llm = make_llm(target, dtype="float32", max_model_len=512, drafter=ckpt,
                   num_speculative_tokens=K, method=method.removesuffix("-reduced"))
    info = llm.collective_rpc(_install_hook)[0]
    before = spec_counters(llm)
    gen = generate(llm, [prompt], max_tokens=MAX_TOKENS, progress=False)[0]
    spec = spec_counters(llm) - before
    records = llm.collective_rpc(_records)[0]
    shutdown(llm)

    # HF side: target aux states and greedy choices on the final sequence
    seq = torch.tensor(gen.prompt_ids + gen.output_ids)
    served = load_drafter(ckpt)
    served.attach_target(target_model.embed_weight, target_model.lm_head_weight)
    tout = target_model.forward(seq, tuple(served.target_layer_ids))
    logits = tout.logits
    p = len(gen.prompt_ids)
    greedy_ok = []
    for i, tok in enumerate(gen.output_ids):
        row = logits[p - 1 + i]
        greedy_ok.append(bool(row[tok] >= row.max() - 1e-4))

    compared = matched = blocks = blocks_matched = predicted_accepted = 0
    chain_ok, prev_next = True, None
    details = []
    for rec in records:
        for a, tok, drafts in zip(rec["anchors"], rec["anchor_tokens"], rec["drafts"]):
            if a >= len(seq):  # bonus token beyond the returned output
                continue
            assert int(seq[a]) == tok, (a, int(seq[a]), tok)
            # greedy verification: the next anchor follows from the accepted prefix
            chain_ok &= prev_next is None or a == prev_next
            accepted = 0
            while accepted < K and a + 1 + accepted < len(seq) and \
                    drafts[accepted] == int(seq[a + 1 + accepted]):
                accepted += 1
            predicted_accepted += accepted
            prev_next = a + accepted + 1
            ours = served.propose(tout.aux_hidden[:a], torch.tensor([a]), seq[[a]], seq[:a])[0]
            hits = [int(x) == y for x, y in zip(ours.tolist(), drafts)]
            compared += len(hits)
            matched += sum(hits)
            blocks += 1
            blocks_matched += all(hits)
            details.append({"anchor": a, "vllm": drafts, "ours": ours.tolist(),
                            "accepted": accepted})

    result = {
        "k": K,
        "draft_vocab_size": served.cfg.draft_vocab_size,
        "served_head_rows": info.get("lm_head_rows"),
        "info": info,
            "config_aux_ids": _config_aux_ids(ckpt),
        "num_output_tokens": len(gen.output_ids),
        "output_ids": gen.output_ids,
        "output_text": tokenizer.decode(gen.output_ids),
        "output_is_target_greedy": all(greedy_ok),
        "spec": {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                 "num_accepted_tokens": spec.num_accepted_tokens},
        "num_compared": compared,
        "anchor_chain_ok": bool(chain_ok),
        "predicted_accepted": predicted_accepted,
        "draft_match_rate": matched / max(compared, 1),
        "block_match_rate": blocks_matched / max(blocks, 1),
        "blocks_varying": sum(len(set(d["vllm"])) > 1 for d in details) / max(len(details), 1),
        "details": details,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("details", "output_ids")},
                     indent=2))


def _config_aux_ids(ckpt: Path) -> list[int]:
    """vLLM's aux layer ids as written in config.json (DFlash ids are +1 in vLLM)."""
    hf = json.loads((ckpt / "config.json").read_text())
    if "dflash_config" in hf:
        return [i + 1 for i in hf["dflash_config"]["target_layer_ids"]]
    return hf["eagle_aux_hidden_state_layer_ids"]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
