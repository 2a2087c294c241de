"""`online-opd serve --speculation auto` on the real vLLM CPU engine.

One server starts on a drafter with random weights (acceptance about 0): the
policy keeps speculation off (only the bounded exploration drafts) and greedy
outputs stay the target's. A hot reload then brings the memorising drafter
(tests/serving.py): the policy learns its acceptance from exploration bursts
and speculates at batch size 1; outputs stay the target's, and every block
vLLM drafted, many of them right after stretches of K = 0 steps, equals the
torch drafter's greedy block at its anchor (the drafter's context K/V of the
K = 0 steps were kept, deferred and flushed in batches before each drafting
step and each finished request: vllm_patches/dflash_context.py), also the
blocks of a request whose prompt hit two cached KV blocks (their drafter context
was stored by an earlier request). The target's features are captured
(capture.hidden_sample_rate) through both wrappers of the drafting call and
equal the target's own rows. The server also runs the step profile (vllm_patches/step_profile.py):
the engine core and the worker record every step, of every kind, in the same order. The step costs its
policy measured are stored in its run folder, and the next server on the same setup starts from them
(online_opd/speculation/cost_store.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from online_opd.models.drafters.checkpoint import load_drafter, save_drafter
from online_opd.models.target import ensure_embedded_target
from online_opd.models.target_model import TargetModel
from online_opd.opd.rollout import propose_all
from online_opd.speculation.costs import StepCosts
from online_opd.traces.buffer import BufferReader
from online_opd.train.sequences import TrainSequence
from tests.serving import CONFIG, ROOT, Server, complete_ids, random_drafter, running
from vllm_patches import STEP_PROFILE_ENV, step_profile

pytestmark = pytest.mark.slow
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("speculation")
    random_path = save_drafter(random_drafter(trained_run), root / "random", version="random")
    args = ("--drafter", str(random_path), "--speculation", "auto",
            "-o", "serve.policy_interval_s=1", "-o", "serve.policy_explore_share=0.05",
            "-o", "serve.policy_min_drafts=8", "-o", "capture.teacher_top_k=8",
            "-o", "capture.hidden_sample_rate=1")
    with running(root / "serve", *args, env={STEP_PROFILE_ENV: str(root / "steps")}) as srv:
        srv.step_profile, srv.serve_args = root / "steps", args
        yield srv


def complete(server: Server, prompt: list[int]) -> list[int]:
    return complete_ids(server, prompt, MAX_TOKENS)


def schedule(metrics: dict[str, float]) -> dict[str, float]:
    prefix = "online_opd_spec_k{batch_size_range="
    return {k[len(prefix):-1]: v for k, v in metrics.items() if k.startswith(prefix)}


def k_at(metrics: dict[str, float], batch_size: int) -> float:
    """The schedule's K for one batch size, from its range gauges."""
    for label, k in schedule(metrics).items():
        first, last = map(int, label.split("-"))
        if first <= batch_size <= last:
            return k
    raise AssertionError(f"no schedule range covers batch size {batch_size}: {schedule(metrics)}")


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_random_drafter_serves_without_speculation(server, rollouts):
    before = server.metrics()
    jobs = [i % len(rollouts) for i in range(24)]
    with ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda k: complete(server, rollouts[k][0]), jobs))
    for k, out in zip(jobs, outputs):
        assert out == rollouts[k][1], f"prompt {k}: output differs from the target's greedy output"
    time.sleep(2.5)  # a policy update and a status poll
    after = server.metrics()
    tokens = delta(before, after, "vllm:generation_tokens_total")
    drafts = delta(before, after, "vllm:spec_decode_num_drafts_total")
    assert tokens >= sum(len(out) for out in outputs)
    assert drafts <= 0.1 * tokens, f"{drafts} drafts for {tokens} tokens: speculation was not off"
    assert set(schedule(after).values()) == {0.0}, schedule(after)
    assert after["online_opd_spec_exploration_share"] <= 0.05 + 1e-9
    assert after["online_opd_spec_steps_total{kind=timed}"] > 0
    assert "speculation auto: starting schedule [(1, 2, 0)]" in server.tail(1_000_000)
    # the K = 0 steps' context K/V were deferred and computed in batched flushes (dflash_context.py)
    deferred = server.admin("GET", "/status").json()["deferred_context"]
    assert deferred["deferred_steps"] > 0.5 * tokens / 6 and deferred["flushes"] > 0, deferred
    assert deferred["flushed_tokens"] > 0 and deferred["pending_tokens"] < 256, deferred


def test_memorising_drafter_turns_speculation_on_at_batch_size_one(server, rollouts, trained_run):
    reply = server.admin("POST", "/reload", json={"path": str(trained_run / "drafter")})
    assert reply.status_code == 200, reply.text
    deadline, k = time.monotonic() + 240, 0
    while k_at(server.metrics(), 1) == 0.0:  # exploration bursts teach the policy
        assert time.monotonic() < deadline, server.tail()
        assert complete(server, rollouts[k % len(rollouts)][0]) == rollouts[k % len(rollouts)][1]
        k += 1
    before = server.metrics()
    for j in range(len(rollouts)):
        assert complete(server, rollouts[j][0]) == rollouts[j][1]
    after = server.metrics()
    drafts = delta(before, after, "vllm:spec_decode_num_drafts_total")
    accepted = delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
    tokens = delta(before, after, "vllm:generation_tokens_total")
    assert drafts >= 0.15 * tokens and accepted > drafts, (drafts, accepted, tokens)
    assert "speculation schedule [(1, 8, 0)] -> [(1, " in server.tail(1_000_000)  # the change, logged
    # A prompt longer than two KV blocks (128 tokens on the CPU), sent twice: the second request hits
    # both full blocks (DFlash keeps the last hit block: disable_eagle_block_drop), so its drafts read
    # the drafter context K/V the first request stored there. They are checked below against the torch
    # drafter, which computes that context from scratch.
    long_prompt = ([t for prompt, _ in rollouts for t in prompt] * 2)[:300]  # the prompts, twice over
    hits = server.metrics().get("vllm:prefix_cache_hits_total", 0.0)
    assert complete(server, long_prompt) == complete(server, long_prompt)
    assert server.metrics()["vllm:prefix_cache_hits_total"] - hits >= 256
    assert_drafted_blocks_match_the_torch_drafter(server, trained_run)


def assert_drafted_blocks_match_the_torch_drafter(server: Server, trained_run) -> None:
    """Every block of the memorising drafter's version equals the torch drafter's greedy block."""
    time.sleep(1.5)  # > capture flush interval
    records = list(BufferReader(server.buffer).iter_records())
    drafter = load_drafter(trained_run / "drafter")
    target = TargetModel.from_pretrained(ensure_embedded_target(progress=False), dtype=torch.float32)
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    total = mismatched = with_features = 0
    lengths = set()
    for rec in records:
        blocks = [b for b in rec.blocks if b.drafter_version == "drafter" and b.is_context_pure]
        if not blocks and rec.hidden is None:
            continue
        tokens = torch.tensor(rec.tokens)
        feats = target.forward(tokens, layer_ids=drafter.target_layer_ids, logits_at=tokens[:0]).aux_hidden
        if rec.hidden is not None:  # the features captured through the K = 0 wrapper: the target's own rows
            with_features += 1
            reference = feats[rec.hidden.start:len(tokens) - 1]
            rows = rec.hidden.to_tensor().float()
            assert rows.shape == reference.shape, (rec.hidden.start, rows.shape, reference.shape)
            assert float(((rows - reference).abs() / reference.abs().clamp(min=1.0)).max()) < 1e-3
        seq = TrainSequence(tokens, rec.prompt_len, feats)
        for block in blocks:
            width = len(block.draft_tokens)
            lengths.add(width)
            mine = propose_all(drafter, seq, torch.tensor([block.anchor]), num_draft_tokens=width)[0].tolist()
            total += 1
            mismatched += list(block.draft_tokens) != mine
    assert total > 50 and len(lengths) > 1, (total, lengths)
    assert mismatched == 0, f"{mismatched}/{total} blocks differ between vLLM and the torch drafter"
    metrics = server.metrics()
    assert metrics["online_opd_capture_errors_total"] == 0, server.tail()
    assert metrics["online_opd_hidden_records_captured_total"] >= with_features >= 0.8 * len(records), (
        with_features, len(records))


def test_step_profile_records_every_step_in_both_processes(server):
    """After the two tests above (no speculation, then speculation at batch size 1): every step the engine
    core ran is in its file and in the worker's, in the same order, with its kind; the drafting steps
    spent time in the drafter, and the output tokens add up to at least vLLM's generation counter."""
    generated = server.metrics()["vllm:generation_tokens_total"]
    core = step_profile.read(server.step_profile, "scheduler")
    worker = step_profile.read(server.step_profile, "worker")
    assert len(core) == len(worker) > 100
    keys = ("kind", "b", "prefill_tokens", "decode_tokens", "verified", "k")
    assert [tuple(r[k] for k in keys) for r in core] == [tuple(r[k] for k in keys) for r in worker]
    assert {r["kind"] for r in core} >= {"prefill", "decode"}
    assert all(r["seconds"] > 0 and r["schedule_s"] >= 0 for r in core)
    assert all(r["execute_s"] > 0 and r["sample_s"] >= r["propose_s"] >= 0 for r in worker)
    drafting = [r for r in worker if r["k"] > 0]
    assert drafting and all(r["propose_s"] > 0 for r in drafting)
    assert sum(r["verified"] > 0 for r in core) > 0
    assert sum(r["output_tokens"] for r in core) >= generated
    summary = step_profile.summarise(core, ("seconds",))
    assert sum(v["steps"] for v in summary.values()) == len(core)


def test_measured_step_costs_are_stored_and_start_the_next_server_on_the_same_setup(server):
    """The policy loop saved the engine's step costs (the plain steps of the random drafter, the drafting
    steps at batch size 1 of the memorising one) in <run_dir>/step_costs.json; `online-opd serve` with
    the same arguments finds the table of its setup and starts from it instead of the conservative
    schedule (--dry-run: the launcher's starting schedule, no second engine)."""
    path = server.run_dir / "step_costs.json"
    deadline = time.monotonic() + 90  # saved at the first update with timed steps, then every minute
    while not path.exists() or not any(r[1] > 0 for t in json.loads(path.read_text())["tables"]
                                       for r in t["costs"]):
        assert time.monotonic() < deadline, server.tail()
        time.sleep(2)
    assert server.metrics()["online_opd_policy_stored_cost_buckets"] == 0.0  # it started with none stored
    (table,) = json.loads(path.read_text())["tables"]
    costs = StepCosts.from_rows(table["costs"])
    assert costs.buckets[(1, 0)].num_steps >= 8 and costs.buckets[(1, 0)].seconds > 0
    assert any(k > 0 and v.num_steps > 0 for (b, k), v in costs.buckets.items())
    assert table["setup"]["max_k"] == 4 and table["setup"]["capture"]["hidden_sample_rate"] == 1
    dry = subprocess.run(
        [sys.executable, "-m", "serve.cli", "--no-progress", "serve", "-c", str(CONFIG),
         "-o", f"serve.run_dir={server.run_dir}", "-o", f"capture.buffer_dir={server.buffer}",
         *server.serve_args, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-4000:]
    assert f"(b, K) buckets from {path.resolve()}" in dry.stderr, dry.stderr[-4000:]
    assert "starting schedule" in dry.stderr and "from the stored step costs" in dry.stderr, dry.stderr[-4000:]
    env = json.loads(dry.stdout)["env"]
    policy = json.loads(env["ONLINE_OPD_SERVE"])["policy"]
    assert policy["costs_file"] == str(path.resolve()) and policy["costs_setup"] == table["setup"]
