"""What serving in bfloat16 (the CPU default, `model.dtype: auto`) costs in parity and exactness.

A drafter that memorised six target rollouts (the serving tests' bootstrap, configs/test-serve.yaml)
is served by `online-opd serve` in float32 and in bfloat16, on the same greedy requests (each
rollout prompt `--repeats` times). Per dtype:

- outputs identical to the target's float32 non-speculative greedy rollout, and to `online-opd serve
  --speculation never` in the same dtype (lossless within the dtype);
- captured blocks identical to the float32 torch drafter's greedy block at the same anchor (the
  trainer's drafter), and the largest logit gap of the ones that differ;
- served tau (vLLM's counters).

    python benchmarks/dtype_parity.py --run-dir runs/test-serve-bootstrap --out benchmarks/results/dtype_parity.json

`--run-dir` is trained first if it holds no drafter (about 5 min). One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from serve.clients import openai_client
from serve.launcher import ROOT, ServerProcess, emit_result, tau

logger = logging.getLogger("dtype_parity")
CONFIG = ROOT / "configs" / "test-serve.yaml"


def bootstrap(run_dir: Path) -> None:
    import subprocess

    if not (run_dir / "drafter" / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "serve.cli", "--no-progress", "bootstrap", "-c", str(CONFIG),
                        "--run-dir", str(run_dir)], cwd=ROOT, check=True)


def read_records(buffer: Path, count: int, timeout: float = 120) -> list:
    from online_opd.traces.buffer import BufferReader

    deadline = time.monotonic() + timeout
    while True:
        records = list(BufferReader(buffer).iter_records()) if buffer.exists() else []
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def serve_once(dtype: str, run_dir: Path, work: Path, rollouts, repeats: int,
               speculation: str = "always") -> tuple[list, list, dict]:
    server = ServerProcess(work / f"{dtype}-{speculation}", CONFIG, "--drafter", str(run_dir / "drafter"),
                           "-o", f"model.dtype={dtype}", "--speculation", speculation)
    try:
        server.wait_ready(timeout=900)
        client = openai_client(f"{server.url}/v1", timeout=300)
        model = client.models.list().data[0].id
        before = server.metrics()
        outputs = []
        for _ in range(repeats):
            for prompt, _expected in rollouts:
                reply = client.completions.create(model=model, prompt=prompt, max_tokens=len(_expected),
                                                  temperature=0.0, extra_body={"return_token_ids": True})
                outputs.append(list(reply.choices[0].model_extra["token_ids"]))
        served_tau, drafts = tau(before, server.metrics()) if speculation != "never" else (1.0, 0)
        records = read_records(server.buffer, len(outputs)) if speculation != "never" else []
    finally:
        server.stop()
    return outputs, records, {"tau": round(served_tau, 4), "drafts": drafts}


@torch.no_grad()
def block_parity(records: list, run_dir: Path) -> dict[str, Any]:
    from online_opd.models.drafters.checkpoint import load_drafter
    from online_opd.models.target import ensure_embedded_target
    from online_opd.models.target_model import TargetModel

    drafter = load_drafter(run_dir / "drafter")
    target = TargetModel.from_pretrained(ensure_embedded_target(progress=False), dtype=torch.float32)
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    same, total, gaps = 0, 0, []
    for rec in records:
        if not rec.blocks:
            continue
        tokens = torch.tensor(rec.tokens)
        feats = target.forward(tokens, layer_ids=drafter.target_layer_ids, logits_at=tokens[:0]).aux_hidden
        anchors = torch.tensor([b.anchor for b in rec.blocks])
        logits = drafter(feats[: int(anchors.max())], anchors, tokens[anchors], tokens)  # [M, K, V]
        served = torch.tensor([list(b.draft_tokens) for b in rec.blocks])
        gap = (logits.max(-1).values - logits.gather(-1, served[..., None])[..., 0]).max(-1).values
        same += int((gap == 0).sum())
        total += len(rec.blocks)
        gaps += [float(g) for g in gap if g > 0]
    return {"blocks": total, "identical_to_float32_torch_drafter": same,
            "largest_gap_of_differing": round(max(gaps), 5) if gaps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "test-serve-bootstrap")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    from online_opd.train.sequences import load_sequences

    bootstrap(args.run_dir)
    seqs = load_sequences(args.run_dir / "rollouts.safetensors")
    rollouts = [(s.tokens[: s.prompt_len].tolist(), s.tokens[s.prompt_len:].tolist()) for s in seqs]
    result: dict[str, Any] = {"benchmark": "dtype_parity", "run_dir": str(args.run_dir), "requests_per_dtype":
                              len(rollouts) * args.repeats, "reference": "float32 non-speculative greedy rollouts"}
    with tempfile.TemporaryDirectory(prefix="dtype-parity-") as tmp:
        for dtype in args.dtypes:
            outputs, records, served = serve_once(dtype, args.run_dir, Path(tmp), rollouts, args.repeats)
            plain, _, _ = serve_once(dtype, args.run_dir, Path(tmp), rollouts, args.repeats, speculation="never")
            expected = [e for _ in range(args.repeats) for _, e in rollouts]
            result[dtype] = {"outputs_identical_to_float32_rollouts": sum(o == e for o, e in zip(outputs, expected)),
                             "outputs_identical_to_plain_same_dtype": sum(o == p for o, p in zip(outputs, plain)),
                             "plain_identical_to_float32_rollouts": sum(p == e for p, e in zip(plain, expected)),
                             "records": len(records), "served": served, **block_parity(records, args.run_dir)}
            logger.info("%s: %s", dtype, result[dtype])
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
