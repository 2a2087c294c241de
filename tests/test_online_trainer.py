"""The online trainer on tiny real models: records served by speculative decoding, a real buffer,
registry and state folder (as a Ray actor: tests/test_online_trainer_ray.py)."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time

import pytest
import torch

from online_opd.config import TrainerConfig
from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.models.target_model import TargetModel
from online_opd.opd.specdec import target_generate
from online_opd.release.gate import split_held_out
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity
from online_opd.train.loop import train
from online_opd.train.online import OnlineTrainer
from online_opd.train.sequences import TrainSequence, compute_aux_hidden
from online_opd.train.sft import sample_anchors, sft_loss
from tests.online_world import HELD_OUT, SPLIT_PREFIX, K, make_world, online_config, setup_run


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tests/online_world.py's world, built once for this module."""
    return make_world(tmp_path_factory.mktemp("online"))


def _weights(trainer: OnlineTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}


def test_poll_routes_records_and_drops_invalid_ones(world, tmp_path):
    good = world["records"]
    first = good[0]
    i = next(i for i, b in enumerate(first.blocks) if b.num_accepted < K)
    blocks = list(first.blocks)
    blocks[i] = dataclasses.replace(blocks[i], num_accepted=blocks[i].num_accepted + 1)  # claims a rejected one
    invalid = dataclasses.replace(first, record_id="bad", blocks=tuple(blocks))
    too_short = dataclasses.replace(first, record_id="one-token", tokens=first.tokens[: first.prompt_len + 1],
                                    blocks=())  # no block, and no room to simulate one
    # kept: a request served without speculation, and one whose K changed (a 2-block, plain steps after)
    empty = dataclasses.replace(world["records"][1], record_id="empty", blocks=())
    b = world["records"][2].blocks[0]
    short_k = dataclasses.replace(world["records"][2], record_id="short-k",
                                  blocks=(BlockRecord(b.anchor, b.draft_tokens[:2], min(b.num_accepted, 2)),))
    good = good + [empty, short_k]
    extra = [invalid, too_short]
    trainer = OnlineTrainer(online_config(), **setup_run(world, tmp_path, good + extra))

    kept = trainer.poll()
    train, held_out = split_held_out(good, HELD_OUT, SPLIT_PREFIX)
    assert 0 < len(held_out) < len(good) and kept == len(good)
    assert [r.record_id for r in trainer.pools.window] == [r.record_id for r in train]
    newest = {}  # the held-out pool: the newest record of each prompt, by when its prompt was last seen
    for r in held_out:
        newest.pop(r.tokens[:SPLIT_PREFIX], None)
        newest[r.tokens[:SPLIT_PREFIX]] = r.record_id
    assert [r.record_id for r in trainer.pools.held_out] == list(newest.values())
    assert list(trainer.pools.fresh) == [r.record_id for r in train]
    stats = trainer.stats()
    assert stats["records_seen"] == len(good) + len(extra) and stats["records_invalid"] == 1
    assert stats["records_unusable"] == len(extra) - 1
    assert (stats["train_pool"], stats["held_out_pool"]) == (len(train), len(held_out))
    assert trainer.poll() == 0  # the cursor moved past both segments

    # invalid records are never trained on: every sampled record is one of the good train records
    picked = {r.record_id for _ in range(5) for r in trainer.pools.sample(trainer.generator)}
    assert picked <= {r.record_id for r in train}


def test_trained_tokens_are_the_served_tokens_of_the_replayed_blocks(world, tmp_path):
    """Every block replayed (anchors_per_sequence above any record's count): the step's trained tokens are
    the r + 1 tokens each of the two newest records' blocks emitted."""
    cfg = online_config(fresh_fraction=1.0)
    cfg.trainer.anchors_per_sequence = 1000
    trainer = OnlineTrainer(cfg, **setup_run(world, tmp_path))
    trainer.poll()
    newest = [trainer.pools.fresh[r] for r in list(trainer.pools.fresh)[-2:]]
    stats = trainer.step()
    assert stats["trained_tokens"] == sum(b.num_accepted + 1 for r in newest for b in r.blocks)
    assert trainer.stats()["trained_tokens"] == stats["trained_tokens"]


def test_step_trains_fresh_records_first(world, tmp_path):
    trainer = OnlineTrainer(online_config(fresh_fraction=1.0), **setup_run(world, tmp_path))
    assert trainer.step() is None  # nothing polled yet
    trainer.poll()
    newest = list(trainer.pools.fresh)[-2:]
    before = _weights(trainer)
    stats = trainer.step()
    assert stats["step"] == 1 and stats["replayed_tokens"] > 0
    assert 0 < stats["trained_tokens"] == trainer.stats()["trained_tokens"]
    assert all(math.isfinite(stats[k]) for k in ("loss", "loss_accepted", "loss_rejected", "grad_norm"))
    assert not any(r in trainer.pools.fresh for r in newest)  # the newest fresh records were replayed
    assert len(trainer.pools.fresh) == trainer.stats()["train_pool"] - 2
    after = _weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.stats()["steps"] == 1 and trainer.stats()["status"] == "training"


def test_a_duty_cycle_rests_three_times_its_work_at_a_quarter(world, tmp_path):
    """`online.duty_cycle` 0.25: after each step the trainer waits 3x the time the step (and its poll and
    gate) took, so it computes a quarter of its wall time; the rests are counted in its stats."""
    trainer = OnlineTrainer(online_config(duty_cycle=0.25, max_steps=2), **setup_run(world, tmp_path))
    started = time.monotonic()
    stats = trainer.run(threading.Event())
    wall = time.monotonic() - started
    assert stats["steps"] == 2
    assert stats["rest_seconds"] >= 3 * stats["train_seconds"] > 0  # the work includes the optimizer steps
    assert wall >= stats["rest_seconds"] * 4 / 3 * 0.99  # work plus three times the work
    assert 0.55 < trainer.rest(threading.Event(), time.monotonic() - 0.2) < 0.9  # 0.2 s of work: 0.6 s
    stop = threading.Event()
    stop.set()
    assert trainer.rest(stop, time.monotonic() - 1.0) == 0.0  # a set stop ends the rest
    back_to_back = OnlineTrainer(online_config(), **setup_run(world, tmp_path / "b"))
    assert back_to_back.rest(threading.Event(), time.monotonic() - 1.0) == 0.0
    assert back_to_back.stats()["rest_seconds"] == 0.0


def test_rest_follows_the_engine_load(world, tmp_path):
    """Busy engines: the rest keeps to `duty_cycle`; idle ones (`idle_duty_cycle` 1): no rest, and a
    rest under way ends within a check once the load reports turn idle."""
    trainer = OnlineTrainer(online_config(duty_cycle=0.25, idle_duty_cycle=1.0, idle_after_s=0.0), **setup_run(world, tmp_path))
    trainer.note_engine_load("replica", True)
    assert not trainer.stats()["engines_idle"]
    assert 0.55 < trainer.rest(threading.Event(), time.monotonic() - 0.2, check_s=0.05) < 0.9
    trainer.note_engine_load("replica", False)
    assert trainer.stats()["engines_idle"]
    assert trainer.rest(threading.Event(), time.monotonic() - 1.0) == 0.0
    trainer.note_engine_load("replica", True)
    threading.Timer(0.5, trainer.note_engine_load, args=("replica", False)).start()
    rested = trainer.rest(threading.Event(), time.monotonic() - 10.0, check_s=0.05)  # 30 s if it stayed busy
    assert 0.45 < rested < 2.0


def test_a_zero_duty_cycle_trains_only_while_the_engines_are_idle(world, tmp_path):
    """`online.duty_cycle` 0: records are read, but no step starts while the engines serve (or before any
    load report); the first idle report lets it train."""
    trainer = OnlineTrainer(online_config(duty_cycle=0.0, idle_after_s=0.0, max_steps=1), **setup_run(world, tmp_path))
    stop = threading.Event()
    runner = threading.Thread(target=trainer.run, args=(stop,))
    runner.start()
    try:
        time.sleep(1.0)  # no report yet: counts as serving
        trainer.note_engine_load("replica", True)
        time.sleep(1.0)
        held = trainer.stats()
        assert held["steps"] == 0 and held["status"] == "waiting_for_idle_engines", held
        assert held["records_seen"] == len(world["records"])  # the buffer is tailed meanwhile
        assert trainer.rest(threading.Event(), time.monotonic() - 5.0) == 0.0  # may_step holds it, not a rest
        trainer.note_engine_load("replica", False)
        runner.join(60)
        assert not runner.is_alive()
    finally:
        stop.set()
        runner.join(60)
    assert trainer.stats()["steps"] == 1


def test_run_gates_publishes_and_resumes(world, tmp_path):
    paths = setup_run(world, tmp_path)
    cfg = online_config(max_steps=3)
    cfg.gate.margin = float(K)  # tau lies in [1, K + 1]: no tau gain clears a margin of K, the gate rejects
    trainer = OnlineTrainer(cfg, **paths)
    final = trainer.run(threading.Event())
    assert final["steps"] == 3 and final["status"] == "stopped" and final["errors"] == 0
    assert (final["gates"], final["promotions"], final["rejections"]) == (1, 0, 1)

    registry = DrafterRegistry(paths["registry_dir"])
    published = registry.get(final["last_published"])
    assert published.version == "v0002" and published.parent == "v0001" and published.step == 3
    gate = published.metrics["gate"]
    assert gate["n_records"] == final["held_out_pool"] and gate["n_blocks"] > 0
    assert published.metrics["objective"] == "auto" and math.isfinite(published.metrics["train"]["loss"])
    # the tiny drafter's blocks accept their first token 3.7% of the time: auto trains the weak objective
    assert published.metrics["objective_schedule"]["current"] == "lk"
    assert published.status == "rejected" and not gate["passed"]
    assert "tau gain lower bound" in published.status_reason and f"<= margin {K}" in published.status_reason
    assert registry.current().version == "v0001"  # a rejected candidate never serves
    assert final["last_gate"]["status"] == "rejected"

    # a new trainer on the same state resumes: same step, weights, counters; pools rebuilt, none fresh
    resumed = OnlineTrainer(online_config(max_steps=4), **paths)
    assert resumed.step_count == 3 and resumed.pools.cursor == trainer.pools.cursor
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer).values(), _weights(resumed).values()))
    stats = resumed.stats()
    assert stats["records_seen"] == final["records_seen"] and stats["gates"] == 1
    assert (stats["train_pool"], stats["held_out_pool"], stats["fresh_records"]) == \
        (final["train_pool"], final["held_out_pool"], 0)
    assert resumed.poll() == 0
    assert resumed.run(threading.Event())["steps"] == 4
    # a smaller window is refilled with the newest train records only
    small = OnlineTrainer(online_config(window_records=3), **paths)
    train, _ = split_held_out(world["records"], HELD_OUT, SPLIT_PREFIX)
    assert small.step_count == 4
    assert [r.record_id for r in small.pools.window] == [r.record_id for r in train[-3:]]


def test_the_gate_keeps_to_its_share_of_the_trainers_time(world, tmp_path):
    """gate.max_time_share: a gate falls due every step here; with a share of 1 each one runs, with a tiny
    share only the first (no gate seconds yet) and every later due point is deferred, the trainer stepping
    on. The seconds are counted in the stats either way."""
    counts = {}
    for share in (1.0, 1e-6):
        cfg = online_config(max_steps=5)
        cfg.gate.every_steps, cfg.gate.max_time_share = 1, share
        cfg.gate.margin = float(K)  # every candidate rejected: the serving drafter stays v0001
        final = OnlineTrainer(cfg, **setup_run(world, tmp_path / str(share))).run(threading.Event())
        assert final["steps"] == 5 and final["errors"] == 0 and final["gate_seconds"] > 0
        counts[share] = (final["gates"], final["gates_deferred"])
    assert counts == {1.0: (5, 0), 1e-6: (1, 4)}


def test_the_gate_scores_and_publishes_the_weight_average_and_training_goes_on_from_the_weights(world, tmp_path):
    """online.ema_decay 0.15: the candidate the gate scores and the registry publishes is the moving average of
    the weights after each step (it keeps 0.1 of itself at the first update, then the cap 0.15); the trainer's
    own weights come back after the gate, and a resumed trainer has the same average."""
    paths = setup_run(world, tmp_path)
    cfg = online_config(ema_decay=0.15)
    cfg.gate.margin = float(K)  # rejected: v0001 keeps serving
    trainer = OnlineTrainer(cfg, **paths)
    trainer.poll()
    names = list(trainer.average.average)
    expected = {k: v for k, v in _weights(trainer).items() if k in names}
    for decay in (0.1, 0.15, 0.15):
        trainer.step()
        expected = {k: decay * v + (1 - decay) * _weights(trainer)[k] for k, v in expected.items()}
    own = _weights(trainer)
    assert any(not torch.allclose(own[k], expected[k], atol=1e-4) for k in names)  # the two differ here

    summary = trainer.gate()
    assert summary["status"] == "rejected"
    published = DrafterRegistry(paths["registry_dir"]).get(summary["version"])
    weights = load_drafter(published.path).state_dict()
    for name in names:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-6)
    assert published.metrics["average"] == {"decay": 0.15, "updates": 3}
    assert all(torch.equal(v, own[k]) for k, v in _weights(trainer).items())  # trains on from its weights
    trainer.save()
    resumed = OnlineTrainer(cfg, **paths)
    assert resumed.average.num_updates == 3
    assert all(torch.equal(resumed.average.average[k], v) for k, v in trainer.average.average.items())
    off = OnlineTrainer(online_config(ema_decay=0.0), **paths)  # resumed with the average off: the weights
    assert off.average.num_updates == 0 and all(torch.equal(v, own[k]) for k, v in off.average.average.items())


def test_lr_warms_up_linearly_then_stays_constant_across_a_resume(world, tmp_path):
    paths = setup_run(world, tmp_path)
    cfg = online_config()
    cfg.trainer.warmup_ratio = 0.002  # W = round(0.002 * 1000 steps) = 2; lr(s) = 3e-3 * min(s / W, 1)
    trainer = OnlineTrainer(cfg, **paths)
    trainer.poll()
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    assert lrs == [0.0, 0.0]  # step 0 of the warm-up
    assert trainer.step()["lr"] == pytest.approx(1.5e-3)  # the rate of step 1, half-way
    trainer.save()

    resumed = OnlineTrainer(cfg, **paths)  # the schedule resumes mid warm-up, not from its start
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx([1.5e-3, 1.5e-3])
    resumed.poll()
    assert [resumed.step()["lr"] for _ in range(2)] == pytest.approx([3e-3, 3e-3])  # warm-up over: constant


@pytest.fixture(scope="module")
def memorised(world, tmp_path_factory):
    """The world's drafter after SFT on the records' sequences: far better than it on them."""
    drafter = copy.deepcopy(world["drafter"])
    target = TargetModel.from_pretrained(world["root"] / "target")
    seqs = [TrainSequence(torch.tensor(r.tokens), r.prompt_len) for r in world["records"]]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, progress=False)
    gen = torch.Generator().manual_seed(0)
    anchors = [sample_anchors(s.prompt_len, s.num_tokens, 32, gen) for s in seqs]
    cfg = TrainerConfig(objective="sft", lr=1e-2, num_steps=64, warmup_ratio=0.0, checkpoint_every=1000)
    train(lambda step: sft_loss(drafter, seqs[step % 16], anchors[step % 16], decay=7.0), drafter, cfg,
          tmp_path_factory.mktemp("sft"), progress=False)
    return drafter.eval()


def test_gate_promotes_a_better_candidate_and_training_goes_on(world, memorised, tmp_path):
    """The trainer starts from the memorised drafter; then a worse one is made current (as a manual
    rollback would): the gate compares with whatever serves now, and promotes."""
    paths = setup_run({**world, "drafter": memorised}, tmp_path)
    cfg = online_config()
    cfg.trainer.lr = 1e-5
    trainer = OnlineTrainer(cfg, **paths)
    registry = DrafterRegistry(paths["registry_dir"])
    registry.promote(registry.publish(world["drafter"]).version, reason="manual")  # v0002, worse
    trainer.poll()
    for _ in range(3):
        trainer.step()
    before = _weights(trainer)
    summary = trainer.gate()
    assert summary["passed"] and summary["status"] == "promoted", summary["reason"]
    assert summary["serving"] == "v0002" and summary["tau_candidate"] > summary["tau_serving"] + 0.3
    current = registry.current()
    assert current.version == summary["version"] == "v0003" and current.parent == "v0002"
    assert current.metrics["gate"]["passed"] and "gate passed at step 3" in current.status_reason
    assert all(torch.equal(before[k], v) for k, v in _weights(trainer).items())  # no reset
    assert trainer.step()["step"] == 4
    assert trainer.stats()["promotions"] == 1


def test_held_out_pool_keeps_the_newest_record_of_each_prompt(world, tmp_path):
    """A repeated held-out prompt takes one slot of the pool (the gate's unit is the prompt), holding
    its newest record; past gate.max_records prompts the least recently seen one leaves."""
    _, held_out = split_held_out(world["records"], HELD_OUT, SPLIT_PREFIX)
    assert len(held_out) >= 3
    repeats = [dataclasses.replace(r, record_id=f"again-{r.record_id}") for r in held_out[:2]] * 3
    trainer = OnlineTrainer(online_config(), **setup_run(world, tmp_path, world["records"] + repeats))
    assert trainer.poll() == len(world["records"]) + len(repeats)
    ids = [r.record_id for r in trainer.pools.held_out]
    assert ids == [r.record_id for r in held_out[2:]] + [f"again-{r.record_id}" for r in held_out[:2]]
    assert trainer.gate()["n_prompts"] == len(held_out)  # each prompt once, however often it came back
    cfg = online_config()
    cfg.gate.max_records = cfg.gate.min_records = 2
    trainer = OnlineTrainer(cfg, **setup_run(world, tmp_path / "capped", world["records"] + repeats))
    trainer.poll()
    assert [r.record_id for r in trainer.pools.held_out] == [f"again-{r.record_id}" for r in held_out[:2]]


@pytest.fixture(scope="module")
def plain_records(world):
    """24 greedy requests served with speculation off: the target's tokens and no block at all."""
    target = TargetModel.from_pretrained(world["root"] / "target")
    records = []
    for i in range(24):
        prompt = torch.randint(1, 60, (4,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        tokens = target_generate(target, prompt, 24)
        records.append(SequenceRecord(record_id=f"plain-{i}", model_id="tiny", drafter_version="v0001",
                                      temperature=0.0, top_p=1.0, top_k=0, tokens=tuple(tokens), prompt_len=4,
                                      blocks=()))
    return records


def test_replay_plan_uses_logged_blocks_or_simulates_the_current_drafter(world, tmp_path):
    trainer = OnlineTrainer(online_config(), **setup_run(world, tmp_path))
    served = world["records"][0]  # greedy, every decode step speculated with the drafter now current
    assert trainer.replay_plan(served) == served and trainer.stats()["records_simulated"] == 0
    # served without speculation: the current drafter's walk, at T = 0 the very blocks it logged
    walked = trainer.replay_plan(dataclasses.replace(served, blocks=()))
    assert walked.blocks == served.blocks[: len(walked.blocks)] and len(walked.blocks) >= len(served.blocks) - 1
    # one logged block out of many (speculation mostly off): below the default coverage of 0.5
    assert trainer.replay_plan(dataclasses.replace(served, blocks=served.blocks[:1])).blocks == walked.blocks
    b = served.blocks[0]  # drafted with K = 6 > 4: not replayable by this drafter, so simulated too
    long_k = dataclasses.replace(served, blocks=(dataclasses.replace(b, draft_tokens=b.draft_tokens + (1, 2)),))
    assert trainer.replay_plan(long_k).blocks == walked.blocks
    assert trainer.stats()["records_simulated"] == 3
    trainer.cfg.online.simulate_below_coverage = 0.0  # never simulate: logged blocks or nothing
    assert trainer.replay_plan(dataclasses.replace(served, blocks=())) is None
    assert trainer.replay_plan(long_k) is None
    assert trainer.replay_plan(dataclasses.replace(served, blocks=served.blocks[:1])).blocks == served.blocks[:1]


def test_a_fresh_drafter_that_never_speculated_learns_from_plain_records(world, plain_records, tmp_path):
    """No record has a block: every replay runs on the blocks the current drafter simulates over the
    record, the gate scores held-out records on the serving drafter's walk, and held-out tau rises."""
    cfg = online_config()
    cfg.trainer.anchors_per_sequence = 8
    trainer = OnlineTrainer(cfg, **setup_run(world, tmp_path, plain_records))
    assert trainer.poll() == len(plain_records) and trainer.stats()["records_unusable"] == 0
    num_held_out = len(trainer.pools.held_out)
    assert 2 <= num_held_out < len(plain_records) // 2
    before = _weights(trainer)
    losses = [trainer.step()["loss"] for _ in range(30)]
    assert all(math.isfinite(loss) for loss in losses) and trainer.stats()["records_simulated"] == 30 * 2
    assert any(not torch.equal(before[k], v) for k, v in _weights(trainer).items())
    summary = trainer.gate()
    assert summary["n_records"] == summary["n_records_walked"] == num_held_out
    assert summary["tau_candidate"] > summary["tau_serving"] + 0.05, summary


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds (each wait has its own)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f}s: {what}"
        time.sleep(0.02)


def test_a_repeating_failure_is_logged_once_per_occurrence_and_counted_each_time(world, tmp_path, caplog):
    import logging

    from online_opd.files import atomic_write_json
    from online_opd.models.drafters.checkpoint import WEIGHTS_FILE

    paths = setup_run(world, tmp_path)
    trainer = OnlineTrainer(online_config(), **paths)
    registry = DrafterRegistry(paths["registry_dir"])
    torn = registry.publish(registry.path("v0001"), parent="v0001").version
    weights = registry.path(torn) / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])

    def point_current_at(version: str) -> None:  # as a crash-unsafe promote would leave it
        atomic_write_json(paths["registry_dir"] / "CURRENT", {"version": version, "since": 0, "reason": "test"})

    def num_step_failures_logged() -> int:
        return sum(r.levelno >= logging.ERROR and "step failed at step" in r.getMessage() for r in caplog.records)

    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,))
    with caplog.at_level(logging.DEBUG, logger="online_opd.train.online"):
        point_current_at(torn)
        thread.start()
        for _ in range(2):  # two occurrences, each failing many polls in a row
            target = trainer.stats()["errors"] + 5
            wait_until(lambda: trainer.stats()["errors"] >= target, "five failures in a row")
            errors = trainer.stats()["errors"]
            point_current_at("v0001")
            wait_until(lambda: trainer.stats()["status"] == "training", "training again on v0001")
            logged = num_step_failures_logged()
            point_current_at(torn)
            # the gate may fail first on the torn CURRENT (a failure of its own, logged too): wait for the step
            wait_until(lambda: num_step_failures_logged() > logged, "the step failing again on the torn version")
            assert trainer.stats()["errors"] > errors
        stop.set()
        thread.join(30)
    # the gate, when it happens to run against the torn CURRENT, fails (and is logged) on its own account
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR and "step failed at step" in r.getMessage()]
    assert trainer.stats()["errors"] >= 11 and len(logged) == 3, [r.getMessage() for r in logged]
    assert all(r.exc_info and "sha256" in str(r.exc_info[1]) for r in logged)


def test_sft_objective_is_refused(world, tmp_path):
    cfg = online_config()
    cfg.trainer.objective = "sft"
    with pytest.raises(ValueError, match="SFT is the offline"):
        OnlineTrainer(cfg, **setup_run(world, tmp_path))


def test_blocks_served_narrower_than_k_are_replayed_k_wide_and_counted(world, tmp_path):
    """``trainer.widen_share`` 1 with a path-only objective (lk): a record served with 1-token blocks is
    replayed on K-wide blocks at their anchors, counted in ``blocks_widened``; Draft-OPD, which reads the
    served drafts, never replaces them."""
    served = world["records"][0]
    t, first = served.tokens, served.prompt_len - 1
    narrow = tuple(BlockRecord(a, (t[a + 1],), 1) for a in range(first, len(t) - 2, 2))  # a -> a + r + 1
    record = dataclasses.replace(served, blocks=narrow)
    assert not check_fidelity(record)
    cfg = online_config()
    cfg.trainer.objective, cfg.trainer.widen_share = "lk", 1.0
    trainer = OnlineTrainer(cfg, **setup_run(world, tmp_path))
    trainer.train_step([record, record])
    chosen = min(len(narrow), cfg.trainer.anchors_per_sequence)  # blocks replayed per record
    assert trainer.stats()["blocks_widened"] == 2 * chosen  # each has room for 2 tokens or more
    cfg.trainer.objective = "draft_opd"
    trainer = OnlineTrainer(cfg, **setup_run(world, tmp_path / "opd"))
    trainer.train_step([record, record])
    assert trainer.stats()["blocks_widened"] == 0
