"""Typed run configuration: pydantic models nested by concern, YAML + dotted overrides.

``load_config("configs/default.yaml", ["trainer.lr=1e-4"])`` reads a YAML file,
applies ``section.key=value`` overrides (values parsed as YAML), and validates
everything into an :class:`OnlineOPDConfig`. Every model forbids unknown keys;
all problems surface as one :class:`ConfigError` naming the dotted key.
``dump_config`` writes the validated config back as YAML (``config show``).

Sections here: model (target), drafter, data (training traffic), and ``engine``
(vLLM engine keyword arguments passed through untouched). The training-side
sections (trainer, bootstrap, eval) live in config_training.py, the serving-side
ones (serve, capture, gate, online, cpu) in config_serving.py, their common base
in config_base.py; all are re-exported here, so import every section from this
module. What the sections *mean* at run time lives with their users, not here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from online_opd.config_base import PromptSource, StrictModel
from online_opd.config_serving import CaptureConfig, CpuConfig, GateConfig, OnlineConfig, ServeConfig
from online_opd.config_training import AutoObjectiveConfig, BootstrapConfig, EvalConfig, TrainerConfig

__all__ = ["ConfigError", "ModelConfig", "DrafterConfig", "DataConfig", "TrainerConfig", "AutoObjectiveConfig",
           "BootstrapConfig", "EvalConfig", "CaptureConfig", "ServeConfig", "GateConfig", "OnlineConfig", "CpuConfig",
           "OnlineOPDConfig", "load_config", "apply_overrides", "dump_config"]

RESERVED_ENGINE_KEYS = {"model": "model.target", "speculative_config": "the drafter section",
                        "dtype": "model.dtype", "max_model_len": "model.max_model_len"}  # -> where to set it


class ConfigError(ValueError):
    """A config file or override is missing, malformed, or fails validation."""


class ModelConfig(StrictModel):
    """The target model that serves traffic and teaches the drafter."""

    target: str | None = Field(
        None, min_length=1, description="Path or Hugging Face id; null = embedded SmolLM2-135M-Instruct.")
    cache_dir: Path | None = Field(
        None, description="Cache for the embedded model; null = $ONLINE_OPD_CACHE or ~/.cache/online-opd.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's dtype for target and drafter (the trainer always computes in float32). "
                            "auto = bfloat16 on a GPU and on a CPU with native bf16 (AVX512-BF16/AMX: "
                            "the fastest plain serving measured here), else float32. Exact-output "
                            "comparisons need float32: batched verification changes bf16 rounding.")
    max_model_len: int = Field(2048, gt=0, description="Longest sequence (prompt + output) in tokens.")

    def serving_dtype(self) -> str:
        """``dtype`` with auto resolved for this machine."""
        if self.dtype != "auto":
            return self.dtype
        import torch

        if torch.cuda.is_available():
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"

    def resolved_cache_dir(self) -> Path:
        """``cache_dir``, or the package default when unset."""
        if self.cache_dir is not None:
            return self.cache_dir.expanduser()
        from online_opd.models.target import default_cache_dir

        return default_cache_dir()


class DrafterConfig(StrictModel):
    """Architecture and initialisation of the speculative drafter."""

    method: Literal["dflash", "eagle3"] = Field("dflash", description="Drafter architecture.")
    num_layers: int = Field(1, ge=1, description="Transformer layers in the drafter.")
    block_size: int = Field(
        8, ge=1, le=32, description="K: tokens drafted per block (vLLM num_speculative_tokens).")
    target_layer_ids: list[int] | None = Field(
        None, min_length=1,
        description="Target layers whose hidden states feed the drafter; null = spread automatically.")
    intermediate_size: int | None = Field(None, gt=0, description="Drafter MLP width; null = the target's.")
    mask_token_id: int | None = Field(
        None, ge=0,
        description="Placeholder token for not-yet-drafted positions; null = chosen from the tokenizer.")
    init_from: Path | None = Field(
        None, description="Start from this drafter checkpoint folder; null = random init.")
    seed: int = Field(0, description="Seed of the random initialisation.")
    draft_vocab_size: int | None = Field(
        None, ge=2,
        description="Draft over the N target tokens most frequent in the training data (vLLM "
                    "draft_vocab_size with a d2t map); null = the target's whole vocabulary.")

    @field_validator("target_layer_ids")
    @classmethod
    def _layer_ids_sorted(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (min(ids) < 0 or any(a >= b for a, b in zip(ids, ids[1:]))):
            raise ValueError("must be unique, sorted ascending and >= 0")
        return ids


class DataConfig(StrictModel):
    """Prompt traffic that drives training when no live server supplies it."""

    prompts: PromptSource = Field("sharegpt", description="Prompt set (an installed offline wheel).")
    num_prompts: int = Field(512, ge=1, description="Training prompts drawn from the train split.")
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per training prompt.")
    held_out_fraction: float = Field(
        0.2, gt=0, lt=1, description="Share of prompt ids reserved for evaluation.")
    seed: int = Field(0, description="Shuffle seed for prompt selection.")
    rollout_samples: int = Field(
        0, ge=0, description="Sampled target rollouts per training prompt, besides the greedy one (pass "
                             "p seeded data.seed + p: reproducible): more of the target's text on the same "
                             "prompts. Held-out rollouts stay greedy.")
    rollout_temperature: float = Field(
        0.7, gt=0, description="Sampling temperature of the rollout_samples rollouts.")


class OnlineOPDConfig(StrictModel):
    """Root of an online-opd run configuration."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    bootstrap: BootstrapConfig = Field(
        default_factory=BootstrapConfig,
        description="Offline SFT warm-up of a fresh drafter (`online-opd bootstrap`).")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    online: OnlineConfig = Field(default_factory=OnlineConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    engine: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine keyword arguments, passed through as-is.")

    @field_validator("engine")
    @classmethod
    def _engine_not_reserved(cls, engine: dict[str, Any]) -> dict[str, Any]:
        for key in engine.keys() & RESERVED_ENGINE_KEYS.keys():
            raise ValueError(f"'{key}' is owned by online-opd; set {RESERVED_ENGINE_KEYS[key]} instead")
        return engine

    @model_validator(mode="after")
    def _lengths_fit(self) -> OnlineOPDConfig:
        limit = self.model.max_model_len
        for name, value in [("data.max_new_tokens", self.data.max_new_tokens),
                            ("eval.max_tokens", self.eval.max_tokens)]:
            if value >= limit:
                raise ValueError(f"{name}={value} must be < model.max_model_len={limit}")
        return self


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` (no dot) as a float, as users expect."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> OnlineOPDConfig:
    """Read ``path`` (None = all defaults), apply dotted ``overrides``, validate."""
    data = _read_yaml(Path(path)) if path is not None else {}
    origin = str(path) if path is not None else "defaults"
    return _validate(_merge_overrides(data, overrides), origin, overrides)


def apply_overrides(cfg: OnlineOPDConfig, overrides: Sequence[str]) -> OnlineOPDConfig:
    """A new config: ``cfg`` with dotted ``overrides`` applied and re-validated."""
    return _validate(_merge_overrides(cfg.model_dump(), overrides), "config", overrides)


def dump_config(cfg: OnlineOPDConfig) -> str:
    """YAML of the validated config (paths as strings, every default written out)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return {key: value for key, value in data.items() if value is not None}  # empty section = defaults


def _merge_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each ``a.b.c=value`` (value parsed as YAML) into ``data``, in order."""
    for raw in overrides:
        key, sep, text = raw.partition("=")
        keys = key.strip().split(".")
        if not sep or not all(keys):
            raise ConfigError(f"malformed override {raw!r}: expected section.key=value")
        _check_key_path(keys, raw)
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {raw!r}: value is not valid YAML: {exc}") from None
        node = data
        for depth, part in enumerate(keys[:-1]):
            if not isinstance(node.get(part), dict):
                if node.get(part) is not None:
                    raise ConfigError(f"override {raw!r}: '{'.'.join(keys[:depth + 1])}' is not a section")
                node[part] = {}
            node = node[part]
        node[keys[-1]] = value
    return data


def _check_key_path(keys: list[str], raw: str) -> None:
    """Name the full dotted key when an override points outside the schema."""
    model: type[BaseModel] | None = OnlineOPDConfig
    for depth, part in enumerate(keys):
        dotted = ".".join(keys[: depth + 1])
        if model is None:  # below a free-form dict such as engine
            return
        if part not in model.model_fields:
            raise ConfigError(f"override {raw!r}: unknown key '{dotted}'{_suggest(keys[:depth + 1], model)}")
        is_last, is_dict = depth == len(keys) - 1, get_origin(model.model_fields[part].annotation) is dict
        model = _sub_model(model, part)
        if model is None and not (is_last or is_dict):
            raise ConfigError(f"override {raw!r}: '{dotted}' is a value, not a section")


def _sub_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model class of section ``name`` of ``model``; None when it is not a section."""
    annotation = model.model_fields[name].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _suggest(keys: Sequence[str], model: type[BaseModel]) -> str:
    """A "did you mean" hint for the unknown last key of ``keys``, a field of ``model``."""
    close = difflib.get_close_matches(keys[-1], list(model.model_fields), n=1)
    return f" (did you mean '{'.'.join([*keys[:-1], close[0]])}'?)" if close else ""


def _validate(data: dict[str, Any], origin: str, overrides: Sequence[str]) -> OnlineOPDConfig:
    try:
        return OnlineOPDConfig.model_validate(data)
    except ValidationError as exc:
        where = origin + (f" with overrides {list(overrides)}" if overrides else "")
        problems = "\n".join(f"  - {_describe(err)}" for err in exc.errors())
        raise ConfigError(f"invalid online-opd config ({where}):\n{problems}") from None


def _describe(err: ErrorDetails) -> str:
    """One pydantic error as ``dotted.key: message (got value)``."""
    loc = [str(part) for part in err["loc"]]
    dotted = ".".join(loc) or "config"
    if err["type"] == "extra_forbidden":
        parent: type[BaseModel] | None = OnlineOPDConfig
        for part in loc[:-1]:
            parent = _sub_model(parent, part) if parent and part in parent.model_fields else None
        return f"unknown key '{dotted}'" + (_suggest(loc, parent) if parent else "")
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if isinstance(value, (dict, BaseModel)):
        return f"{dotted}: {message}"
    shown = repr(value)
    return f"{dotted}: {message} (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
