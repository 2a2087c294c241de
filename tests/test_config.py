"""Tests for online_opd.config: shipped configs, overrides, round-trip, error messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from online_opd import config as config_module
from online_opd.config import (
    ConfigError,
    OnlineOPDConfig,
    apply_overrides,
    dump_config,
    load_config,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_configs_folder_is_not_empty():
    names = {path.name for path in CONFIG_FILES}
    assert {"default.yaml", "qwen3-dflash-gpu.yaml", "test-tiny.yaml"} <= names


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"section.key": value}`` for every value of a nested mapping that is not itself a mapping."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _written(path: Path) -> dict[str, object]:
    """The leaves a YAML file writes, numbers like ``3e-4`` read as floats (as load_config does)."""
    written = _leaves(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    return {k: float(v) if isinstance(v, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", v) else v
            for k, v in written.items()}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_every_value_a_shipped_config_writes_reaches_the_config(path: Path):
    loaded = _leaves(load_config(path).model_dump(mode="json"))
    written = _written(path)
    assert written, path
    assert {k: loaded.get(k, "<missing>") for k in written} == written


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_dump_roundtrip_of_shipped_config(path: Path, tmp_path: Path):
    cfg = load_config(path)
    assert load_config(_write(tmp_path, dump_config(cfg))) == cfg


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_every_key_a_shipped_config_leaves_out_takes_its_default(path: Path):
    """A partly written section keeps the defaults of the keys it does not write (test-tiny.yaml's
    bootstrap section keeps the warm-up's lr, not the trainer's)."""
    defaults = _leaves(OnlineOPDConfig().model_dump(mode="json"))
    loaded = _leaves(load_config(path).model_dump(mode="json"))
    unwritten = loaded.keys() - _written(path).keys()
    assert {k: loaded[k] for k in unwritten} == {k: defaults[k] for k in unwritten}


def test_partly_written_bootstrap_section_stays_an_sft_warm_up():
    cfg = load_config(overrides=["bootstrap.num_steps=100"])
    assert (cfg.bootstrap.objective, cfg.bootstrap.lr, cfg.bootstrap.output_dir) == \
        ("sft", 1e-3, Path("runs/bootstrap"))
    assert cfg.bootstrap.num_steps == 100 and cfg.trainer == OnlineOPDConfig().trainer


def _field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of every leaf field of a config model (nested models are walked)."""
    paths: set[str] = set()
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            paths |= _field_paths(field.annotation, f"{prefix}{name}.")
        else:
            paths.add(f"{prefix}{name}")
    return paths


def test_config_show_without_file_prints_every_key_and_reads_back(tmp_path: Path):
    shown = dump_config(load_config())
    assert set(_leaves(yaml.safe_load(shown))) == _field_paths(OnlineOPDConfig)
    assert load_config(_write(tmp_path, shown)) == load_config() == OnlineOPDConfig()


def test_every_model_forbids_extra_keys():
    models = [obj for obj in vars(config_module).values()
              if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel]
    assert len(models) >= 6
    for model in models:
        assert model.model_config.get("extra") == "forbid", model.__name__


def test_dotted_overrides_of_various_types():
    cfg = load_config(overrides=[
        "trainer.lr=1e-4",
        "drafter.target_layer_ids=[1,8,15]",
        "trainer.first_rejected_only=true",
        "trainer.betas=[0.8, 0.99]",
        "model.target=/models/my-target",
        "drafter.init_from=/ckpt/v3",
        "eval.split=all",
        "trainer.num_threads=4",
        "engine.max_num_seqs=64",
        "engine.enforce_eager=false",
    ])
    assert cfg.trainer.lr == pytest.approx(1e-4)
    assert cfg.drafter.target_layer_ids == [1, 8, 15]
    assert cfg.trainer.first_rejected_only is True
    assert cfg.trainer.betas == (0.8, 0.99)
    assert cfg.model.target == "/models/my-target"
    assert cfg.drafter.init_from == Path("/ckpt/v3")
    assert cfg.eval.split == "all" and cfg.trainer.num_threads == 4
    assert cfg.engine == {"max_num_seqs": 64, "enforce_eager": False}


def test_overrides_apply_over_file_in_order(tmp_path: Path):
    path = _write(tmp_path, "trainer:\n  lr: 2.0e-4\n  num_steps: 7\n")
    cfg = load_config(path, ["trainer.lr=5e-5", "trainer.num_steps=9", "trainer.num_steps=11"])
    assert cfg.trainer.lr == pytest.approx(5e-5) and cfg.trainer.num_steps == 11


def test_null_override_and_empty_section(tmp_path: Path):
    path = _write(tmp_path, "model:\n  target: some/model\nengine:\n")
    cfg = load_config(path, ["model.target=null"])
    assert cfg.model.target is None and cfg.engine == {}


def test_yaml_exponent_without_dot_is_a_float(tmp_path: Path):
    cfg = load_config(_write(tmp_path, "trainer:\n  lr: 1e-4\nengine:\n  swap_space: 4e0\n"))
    assert cfg.trainer.lr == pytest.approx(1e-4)
    assert cfg.engine["swap_space"] == 4.0


def test_apply_overrides_returns_new_validated_config():
    base = load_config()
    new = apply_overrides(base, ["drafter.block_size=4"])
    assert new.drafter.block_size == 4 and base.drafter.block_size == 8
    with pytest.raises(ConfigError, match="drafter.block_size"):
        apply_overrides(base, ["drafter.block_size=64"])


def test_dump_roundtrip_with_overrides(tmp_path: Path):
    cfg = load_config(overrides=["drafter.target_layer_ids=[0,5]", "trainer.lr=1e-5",
                                 "drafter.init_from=/x/y", "engine.max_num_seqs=3"])
    text = dump_config(cfg)
    assert "init_from: /x/y" in text
    assert load_config(_write(tmp_path, text)) == cfg


def test_resolved_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ONLINE_OPD_CACHE", str(tmp_path / "env-cache"))
    assert load_config().model.resolved_cache_dir() == tmp_path / "env-cache"
    cfg = load_config(overrides=[f"model.cache_dir={tmp_path / 'explicit'}"])
    assert cfg.model.resolved_cache_dir() == tmp_path / "explicit"


def test_unknown_key_in_yaml_names_dotted_key(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.lrr'.*'trainer\.lr'"):
        load_config(_write(tmp_path, "trainer:\n  lrr: 1.0e-4\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'serving'"):
        load_config(_write(tmp_path, "serving:\n  port: 8000\n"))


@pytest.mark.parametrize("override, key", [
    ("trainer.lrr=1e-4", "'trainer.lrr'"),
    ("drafter.blocksize=4", "'drafter.blocksize'"),
    ("trainr.lr=1e-4", "'trainr'"),
])
def test_unknown_key_in_override_names_dotted_key(override: str, key: str):
    with pytest.raises(ConfigError, match="unknown key " + key.replace(".", r"\.")):
        load_config(overrides=[override])


@pytest.mark.parametrize("override", ["trainer.lr", "=3", "trainer..lr=1", "trainer.lr.x=1"])
def test_malformed_override_is_named(override: str):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert repr(override) in str(info.value)


def test_bad_type_names_field_and_value():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["trainer.num_steps=lots"])
    message = str(info.value)
    assert "trainer.num_steps" in message and "'lots'" in message


def test_bad_type_in_yaml_names_field(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"drafter\.method.*'medusa'"):
        load_config(_write(tmp_path, "drafter:\n  method: medusa\n"))


@pytest.mark.parametrize("key, section", [
    ("model", "model.target"),
    ("speculative_config", "drafter"),
    ("dtype", "model.dtype"),
    ("max_model_len", "model.max_model_len"),
])
def test_engine_reserved_key_rejected(key: str, section: str):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"engine.{key}=x"])
    message = str(info.value)
    assert f"'{key}'" in message and section in message


@pytest.mark.parametrize("override, field", [
    ("drafter.block_size=0", "drafter.block_size"),
    ("drafter.block_size=33", "drafter.block_size"),
    ("drafter.num_layers=0", "drafter.num_layers"),
    ("drafter.target_layer_ids=[8,1]", "drafter.target_layer_ids"),
    ("drafter.target_layer_ids=[1,1]", "drafter.target_layer_ids"),
    ("drafter.target_layer_ids=[-1,2]", "drafter.target_layer_ids"),
    ("drafter.target_layer_ids=[]", "drafter.target_layer_ids"),
    ("trainer.warmup_ratio=1.5", "trainer.warmup_ratio"),
    ("trainer.lr=0", "trainer.lr"),
    ("trainer.betas=[0.9,1.0]", "trainer.betas"),
    ("trainer.gamma=0", "trainer.gamma"),
    ("trainer.device=gpu", "trainer.device"),
    ("trainer.objective=dpo", "trainer.objective"),
    ("data.held_out_fraction=1.0", "data.held_out_fraction"),
    ("eval.temperature=-0.5", "eval.temperature"),
    ("serve.num_speculative_tokens=0", "serve.num_speculative_tokens"),
    ("model.max_model_len=0", "model.max_model_len"),
    ("model.dtype=fp8", "model.dtype"),
])
def test_validators_reject(override: str, field: str):
    """The error's line for the field names it and shows the refused value (the header also echoes the
    override, so matching the field anywhere in the message would prove nothing)."""
    value = yaml.safe_load(override.partition("=")[2])
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    line = rf"^  - {re.escape(field)}: .+ \(got {re.escape(repr(value))}\)$"
    assert re.search(line, str(info.value), re.MULTILINE), str(info.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="lambda_acc"):
        load_config(overrides=["trainer.lambda_acc=0", "trainer.lambda_rej=0"])
    with pytest.raises(ConfigError, match=r"data\.max_new_tokens"):
        load_config(overrides=["model.max_model_len=128", "data.max_new_tokens=256"])


def test_data_parallel_workers_need_a_sequence_each_and_ray_to_place_their_gpus():
    cfg = load_config(overrides=["trainer.num_workers=4", "trainer.sequences_per_step=4", "trainer.device=cuda"])
    assert cfg.trainer.num_workers == 4 and cfg.bootstrap.num_workers == 1
    with pytest.raises(ConfigError, match=r"trainer: num_workers=4 needs sequences_per_step >= num_workers.*got 3"):
        load_config(overrides=["trainer.num_workers=4", "trainer.sequences_per_step=3"])
    with pytest.raises(ConfigError, match=r"trainer: num_workers=2 runs on device 'cpu' or 'cuda'.*'cuda:1'"):
        load_config(overrides=["trainer.num_workers=2", "trainer.device=cuda:1"])
    with pytest.raises(ConfigError, match=r"bootstrap: num_workers=2: the bootstrap trains on the CPU.*'cuda'"):
        load_config(overrides=["bootstrap.num_workers=2", "bootstrap.device=cuda"])
    with pytest.raises(ConfigError, match=r"trainer\.worker_resources: worker_resources\['CPU'\] = -1\.0"):
        load_config(overrides=["trainer.worker_resources={CPU: -1}"])


def test_file_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "trainer: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    assert load_config(_write(tmp_path, "")) == OnlineOPDConfig()
