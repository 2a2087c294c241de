"""Packed vs per-block replay throughput (target + drafter forward, no backward).

Replays M chained blocks (anchor_{m+1} = a_m + r_m + 1, r_m uniform in 0..K,
starting at the middle of the sequence) of one sequence, once with
``replay_sequence`` (one packed target forward + one packed drafter forward)
and once with ``replay_sequence_naive`` (one of each per block), and prints
one JSON object with replayed block tokens (M * K) per second at each K.

Without ``--model`` the target is a random Llama with SmolLM2-135M's shape
(same compute as the real model). On a shared machine, ``--threads 1``
avoids OpenMP threads spinning while other processes hold the cores.
Example:

    python benchmarks/replay_throughput.py --K 8 16 --seq-len 512 --num-blocks 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from online_opd.models.drafters.dflash import DFlashConfig, DFlashDrafter, init_weights
from online_opd.models.target_model import TargetModel
from online_opd.opd.replay import replay_sequence, replay_sequence_naive
from online_opd.traces.records import BlockRecord

SMOLLM2_135M_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--K", type=int, nargs="+", default=[8, 16], help="block sizes to measure")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per replayed sequence")
    parser.add_argument("--num-blocks", type=int, default=16, help="blocks per sequence (fewer if they run out)")
    parser.add_argument("--model", default=None, help="HF folder of a real target (default: random SmolLM2-135M shape)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per measurement (after one warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load_target(path: str | None) -> TargetModel:
    if path:
        return TargetModel.from_pretrained(path)
    torch.manual_seed(0)
    return TargetModel(LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_SHAPE)))


def build_drafter(target: TargetModel, block_size: int) -> DFlashDrafter:
    """One-layer DFlash drafter shaped like the target, reading 5 spread layers."""
    cfg, num_layers = target.config, target.num_layers
    layer_ids = tuple(sorted({round(1 + i * (num_layers - 3) / 4) for i in range(5)}))
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=cfg.hidden_size, num_layers=1, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        target_layer_ids=layer_ids, mask_token_id=16, block_size=block_size,
    )).to(target.dtype)
    init_weights(drafter, seed=1)
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    return drafter.eval()


def chained_blocks(
    seq_len: int, num_blocks: int, block_size: int, vocab_size: int, gen: torch.Generator
) -> list[BlockRecord]:
    """Blocks as real decoding chains them, from the middle of the sequence on."""
    blocks, anchor = [], seq_len // 2
    while len(blocks) < num_blocks and anchor < seq_len:
        draft = torch.randint(0, vocab_size, (block_size,), generator=gen).tolist()
        r = int(torch.randint(0, block_size + 1, (), generator=gen))
        blocks.append(BlockRecord(anchor=anchor, draft_tokens=tuple(draft), num_accepted=r))
        anchor += r + 1
    return blocks


def tokens_per_s(replay, target, drafter, tokens, blocks, repeats: int) -> float:
    """Replayed block tokens (M * K) per second, after a warm-up run on two blocks."""
    with torch.no_grad():
        replay(target, drafter, tokens, blocks[:2])
        start = time.perf_counter()
        for _ in range(repeats):
            replay(target, drafter, tokens, blocks)
        elapsed = (time.perf_counter() - start) / repeats
    return len(blocks) * drafter.cfg.block_size / elapsed


def main() -> None:
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    target = load_target(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, target.config.vocab_size, (args.seq_len,), generator=gen)
    report: dict = {"K": {}}
    for block_size in args.K:
        drafter = build_drafter(target, block_size)
        blocks = chained_blocks(args.seq_len, args.num_blocks, block_size, target.config.vocab_size, gen)
        packed = tokens_per_s(replay_sequence, target, drafter, tokens, blocks, args.repeats)
        naive = tokens_per_s(replay_sequence_naive, target, drafter, tokens, blocks, args.repeats)
        report["K"][str(block_size)] = {
            "num_blocks": len(blocks),
            "packed_tokens_per_s": round(packed, 1),
            "naive_tokens_per_s": round(naive, 1),
            "speedup": round(packed / naive, 2),
        }
    report.update(seq_len=args.seq_len, num_blocks=args.num_blocks, torch_threads=torch.get_num_threads())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
