"""Fast checks of the serving pieces that need no engine: the vLLM version gate,
the opt-out rule, the `vllm serve` command line, the reload checks on real
checkpoints, and the Prometheus series (the engine-level behaviour of the same
code is tested on the real vLLM engine in test_serve.py / test_online_loop.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import load_file, save_file

from online_opd.config import load_config
from online_opd.models.drafters.checkpoint import save_drafter, sha256_file
from serve.server import engine_flags, vllm_argv
from tests.tiny import tiny_drafter
from vllm_patches import UnsupportedVLLMVersion, check_vllm_version
from vllm_patches.capture import opted_out
from vllm_patches.metrics import PolledCollector, ServedAcceptance, TrainerCollector, version_gauge
from vllm_patches.worker_ext import ReloadError, read_checked_tensors


def test_vllm_version_range():
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.3+cpu") == "0.32.3+cpu"
    for bad in ("0.31.9", "0.33.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLMVersion, match="support vllm>=0.32.0,<0.33.0"):
            check_vllm_version(bad)


@pytest.mark.parametrize("extra,out", [(None, False), ({}, False), ({"online_opd_capture": True}, False),
                                       ({"online_opd_capture": False}, True), ({"online_opd_capture": 0}, True),
                                       ({"online_opd_capture": "off"}, True), ({"other": 1}, False)])
def test_opt_out_rule(extra, out):
    # vLLM's vllm_xargs turn JSON false into 0: both opt out
    assert opted_out(types.SimpleNamespace(extra_args=extra)) is out


def test_engine_flags_and_argv(tmp_path):
    assert engine_flags({"enforce_eager": True, "max_num_seqs": 8, "x": False, "y": None, "z": {"a": 1}}) == [
        "--enforce-eager", "--max-num-seqs", "8", "--z", '{"a": 1}']
    drafter = save_drafter(tiny_drafter(), tmp_path / "d", version="v0001")
    cfg = load_config(None, ["serve.port=9123"])
    argv = vllm_argv(cfg, Path("/models/t"), drafter, ["--max-num-seqs", "4", "--port", "9999"])
    assert argv[:2] == ["serve", "/models/t"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    assert argv[argv.index("--worker-extension-cls") + 1] == "vllm_patches.worker_ext.OnlineOPDWorkerExtension"
    assert "--enforce-eager" in argv
    assert argv[-4:] == ["--max-num-seqs", "4", "--port", "9999"]  # pass-through last: it wins


def _checkpoint(tmp_path: Path, name: str, mutate=None) -> Path:
    folder = save_drafter(tiny_drafter(), tmp_path / name, version=name)
    if mutate is not None:
        tensors = load_file(folder / "model.safetensors")
        mutate(tensors)
        save_file(tensors, folder / "model.safetensors")
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"]["model.safetensors"] = sha256_file(folder / "model.safetensors")
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_reload_checks_accept_a_good_checkpoint(tmp_path):
    good = _checkpoint(tmp_path, "good")
    config = json.loads((good / "config.json").read_text())
    tensors = read_checked_tensors(good, sha256_file(good / "model.safetensors"), config)
    assert set(tensors) == set(load_file(good / "model.safetensors"))


def test_reload_checks_refuse_bad_checkpoints(tmp_path):
    good = _checkpoint(tmp_path, "good")
    config = json.loads((good / "config.json").read_text())
    first = sorted(load_file(good / "model.safetensors"))[0]
    cases = {
        "missing tensor": _checkpoint(tmp_path, "missing", lambda t: t.pop(first)),
        "has shape": _checkpoint(tmp_path, "shape", lambda t: t.update({first: torch.zeros(3, 3)})),
        "non-finite": _checkpoint(tmp_path, "nan", lambda t: t[first].fill_(float("nan"))),
        "unexpected tensor": _checkpoint(tmp_path, "extra", lambda t: t.update({"extra.weight": torch.zeros(2)})),
        "shared target tensors": _checkpoint(tmp_path, "shared",
                                             lambda t: t.update({"lm_head.weight": torch.zeros(2)})),
    }
    for message, folder in cases.items():
        with pytest.raises(ReloadError, match=message):
            read_checked_tensors(folder, None, config)
    with pytest.raises(ReloadError, match="the caller says"):
        read_checked_tensors(good, "0" * 64, config)
    flipped = _checkpoint(tmp_path, "flipped")
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (flipped / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ReloadError, match="the manifest says"):
        read_checked_tensors(flipped, None, config)
    with pytest.raises(ReloadError, match="server restart"):
        read_checked_tensors(good, None, {**config, "num_hidden_layers": 7})
    with pytest.raises(ReloadError, match="not a drafter checkpoint"):
        read_checked_tensors(tmp_path / "nothing", None, config)


def test_served_acceptance_windows():
    served = ServedAcceptance()
    served.update("v1", 0, 0)  # first snapshot: baseline only
    served.update("v1", 100, 50)
    served.update("v1", 300, 90)
    assert served.totals("v1") == (300, 90)
    assert served.recent_tau("v1", 150) == (pytest.approx(1 + 40 / 200), 200)  # last window is 200 drafts
    start = served.mark("v2")
    served.update("v2", 400, 190)
    assert served.since_tau("v2", start) == (pytest.approx(2.0), 100)
    assert served.recent_tau("v3", 10) == (None, 0)
    assert version_gauge("v0012") == 12.0


def test_prometheus_series_from_status_and_trainer():
    registry = CollectorRegistry()
    status = {"version": "v0003", "capture": {"captured": 7, "dropped": 1, "opted_out": 2, "blocks": 40,
                                              "writer": {"buffer_bytes": 1234, "buffer_segments": 3}}}
    trainer = {"steps": 12, "replayed_tokens": 900, "loss": 0.5, "loss_accepted": 0.2, "loss_rejected": 0.3,
               "promotions": 1, "gates": 2, "last_gate": {"tau_candidate": 1.4, "tau_serving": 1.2,
                                                           "record_diff_lower": 0.05}}
    registry.register(PolledCollector(lambda: status))
    registry.register(TrainerCollector(lambda: trainer))
    text = generate_latest(registry).decode()
    for line in ["online_opd_records_captured_total 7.0", "online_opd_records_dropped_total 1.0",
                 "online_opd_records_opted_out_total 2.0", "online_opd_buffer_bytes 1234.0",
                 "online_opd_buffer_segments 3.0", "online_opd_drafter_version 3.0",
                 'online_opd_drafter_info{version="v0003"} 1.0', "online_opd_trainer_steps_total 12.0",
                 'online_opd_trainer_loss{part="rejected"} 0.3', 'online_opd_gate_tau{drafter="candidate"} 1.4',
                 "online_opd_gate_lower_bound 0.05", "online_opd_trainer_up 1.0",
                 "online_opd_gate_promotions_total 1.0"]:
        assert line in text, line
    down = CollectorRegistry()
    down.register(TrainerCollector(lambda: None))
    assert "online_opd_trainer_up 0.0" in generate_latest(down).decode()
