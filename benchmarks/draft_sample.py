"""What the DFlash drafter's greedy sampling costs inside vLLM's engine: vLLM's method against
online-opd's argmax over the draft vocabulary (vllm_patches/draft_sample.py), on the same calls.

vLLM's CPU engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with a drafter that has
a draft vocabulary (default: a bootstrap run's), K speculative tokens at every step, and decodes
`--batch-sizes` batches of ShareGPT prompts. In the worker every ``_greedy_sample`` call runs both
methods on the same hidden states, in alternating order, timing each, and checks that both give the
same tokens; the engine drafts with vLLM's. Per batch size the JSON gives the calls, the rows per
call (batch x K), the median milliseconds of each method over the calls with every request
decoding, the saving per call, and for scale the engine's mean step at that batch (prefill steps
included; the draft-space method's time, run on top, taken out).

    python benchmarks/draft_sample.py --drafter runs/bootstrap/drafter --out benchmarks/results/draft_sample.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker is this process
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from online_opd.config import load_config  # noqa: E402
from serve.launcher import emit_result  # noqa: E402

logger = logging.getLogger("draft_sample")


def _install_timer(worker):
    """Wrap the proposer's _greedy_sample: both methods on every call, timed, compared."""
    import time as _time

    import torch

    from vllm_patches import draft_sample

    proposer = worker.model_runner.drafter
    vllm_method = type(proposer)._greedy_sample
    vllm_method = getattr(vllm_method, "__wrapped__", vllm_method)
    log = worker._draft_sample_log = []

    def ours(hidden):
        logits, d2t = draft_sample.draft_space_logits(proposer.model, hidden)
        return draft_sample.greedy_target_ids(logits, d2t)

    def timed(fn, hidden):
        start = _time.perf_counter()
        out = fn(hidden)
        return out, _time.perf_counter() - start

    def greedy(hidden):
        first_ours = len(log) % 2 == 1
        if first_ours:
            b, tb = timed(ours, hidden)
            a, ta = timed(lambda h: vllm_method(proposer, h), hidden)
        else:
            a, ta = timed(lambda h: vllm_method(proposer, h), hidden)
            b, tb = timed(ours, hidden)
        log.append((int(hidden.shape[0]), ta, tb, bool(torch.equal(a, b))))
        return a

    proposer._greedy_sample = greedy
    d2t = getattr(proposer.model, "draft_id_to_target_id", None)
    return {"draft_vocab_size": None if d2t is None else int(d2t.shape[0]),
            "vocab_size": int(proposer.model.config.vocab_size)}


def _take_log(worker):
    log, worker._draft_sample_log[:] = list(worker._draft_sample_log), []
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--drafter", type=Path, default=ROOT / "runs" / "bootstrap" / "drafter",
                        help="a DFlash checkpoint with a draft vocabulary (draft_vocab_size)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.drafter / "config.json").exists():
        raise SystemExit(f"{args.drafter}: not a drafter checkpoint (run `make bootstrap` first)")

    from online_opd.data import load_prompts
    from serve.cpu_runtime import runtime_env_for
    from serve.engine import chat_prompt_ids, generate, make_llm, shutdown
    from serve.pipeline import load_tokenizer, resolve_target

    cfg = load_config(args.config, [])
    target = resolve_target(cfg)
    tokenizer = load_tokenizer(target)
    held_out = load_prompts("sharegpt", num_prompts=max(args.batch_sizes), split="held_out")
    prompts = chat_prompt_ids(tokenizer, [p.messages for p in held_out])
    llm = make_llm(target, dtype=cfg.model.serving_dtype(), max_model_len=1024, drafter=args.drafter,
                   num_speculative_tokens=args.num_speculative_tokens,
                   runtime_env=runtime_env_for(cfg.cpu.openmp, cfg.cpu.reserved_cores))
    info = llm.collective_rpc(_install_timer)[0]
    if info["draft_vocab_size"] is None:
        raise SystemExit(f"{args.drafter}: drafts over the target's whole vocabulary; nothing to compare")
    generate(llm, prompts[:2], max_tokens=8, progress=False)  # warm-up
    llm.collective_rpc(_take_log)
    rows = []
    for batch in args.batch_sizes:
        start = time.perf_counter()
        generate(llm, prompts[:batch], max_tokens=args.max_tokens, progress=False)
        wall = time.perf_counter() - start
        log = [entry for entry in llm.collective_rpc(_take_log)[0]]
        decode = [e for e in log if e[0] == batch * args.num_speculative_tokens]  # all requests decoding
        vllm_ms = statistics.median(e[1] for e in decode) * 1e3
        ours_ms = statistics.median(e[2] for e in decode) * 1e3
        rows.append({"batch_size": batch, "calls": len(log), "decode_calls": len(decode),
                     "rows_per_call": batch * args.num_speculative_tokens,
                     "vllm_ms": round(vllm_ms, 3), "draft_space_ms": round(ours_ms, 3),
                     "saved_ms_per_call": round(vllm_ms - ours_ms, 3),
                     "same_tokens": all(e[3] for e in log),
                     # the engine's mean step, less the draft-space method's own time (run on top)
                     "step_ms": round((wall - sum(e[2] for e in log)) / max(1, len(log)) * 1e3, 2)})
        logger.info("b=%d: vLLM %.2f ms, draft-space %.2f ms per call (%d calls), step ~%.1f ms", batch,
                    vllm_ms, ours_ms, len(decode), rows[-1]["step_ms"])
    shutdown(llm)
    emit_result({"command": " ".join(["benchmarks/draft_sample.py", *sys.argv[1:]]),
                 "drafter": str(args.drafter), "dtype": cfg.model.serving_dtype(), **info,
                 "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
                 "rows": rows}, args.out)


if __name__ == "__main__":
    main()
