"""The trainer on a CUDA GPU (``online.device: cuda``) against the same computation on the CPU.

Skipped without a CUDA device: the CI machine and the development machines have none. Run it where a GPU
is (``pytest tests/test_cuda.py -rA``); the session notes quote its output. ``ONLINE_OPD_TEST_DEVICE=cpu``
runs it with the CPU in the GPU's place, to check the test itself. Float32 matmuls stay exact (no TF32),
so the two devices differ by the order of their floating-point sums only.

- The packed replay (forward, the objectives and their gradients) over records that mix block lengths,
  captured teacher rows and captured target features.
- The online trainer end to end: poll, steps, a gate and a publication, with the same counts and, within
  rounding, the same losses, gate figures and weights as on the CPU; the checkpoint it publishes from
  GPU tensors loads bit for bit and proposes, on the GPU, exactly what the trainer's drafter proposes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading

import pytest
import torch

from online_opd.config import TrainerConfig
from online_opd.models.drafters.checkpoint import load_drafter
from online_opd.opd.rollout import simulated_record
from online_opd.opd.teacher_rows import top_k_teacher
from online_opd.release.registry import DrafterRegistry
from online_opd.traces.target_signal import TargetHidden
from online_opd.train.online import OnlineTrainer
from online_opd.train.opd import objective_fn, replay_records
from tests.online_world import make_world, online_config, setup_run
from tests.tiny import VOCAB

DEVICE = torch.device(os.environ.get("ONLINE_OPD_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device (none on the CI machine)")


@pytest.fixture(scope="module", autouse=True)
def exact_float32():
    if DEVICE.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("world"))


def _on(device: torch.device, target, drafter):
    """Copies of the models on ``device``, the drafter sharing the copied target's embeddings and head."""
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    target.model.to(device)
    drafter.attach_target(target.embed_weight, target.lm_head_weight)
    return target, drafter.to(device)


@pytest.fixture(scope="module")
def records(world):
    """The world's records, three of them changed: one with every block's full teacher and the record's
    features (replay runs no target forward for it), one with a top-8 teacher on every other block, one
    whose blocks are cut to 1..K tokens (steps that drafted fewer)."""
    target, drafter = world["target"], world["drafter"]
    layers = tuple(drafter.target_layer_ids)
    out = list(world["records"])
    with torch.no_grad():
        def teacher(rec, block, k):
            seq = torch.tensor(list(rec.tokens[: block.anchor + 1]) + list(block.draft_tokens))
            return top_k_teacher(target.forward(seq).logits[block.anchor:], k)

        full = out[0]
        tokens = torch.tensor(full.tokens)
        aux = target.forward(tokens[:-1], layers, logits_at=tokens.new_empty(0)).aux_hidden
        out[0] = dataclasses.replace(full, blocks=tuple(dataclasses.replace(b, teacher=teacher(full, b, VOCAB))
                                                        for b in full.blocks),
                                     hidden=TargetHidden.from_tensor(2, aux[2:]))
        half = out[1]
        out[1] = dataclasses.replace(half, blocks=tuple(dataclasses.replace(b, teacher=teacher(half, b, 8))
                                                        if m % 2 else b for m, b in enumerate(half.blocks)))
    cut = out[2]
    out[2] = dataclasses.replace(cut, blocks=tuple(
        dataclasses.replace(b, draft_tokens=b.draft_tokens[: 1 + m % len(b.draft_tokens)],
                            num_accepted=min(b.num_accepted, 1 + m % len(b.draft_tokens)))
        for m, b in enumerate(cut.blocks)))
    assert len({len(b.draft_tokens) for b in out[2].blocks}) > 1
    return out


def _replay(target, drafter, records, objective, device):
    drafter.zero_grad(set_to_none=True)
    out = replay_records(target, drafter, records, objective, anchors_per_sequence=6,
                         generator=torch.Generator().manual_seed(0), device=device)
    out.loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in drafter.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("name", ["draft_opd", "target_rollout"])
def test_replay_and_gradients_on_the_device_equal_the_cpu(world, records, name):
    objective = objective_fn(TrainerConfig(objective=name))
    cpu_target, cpu_drafter = _on(torch.device("cpu"), world["target"], world["drafter"])
    cpu, cpu_grads = _replay(cpu_target, cpu_drafter, records, objective, None)
    dev_target, dev_drafter = _on(DEVICE, world["target"], world["drafter"])
    dev, dev_grads = _replay(dev_target, dev_drafter, records, objective, DEVICE)

    assert dev.loss.device.type == DEVICE.type
    assert (dev.num_blocks, dev.block_tokens, dev.num_replayed_tokens) == \
        (cpu.num_blocks, cpu.block_tokens, cpu.num_replayed_tokens)
    torch.testing.assert_close(dev.loss.detach().cpu(), cpu.loss.detach(), rtol=1e-5, atol=1e-6)
    assert dev.accepted == pytest.approx(cpu.accepted, rel=1e-5, abs=1e-6)
    assert dev.rejected == pytest.approx(cpu.rejected, rel=1e-5, abs=1e-6)
    assert set(dev_grads) == set(cpu_grads) and cpu_grads
    for key, grad in cpu_grads.items():
        torch.testing.assert_close(dev_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def _weights(drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in drafter.state_dict().items()}


def test_the_online_trainer_on_the_device_trains_gates_and_publishes_as_on_the_cpu(world, tmp_path):
    finals, trainers, paths = {}, {}, {}
    for name, device in (("cpu", "cpu"), ("device", str(DEVICE))):
        paths[name] = setup_run(world, tmp_path / name)
        cfg = online_config(max_steps=6, device=device, num_gpus=1.0 if DEVICE.type == "cuda" else 0.0)
        cfg.gate.margin = -5.0  # below any tau difference (K = 4): every candidate passes: the promotion path runs too
        trainers[name] = OnlineTrainer(cfg, **paths[name])
        assert next(trainers[name].drafter.parameters()).device.type == torch.device(device).type
        finals[name] = trainers[name].run(threading.Event())
    cpu, dev = finals["cpu"], finals["device"]
    print("online trainer, cpu:", json.dumps(cpu, default=str))
    print("online trainer, device:", json.dumps(dev, default=str))
    assert dev["status"] == "stopped" and dev["errors"] == 0 and dev["steps"] == 6 and dev["gates"] == 2
    for key in ("steps", "gates", "promotions", "rejections", "records_seen", "replayed_tokens", "trained_tokens",
                "train_pool", "held_out_pool"):
        assert dev[key] == cpu[key], key
    assert dev["promotions"] == 2
    for key in ("tau_candidate", "tau_serving"):
        assert dev["last_gate"][key] == pytest.approx(cpu["last_gate"][key], abs=1e-4), key
    cpu_w, dev_w = _weights(trainers["cpu"].drafter), _weights(trainers["device"].drafter)
    drift = max(float((dev_w[k] - cpu_w[k]).abs().max()) for k in cpu_w)
    print(f"largest weight difference after 6 steps, device vs cpu: {drift:.3g}")
    for key, value in cpu_w.items():
        torch.testing.assert_close(dev_w[key], value, rtol=1e-3, atol=1e-5, msg=key)

    # the version it published from GPU tensors: the serving checkpoint, bit for bit the trainer's weights
    trainer = trainers["device"]
    current = DrafterRegistry(paths["device"]["registry_dir"]).current()
    assert current.version == dev["last_published"] == "v0003"
    loaded = load_drafter(current.path)
    for key, value in _weights(loaded).items():
        assert torch.equal(value, dev_w[key]), key
    loaded.attach_target(trainer.target.embed_weight, trainer.target.lm_head_weight)
    loaded = loaded.to(DEVICE).eval()
    trainer.drafter.eval()
    blocks = 0
    for record in world["records"]:
        ours = simulated_record(trainer.target, trainer.drafter, record)
        served = simulated_record(trainer.target, loaded, record)
        assert served.blocks == ours.blocks, record.record_id
        blocks += len(ours.blocks)
    # and on the CPU (a CPU server loading it): the same proposals where the devices' rounding allows
    cpu_target, cpu_loaded = _on(torch.device("cpu"), world["target"], load_drafter(current.path))
    same = sum(a == b for record in world["records"]
               for a, b in zip(simulated_record(cpu_target, cpu_loaded.eval(), record).blocks,
                               simulated_record(trainer.target, trainer.drafter, record).blocks))
    print(f"proposals of the published version: {blocks} blocks equal on the device; {same} of {blocks} "
          "equal between the CPU and the device")
    assert same >= 0.95 * blocks
