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
from online_opd.files import sha256_file
from online_opd.models.drafters.checkpoint import save_drafter
from serve.server import engine_flags, metrics_url, vllm_argv
from tests.tiny import tiny_drafter, tiny_eagle3_drafter
from vllm_patches import UnsupportedVLLMVersion, check_vllm_version
from vllm_patches.capture import opted_out
from vllm_patches.metrics import PolledCollector, ServedAcceptance, TrainerCollector, version_gauge
from vllm_patches.worker_ext import (
    ReloadError,
    read_checked_tensors,
    read_verified_tensors,
    verify_for_reload,
)


def test_vllm_version_range():
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.3+cpu") == "0.32.3+cpu"
    for bad in ("0.31.9", "0.33.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLMVersion, match="support vllm>=0.32.0,<0.33.0"):
            check_vllm_version(bad)


@pytest.mark.parametrize("extra,out", [(None, False), ({}, False), ({"online_opd_capture": True}, False),
                                       ({"online_opd_capture": False}, True), ({"online_opd_capture": 0}, True),
                                       ({"online_opd_capture": "off"}, True), ({"other": 1}, False),
                                       ({"online_opd_capture": "maybe"}, True), ({"online_opd_capture": 2}, True)])
def test_opt_out_rule(extra, out):
    # vLLM's vllm_xargs turn JSON false into 0: both opt out
    assert opted_out(types.SimpleNamespace(extra_args=extra)) is out


@pytest.mark.parametrize("value", ["flase", "", 2, -1, 0.5, ["false"], None])
def test_a_capture_flag_that_reads_neither_way_gets_vllm_s_validation_error(value):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_patches.request_checks import check_capture_flag, read_capture_flag

    assert read_capture_flag(value) is None
    with pytest.raises(VLLMValidationError, match="vllm_xargs.online_opd_capture must be true or false") as err:
        check_capture_flag(SamplingParams(extra_args={"online_opd_capture": value}))
    assert err.value.parameter == "vllm_xargs.online_opd_capture"
    for fine in ({}, {"other": "x"}, {"online_opd_capture": 0}, {"online_opd_capture": " Yes "}):
        check_capture_flag(SamplingParams(extra_args=fine))


def test_engine_flags_and_argv(tmp_path):
    assert engine_flags({"enforce_eager": True, "max_num_seqs": 8, "x": False, "y": None, "z": {"a": 1}}) == [
        "--enforce-eager", "--max-num-seqs", "8", "--z", '{"a": 1}']
    drafter = save_drafter(tiny_drafter(), tmp_path / "d", version="v0001")
    cfg = load_config(None, ["serve.port=9123", "serve.speculation=always"])
    argv = vllm_argv(cfg, Path("/models/t"), drafter, ["--max-num-seqs", "4", "--port", "9999"])
    assert argv[:2] == ["serve", "/models/t"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4,
                    "disable_eagle_block_drop": True}
    assert argv[argv.index("--worker-extension-cls") + 1] == "vllm_patches.worker_ext.OnlineOPDWorkerExtension"
    assert "--enforce-eager" in argv
    assert argv[-4:] == ["--max-num-seqs", "4", "--port", "9999"]  # pass-through last: it wins
    assert metrics_url(argv) == "http://127.0.0.1:9999"  # the trainer process reads the load there


def test_metrics_url_follows_vllms_last_host_and_port():
    assert metrics_url(["serve", "m"]) == "http://127.0.0.1:8000"  # vLLM's defaults
    assert metrics_url(["serve", "m", "--host", "0.0.0.0", "--port", "1", "--port=9001"]) == "http://127.0.0.1:9001"
    assert metrics_url(["serve", "m", "--host=::", "--port", "9002"]) == "http://[::1]:9002"
    assert metrics_url(["serve", "m", "--host", "10.0.0.5"]) == "http://10.0.0.5:8000"
    assert metrics_url(["serve", "m", "--uds", "/tmp/s.sock"]) is None  # not read: the load counts as serving
    assert metrics_url(["serve", "m", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]) is None


@pytest.mark.parametrize("make, method", [(tiny_drafter, "dflash"), (tiny_eagle3_drafter, "eagle3")])
def test_argv_serves_the_drafters_block_size_unless_serve_sets_k(tmp_path, make, method):
    drafter = save_drafter(make(block_size=5), tmp_path / "d", version="v0001")

    def spec(*overrides: str) -> dict:
        argv = vllm_argv(load_config(None, ["serve.speculation=always", *overrides]), Path("/models/t"),
                         drafter, [])
        return json.loads(argv[argv.index("--speculative-config") + 1])

    # drafter.block_size (8) and eval's K are not the served K; the checkpoint's block size is
    # EAGLE-3 keeps vLLM's drop of a prefix hit's last block (its K/V there need the next token)
    assert spec("eval.num_speculative_tokens=3") == {"method": method, "model": str(drafter),
                                                     "num_speculative_tokens": 5,
                                                     **({"disable_eagle_block_drop": True} if method == "dflash" else {})}
    assert spec("serve.num_speculative_tokens=2")["num_speculative_tokens"] == 2


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
        "dtype torch.float8_e4m3fn": _checkpoint(
            tmp_path, "float8", lambda t: t.update({first: t[first].to(torch.float8_e4m3fn)})),
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


def test_reload_verified_outside_the_engine_step_then_only_stat_checked(tmp_path):
    good = _checkpoint(tmp_path, "good")
    config = json.loads((good / "config.json").read_text())
    sha = sha256_file(good / "model.safetensors")
    verified = verify_for_reload(good, None)
    assert verified["sha256"] == sha and verified["size"] == (good / "model.safetensors").stat().st_size
    tensors = read_verified_tensors(good, verified, config)
    assert set(tensors) == set(load_file(good / "model.safetensors"))
    with pytest.raises(ReloadError, match="the caller says"):
        verify_for_reload(good, "0" * 64)
    nan = _checkpoint(tmp_path, "nan", lambda t: t[sorted(t)[0]].fill_(float("nan")))
    with pytest.raises(ReloadError, match="non-finite"):
        verify_for_reload(nan, None)  # tensor checks happen here, before the RPC
    with pytest.raises(ReloadError, match="server restart"):
        read_verified_tensors(good, verified, {**config, "num_hidden_layers": 7})
    tensors["extra.weight"] = torch.zeros(4)
    save_file(tensors, good / "model.safetensors")  # replaced after it was verified
    with pytest.raises(ReloadError, match="changed since it was verified"):
        read_verified_tensors(good, verified, config)


def test_served_acceptance_windows():
    served = ServedAcceptance()
    served.update("v1", 0, 0)  # first snapshot: baseline only
    served.update("v1", 100, 50)
    served.update("v1", 300, 90)
    assert served.totals("v1") == (300, 90)
    assert served.recent("v1", 150, 1) == [(200, 40)]  # the last window alone holds 150 drafts
    assert served.recent("v1", 150, 2) == [(100, 50), (200, 40)]  # two windows asked for
    start = served.mark("v2")
    served.update("v2", 400, 190)
    served.update("v2", 400, 190)  # a poll without drafts adds no window
    served.update("v2", 450, 200)
    assert served.since("v2", start) == [(100, 100), (50, 10)]
    assert served.since("v2", start + 1) == [(50, 10)]
    assert served.recent("v3", 10, 1) == []
    assert version_gauge("v0012") == 12.0


def test_prometheus_series_from_status_and_trainer():
    registry = CollectorRegistry()
    status = {"version": "v0003", "capture": {"captured": 7, "dropped": 1, "opted_out": 2, "blocks": 40,
                                              "writer": {"buffer_bytes": 1234, "buffer_segments": 3,
                                                         "write_errors": 4, "held": 5}}}
    trainer = {"steps": 12, "replayed_tokens": 900, "loss": 0.5, "loss_accepted": 0.2, "loss_rejected": 0.3,
               "promotions": 1, "gates": 2, "last_gate": {"tau_candidate": 1.4, "tau_serving": 1.2,
                                                           "record_diff_lower": 0.05},
               "rest_seconds": 30.5, "engines_idle": True, "restarts": {"actor": 2, "ray": 1},
               "objective": "target_rollout", "objective_switches": 2, "first_position_acceptance": 0.375,
               "trained_tokens": 700, "fresh_records": 3, "gate_seconds": 8.25, "gates_deferred": 4}
    registry.register(PolledCollector(lambda: status))
    registry.register(TrainerCollector(lambda: trainer))
    text = generate_latest(registry).decode()
    for line in ["online_opd_records_captured_total 7.0", "online_opd_records_dropped_total 1.0",
                 "online_opd_records_opted_out_total 2.0", "online_opd_buffer_bytes 1234.0",
                 "online_opd_buffer_segments 3.0", "online_opd_drafter_version 3.0",
                 'online_opd_drafter_info{version="v0003"} 1.0', "online_opd_trainer_steps_total 12.0",
                 'online_opd_trainer_loss{part="rejected"} 0.3', 'online_opd_gate_tau{drafter="candidate"} 1.4',
                 "online_opd_gate_lower_bound 0.05", "online_opd_trainer_up 1.0",
                 "online_opd_gate_promotions_total 1.0", "online_opd_buffer_write_errors_total 4.0",
                 "online_opd_buffer_held_records 5.0", 'online_opd_trainer_restarts_total{level="actor"} 2.0',
                 'online_opd_trainer_restarts_total{level="ray"} 1.0', "online_opd_trainer_rest_seconds_total 30.5",
                 "online_opd_trainer_engines_idle 1.0", 'online_opd_trainer_objective{objective="target_rollout"} 1.0',
                 "online_opd_trainer_objective_switches_total 2.0",
                 "online_opd_trainer_first_position_acceptance 0.375", "online_opd_trainer_trained_tokens_total 700.0",
                 "online_opd_trainer_fresh_records 3.0", "online_opd_trainer_gate_seconds_total 8.25",
                 "online_opd_gate_deferrals_total 4.0"]:
        assert line in text, line
    down = CollectorRegistry()
    down.register(TrainerCollector(lambda: None))
    assert "online_opd_trainer_up 0.0" in generate_latest(down).decode()
    restarting = CollectorRegistry()  # down, between restarts: the restart counts stay visible
    restarting.register(TrainerCollector(lambda: {"up": False, "restarts": {"actor": 0, "ray": 3}}))
    text = generate_latest(restarting).decode()
    assert "online_opd_trainer_up 0.0" in text and 'online_opd_trainer_restarts_total{level="ray"} 3.0' in text
    assert "online_opd_trainer_steps_total" not in text


def test_records_and_the_shared_trainer_name_the_replica_alike(tmp_path):
    import json as _json

    from online_opd.config import load_config
    from online_opd.traces.buffer import default_writer_id
    from serve.server import replica_name, serve_env
    from vllm_patches import CAPTURE_ENV

    env = serve_env(load_config(None, [f"capture.buffer_dir={tmp_path / 'buf'}"]), tmp_path, tmp_path, capture=True)
    assert _json.loads(env[CAPTURE_ENV])["replica"] == replica_name() == default_writer_id()


def test_the_poll_pacer_polls_a_working_engine_and_rarely_an_idle_one():
    from vllm_patches.engine_poll import PollPacer

    pacer = PollPacer(settle_s=30, idle_poll_s=60)

    def tick(now: float, activity: tuple) -> bool:
        due = pacer.due(now, activity)
        if due:
            pacer.polled(now)
        return due

    idle = (0.0, 0.0, 0.0, 0.0)
    assert tick(0.0, idle)  # the first poll: the engine's figures at start
    assert not any(tick(t, idle) for t in (0.5, 1.0, 30.0, 59.5))  # a fresh engine is idle
    assert tick(60.0, idle)  # ... polled once a minute
    assert tick(60.5, (10.0, 1.0, 1.0, 0.0))  # a request: every tick
    assert tick(61.0, (10.0, 5.0, 1.0, 0.0))
    assert tick(61.5, (10.0, 9.0, 0.0, 0.0))  # it finished: its last tokens moved the counters
    assert all(tick(61.5 + 0.5 * i, (10.0, 9.0, 0.0, 0.0)) for i in range(1, 61))  # settling: 30 s
    assert not tick(92.0, (10.0, 9.0, 0.0, 0.0))
    assert not tick(151.0, (10.0, 9.0, 0.0, 0.0))
    assert tick(152.0, (10.0, 9.0, 0.0, 0.0))  # idle again: 60 s after the last poll


def test_engine_activity_reads_vllm_token_counters_and_request_gauges():
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from vllm_patches.engine_poll import ACTIVITY_SERIES, engine_activity, sample_sums

    def activity(registry):
        return engine_activity(sample_sums(registry, ACTIVITY_SERIES))

    registry = CollectorRegistry()
    prompt = Counter("vllm:prompt_tokens", "", ["engine"], registry=registry)
    running = Gauge("vllm:num_requests_running", "", ["engine"], registry=registry)
    Counter("vllm:generation_tokens", "", ["engine"], registry=registry)
    start = activity(registry)
    assert activity(registry) == start
    prompt.labels("0").inc(7)
    prompt.labels("1").inc(3)
    assert activity(registry)[0] == start[0] + 10
    running.labels("0").set(1)
    assert activity(registry)[2] == 1
