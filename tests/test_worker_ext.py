"""Hot reload's restore after a failed load (vllm_patches/worker_ext.py) on vLLM's own DFlash drafter
module, built and loaded as the CPU engine does it (weights repacked for the CPU kernels), with no
engine around it. The load fails inside vLLM's ``load_weights``, half-way through reading the new
tensors, after the CPU-repacked linear weights were registered again for it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from online_opd.models.drafters.checkpoint import save_drafter
from tests.tiny import tiny_drafter, tiny_target
from vllm_patches.worker_ext import OnlineOPDWorkerExtension


class _Worker(OnlineOPDWorkerExtension):
    """What the extension reads of vLLM's worker: the engine config and the drafter module served."""

    def __init__(self, vllm_config, model: torch.nn.Module):
        self.vllm_config = vllm_config
        self.model_runner = SimpleNamespace(drafter=SimpleNamespace(model=model))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


VOCABS = {"v0001": [1, 2, 5, 9, 17, 30], "v0002": [0, 3, 5, 8, 20, 31]}  # reduced variant: draft ids


@pytest.fixture(scope="module", params=["full", "reduced"])
def served(tmp_path_factory, request) -> Iterator[dict]:
    """vLLM's drafter module serving checkpoint v0001 of a tiny target; v0002 has other weights.
    "reduced": both draft over 6 target ids (different ones), vLLM's own head and d2t map."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    root = tmp_path_factory.mktemp("reload")
    target = tiny_target(seed=1)
    target.model.save_pretrained(root / "target")
    reduced = request.param == "reduced"
    paths = {v: save_drafter(tiny_drafter(target, seed=seed, draft_vocab=VOCABS[v] if reduced else None),
                             root / v, version=v)
             for v, seed in (("v0001", 2), ("v0002", 3))}
    spec = {"method": "dflash", "model": str(paths["v0001"]), "num_speculative_tokens": 4}
    cfg = EngineArgs(model=str(root / "target"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                     max_model_len=256, speculative_config=spec).create_engine_config()
    draft_cfg = cfg.speculative_config.draft_model_config
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)
        try:
            loader = get_model_loader(cfg.load_config)
            with set_default_torch_dtype(draft_cfg.dtype), torch.device("cpu"):
                model = loader.create_model(vllm_config=cfg, model_config=draft_cfg)
            loader.load_weights(model, draft_cfg)
            process_weights_after_loading(model, draft_cfg, torch.device("cpu"))
            with torch.no_grad():  # the engine shares the target's embeddings and LM head with the drafter
                model.model.embed_tokens.weight.copy_(target.embed_weight)
                if not reduced:  # a reduced head is the drafter's own, loaded from its checkpoint
                    model.lm_head.weight.copy_(target.lm_head_weight)
            yield {"cfg": cfg, "model": model, "reduced": reduced, "target": target, **paths}
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the drafter holds, and each linear layer's output on a fixed input (the CPU backend
    keeps linear weights repacked for its kernels and leaves ``weight`` empty)."""
    from vllm.model_executor.layers.linear import LinearBase

    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"buffer {n}": b.clone() for n, b in model.named_buffers()}
    for name, module in model.named_modules():
        out |= {f"{name}.{k}": v.clone() for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
        if isinstance(module, LinearBase):
            x = torch.linspace(-1.0, 1.0, 3 * module.input_size).reshape(3, module.input_size)
            out[f"{name}(x)"] = module(x)[0].detach()
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]))


def _fail_halfway_once(model: torch.nn.Module, monkeypatch) -> None:
    """The next ``load_weights`` call loads half of its tensors, then raises (a read error, say)."""
    real = model.load_weights
    calls = []

    def load_weights(weights):
        calls.append(None)
        if len(calls) > 1:
            return real(weights)
        items = list(weights)

        def half():
            yield from items[: len(items) // 2]
            raise OSError("read error halfway through the checkpoint")

        return real(half())

    monkeypatch.setattr(model, "load_weights", load_weights)


def test_a_failed_load_puts_the_serving_weights_back(served, monkeypatch):
    worker, model = _Worker(served["cfg"], served["model"]), served["model"]
    serving = _snapshot(model)
    _fail_halfway_once(model, monkeypatch)
    result = worker.online_opd_reload(str(served["v0002"]))
    assert (result["ok"], result["result"], result["restored"], result["version"]) == (False, "failed", True, "v0001")
    assert result["error"] == "OSError: read error halfway through the checkpoint"
    assert _differ(_snapshot(model), serving) == []
    assert worker.online_opd_status()["reloads"] == {"ok": 0, "refused": 0, "failed": 1}

    assert worker.online_opd_reload(str(served["v0002"]))["ok"]  # the same checkpoint loads when it can
    assert _differ(_snapshot(model), serving)
    assert worker.online_opd_reload(str(served["v0001"]))["version"] == "v0001"
    assert _differ(_snapshot(model), serving) == []


def test_without_the_previous_checkpoint_the_failure_says_nothing_serves(served, monkeypatch, tmp_path):
    worker, model = _Worker(served["cfg"], served["model"]), served["model"]
    serving = _snapshot(model)
    worker._online_opd_state()["path"] = tmp_path / "deleted"  # the serving checkpoint is gone
    _fail_halfway_once(model, monkeypatch)
    result = worker.online_opd_reload(str(served["v0002"]))
    assert (result["ok"], result["restored"], result["version"]) == (False, False, None)
    assert _differ(_snapshot(model), serving)  # half loaded: what the restore exists to undo
    assert worker.online_opd_reload(str(served["v0001"]))["ok"]
    assert _differ(_snapshot(model), serving) == []


@pytest.mark.parametrize("served", ["reduced"], indirect=True)
def test_a_reload_swaps_the_draft_vocabulary_of_a_reduced_drafter(served):
    worker, model, target = _Worker(served["cfg"], served["model"]), served["model"], served["target"]
    for version in ("v0002", "v0001"):
        assert worker.online_opd_reload(str(served[version]))["ok"]
        ids = torch.tensor(VOCABS[version])
        assert model.draft_id_to_target_id.tolist() == (ids - torch.arange(len(ids))).tolist()
        assert torch.equal(model.lm_head.weight.detach()[: len(ids)], target.lm_head_weight[ids])  # rows padded
        logits = model.compute_logits(torch.randn(2, 32))  # vLLM's own scatter to target ids
        assert torch.isfinite(logits[:, ids]).all() and torch.isneginf(logits).sum() == 2 * (logits.shape[1] - 6)
