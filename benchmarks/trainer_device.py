"""Online trainer throughput on one device: Draft-OPD steps at the default serving shape, CPU or GPU.

Runs the trainer's own loop (``train.loop.train``: replay, backward, AdamW, clipping, metrics) on
synthetic records at SmolLM2-135M's shape (a random target: the same compute as the real model), with the
default drafter (DFlash, 1 layer, K = 4, draft vocabulary 8192) and the default step
(``trainer.sequences_per_step`` 4 x ``anchors_per_sequence`` 16), and prints one JSON object: the median
step time and the trainer's tokens per second, as the online trainer counts them:

- ``replayed_tokens_per_s``: sequence plus appended draft tokens the packed forwards ran over;
- ``trained_tokens_per_s``: served tokens of the replayed blocks (sum of r + 1), the numerator of the
  domain-shift benchmark's keep-up ratio (trained / served tokens per second).

``--captured`` gives every block the verifier's top-k (``--top-k``) and every record its aux hidden states
in bfloat16 (capture.teacher_top_k / hidden_sample_rate): replay then runs no target forward. Float32
matmuls stay exact (no TF32) unless ``--tf32``. Examples:

    python benchmarks/trainer_device.py --device cpu --steps 5
    python benchmarks/trainer_device.py --device cuda --steps 50 --captured
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from replay_throughput import SMOLLM2_135M_SHAPE  # sibling module: benchmarks/ leads sys.path
from transformers import LlamaConfig, LlamaForCausalLM

from online_opd.config import TrainerConfig
from online_opd.models.drafters.dflash import DFlashConfig, DFlashDrafter, init_weights
from online_opd.models.target_model import TargetModel
from online_opd.opd.teacher_rows import top_k_teacher
from online_opd.traces.records import BlockRecord, SequenceRecord
from online_opd.traces.target_signal import TargetHidden
from online_opd.train.loop import train
from online_opd.train.opd import opd_step_fn

LAYER_IDS = (1, 8, 14, 20, 27)  # the default drafter's target layers at SmolLM2-135M's 30 (runs/bootstrap)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device of the trainer (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup steps)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (allocator, kernels)")
    parser.add_argument("--objective", default="draft_opd", choices=["draft_opd", "target_rollout"])
    parser.add_argument("--records", type=int, default=32, help="synthetic records the steps draw from")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192, help="output tokens per record (data.max_new_tokens)")
    parser.add_argument("--K", type=int, default=4, help="drafter block size")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary (0: the full 49152)")
    parser.add_argument("--sequences-per-step", type=int, default=4)
    parser.add_argument("--anchors-per-sequence", type=int, default=16)
    parser.add_argument("--captured", action="store_true", help="records carry the teacher and the features")
    parser.add_argument("--top-k", type=int, default=20, help="captured teacher's k (with --captured)")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_models(args: argparse.Namespace, device: torch.device) -> tuple[TargetModel, DFlashDrafter]:
    torch.manual_seed(args.seed)
    target = TargetModel(LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_SHAPE)))
    cfg = target.config
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=cfg.hidden_size, num_layers=1, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, target_layer_ids=LAYER_IDS, mask_token_id=16, block_size=args.K,
        draft_vocab_size=args.draft_vocab or None))
    init_weights(drafter, seed=args.seed + 1)
    target.model.to(device)
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    if args.draft_vocab:
        drafter.set_draft_vocab(torch.arange(args.draft_vocab))
    return target, drafter.to(device)


def synthetic_records(args: argparse.Namespace, target: TargetModel, device: torch.device) -> list[SequenceRecord]:
    """Random sequences decoded in chained blocks (anchor_{m+1} = a_m + r_m + 1, r uniform in 0..K, the
    accepted drafts equal to the sequence, the rest random); with ``--captured`` each block's teacher is
    the target's top-k over x_<=a, d_1..d_K and each record's features its aux hidden states."""
    gen = torch.Generator().manual_seed(args.seed)
    vocab, length = target.config.vocab_size, args.prompt_len + args.new_tokens
    records = []
    for i in range(args.records):
        tokens = torch.randint(0, vocab, (length,), generator=gen)
        blocks, anchor = [], args.prompt_len - 1
        while anchor + args.K < length - 1:
            r = int(torch.randint(0, args.K + 1, (), generator=gen))
            draft = tokens[anchor + 1:anchor + 1 + r].tolist() + \
                torch.randint(0, vocab, (args.K - r,), generator=gen).tolist()
            blocks.append(BlockRecord(anchor=anchor, draft_tokens=tuple(draft), num_accepted=r))
            anchor += r + 1
        hidden = None
        if args.captured:
            with torch.no_grad():
                on = tokens.to(device)
                blocks = [dataclasses.replace(b, teacher=top_k_teacher(target.forward(torch.cat(
                    [on[: b.anchor + 1], torch.tensor(b.draft_tokens, device=device)])).logits[b.anchor:], args.top_k))
                    for b in blocks]
                aux = target.forward(on[:-1], LAYER_IDS, logits_at=on.new_empty(0)).aux_hidden
            hidden = TargetHidden.from_tensor(0, aux.to(torch.bfloat16))
        records.append(SequenceRecord(f"syn-{i}", "smollm2-135m-shape", "v0001", 0.0, 1.0, 0,
                                      tuple(tokens.tolist()), args.prompt_len, tuple(blocks), hidden=hidden))
    return records


def main() -> None:
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    target, drafter = build_models(args, device)
    t0 = time.perf_counter()
    records = synthetic_records(args, target, device)
    setup_s = time.perf_counter() - t0
    cfg = TrainerConfig(objective=args.objective, num_steps=args.warmup + args.steps, warmup_ratio=0.0,
                        sequences_per_step=args.sequences_per_step, anchors_per_sequence=args.anchors_per_sequence,
                        checkpoint_every=10**9, log_every=10**9)
    step_fn = opd_step_fn(target, drafter, records, cfg, generator=torch.Generator().manual_seed(args.seed),
                          device=device)

    with tempfile.TemporaryDirectory() as run_dir:
        train(step_fn, drafter, cfg, Path(run_dir), progress=False)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup:]
    step_s = statistics.median(r["step_s"] for r in timed)
    total_s = sum(r["step_s"] for r in timed)
    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "tf32": args.tf32,
        "objective": args.objective, "captured": args.captured, "top_k": args.top_k if args.captured else None,
        "K": args.K, "draft_vocab": args.draft_vocab, "sequence_len": args.prompt_len + args.new_tokens,
        "sequences_per_step": args.sequences_per_step, "anchors_per_sequence": args.anchors_per_sequence,
        "steps_timed": len(timed), "median_step_s": round(step_s, 5),
        "replayed_tokens_per_s": round(sum(r["replayed_tokens"] for r in timed) / total_s, 1),
        "trained_tokens_per_s": round(sum(r["block_tokens"] for r in timed) / total_s, 1),
        "final_loss": round(timed[-1]["loss"], 5), "setup_s": round(setup_s, 2),
    }
    if device.type == "cuda":
        report["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
