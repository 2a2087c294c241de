"""Does the bootstrap gain from computing its text features beside its SFT (bootstrap.overlap_features)?

Measures, on this machine, the two CPU phases of `online-opd bootstrap` from a finished bootstrap run's
drafter and sequences: an SFT step (seconds) and the teacher-forced text feature pass (tokens/s), each
alone at N and at 1 torch thread, then both at once in two processes, 1 thread each. Prints JSON:
`overlap_gain` is the work per second of the overlapped pair in units of the phases alone at N threads
(feature share + SFT share; 1.0 = nothing gained by overlapping).

    python benchmarks/bootstrap_overlap.py --run-dir runs/bootstrap [--out F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import torch

SFT_STEPS = 8
FEATURE_SECONDS = 30.0


def _setup(run_dir: Path):
    from online_opd.config import OnlineOPDConfig
    from online_opd.train.sequences import load_sequences
    from serve.feature_stream import chunks
    from serve.pipeline import SEQUENCES_FILE, TEXT_SEQUENCES_FILE, load_serving_drafter, resolve_target

    cfg = OnlineOPDConfig.model_validate(json.loads((run_dir / "config.json").read_text()))
    target = resolve_target(cfg, progress=False)
    drafter, _ = load_serving_drafter(run_dir / "drafter", target)
    ids = tuple(drafter.target_layer_ids)
    text_files = ([run_dir / TEXT_SEQUENCES_FILE] if (run_dir / TEXT_SEQUENCES_FILE).exists()
                  else [p for _, _, p in chunks(run_dir / "text_stream")])
    text = [s for path in text_files for s in load_sequences(path, ids)]
    rollouts = load_sequences(run_dir / SEQUENCES_FILE, ids) if (run_dir / SEQUENCES_FILE).exists() else []
    if not text:
        raise SystemExit(f"{run_dir}: no text sequences ({TEXT_SEQUENCES_FILE} or text_stream/ chunks)")
    return cfg, target, drafter, ids, rollouts + text, text


def sft_step_s(setup, threads: int, steps: int = SFT_STEPS) -> float:
    from online_opd.train.loop import time_steps
    from serve.pipeline import _sft_step_fn

    torch.set_num_threads(threads)
    cfg, _, drafter, _, pool, _ = setup
    return time_steps(lambda m: _sft_step_fn(m, pool, cfg.bootstrap, torch.Generator().manual_seed(0)),
                      drafter, cfg.bootstrap, num_steps=steps)


def feature_tokens_per_s(setup, model, threads: int, seconds: float = FEATURE_SECONDS) -> float:
    from online_opd.train.sequences import TrainSequence, compute_aux_hidden

    torch.set_num_threads(threads)
    _, _, _, ids, _, text = setup
    start, tokens = time.perf_counter(), 0
    for seq in text:
        compute_aux_hidden(model, [TrainSequence(seq.tokens.clone(), seq.prompt_len)], ids, with_labels=True,
                           progress=False)
        tokens += seq.num_tokens
        if time.perf_counter() - start >= seconds:
            break
    return tokens / (time.perf_counter() - start)


def _target(setup):
    from online_opd.models.target_model import TargetModel
    from serve.pipeline import feature_dtype

    return TargetModel.from_pretrained(setup[1], dtype=feature_dtype(setup[0]))


def _child(kind: str, run_dir: str, barrier, results) -> None:
    torch.set_num_threads(1)
    setup = _setup(Path(run_dir))  # everything loaded before the start line
    model = _target(setup) if kind == "feat" else None
    barrier.wait()
    results[kind] = (sft_step_s(setup, 1, steps=4 * SFT_STEPS) if kind == "sft"
                     else feature_tokens_per_s(setup, model, 1))


def concurrent(run_dir: Path) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier, results = manager.Barrier(2), manager.dict()
        procs = [ctx.Process(target=_child, args=(kind, str(run_dir), barrier, results)) for kind in ("sft", "feat")]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return {"sft_step_s": results.get("sft"), "feature_tokens_per_s": results.get("feat")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a finished bootstrap run (drafter, sequences)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the machine's threads")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    setup = _setup(args.run_dir)
    model = _target(setup)
    alone = {n: {"sft_step_s": sft_step_s(setup, n), "feature_tokens_per_s": feature_tokens_per_s(setup, model, n)}
             for n in (args.threads, 1)}
    del model
    both = concurrent(args.run_dir)
    full = alone[args.threads]
    gain = (both["feature_tokens_per_s"] / full["feature_tokens_per_s"] + full["sft_step_s"] / both["sft_step_s"])
    result = {"benchmark": "bootstrap_overlap", "run_dir": str(args.run_dir), "threads": args.threads,
              "alone": {str(n): {k: round(v, 4) for k, v in r.items()} for n, r in alone.items()},
              "overlapped_1_thread_each": {k: round(v, 4) for k, v in both.items()},
              "overlap_gain": round(gain, 3),
              "note": "overlap_gain: feature tokens/s overlapped / alone at --threads + SFT steps/s overlapped / "
                      "alone at --threads (1.0 = overlapping gains nothing)"}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
