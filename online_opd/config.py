"""Typed run configuration: pydantic models nested by concern, YAML + dotted overrides.

``load_config("configs/default.yaml", ["trainer.lr=1e-4"])`` reads a YAML file,
applies ``section.key=value`` overrides (values parsed as YAML), and validates
everything into an :class:`OnlineOPDConfig`. Every model forbids unknown keys;
all problems surface as one :class:`ConfigError` naming the dotted key.
``dump_config`` writes the validated config back as YAML (``config show``).

Sections: model (target), drafter, data (training traffic), trainer, eval, and
``engine`` (vLLM engine keyword arguments passed through untouched). What the
sections *mean* at run time lives with their users, not here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

__all__ = ["ConfigError", "ModelConfig", "DrafterConfig", "DataConfig", "TrainerConfig", "BootstrapConfig",
           "EvalConfig", "CaptureConfig", "ServeConfig", "GateConfig", "OnlineConfig", "OnlineOPDConfig",
           "load_config", "apply_overrides", "dump_config"]

PromptSource = Literal["sharegpt", "humaneval"]
RESERVED_ENGINE_KEYS = {"model": "model.target", "speculative_config": "the drafter section",
                        "dtype": "model.dtype", "max_model_len": "model.max_model_len"}  # -> where to set it


class ConfigError(ValueError):
    """A config file or override is missing, malformed, or fails validation."""


class _Strict(BaseModel):
    """Base of every config model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
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


class CpuConfig(_Strict):
    """vLLM's CPU runtime (serve/cpu_runtime.py), for the server and the offline engine; ignored on GPUs.

    The defaults are the fastest plain-vLLM settings benchmarks/plain_settings.py measured here; the
    speed benchmarks give their plain-vLLM baseline the same ones."""

    openmp: Literal["iomp", "gomp"] = Field(
        "iomp", description="OpenMP runtime the engine preloads: iomp = Intel's libiomp5 from the venv "
                            "(vLLM's recommendation; needed for fast speculative decoding), gomp = torch's "
                            "libgomp (vLLM's fallback). An LD_PRELOAD that already names one is kept.")
    reserved_cores: int | None = Field(
        0, ge=0, description="VLLM_CPU_NUM_OF_RESERVED_CPU: cores kept out of the engine's OpenMP threads "
                             "for the scheduler and API server; null = vLLM's default (1 on x86). An "
                             "environment value already set is kept.")


class DrafterConfig(_Strict):
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

    @field_validator("target_layer_ids")
    @classmethod
    def _layer_ids_sorted(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (min(ids) < 0 or any(a >= b for a, b in zip(ids, ids[1:]))):
            raise ValueError("must be unique, sorted ascending and >= 0")
        return ids


class DataConfig(_Strict):
    """Prompt traffic that drives training when no live server supplies it."""

    prompts: PromptSource = Field("sharegpt", description="Prompt set (an installed offline wheel).")
    num_prompts: int = Field(512, ge=1, description="Training prompts drawn from the train split.")
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per training prompt.")
    held_out_fraction: float = Field(
        0.2, gt=0, lt=1, description="Share of prompt ids reserved for evaluation.")
    seed: int = Field(0, description="Shuffle seed for prompt selection.")


class TrainerConfig(_Strict):
    """Distillation objective, optimiser and loop of the drafter trainer."""

    objective: Literal["sft", "draft_opd", "all_forward", "all_reverse", "target_rollout"] = Field(
        "draft_opd", description="Training objective: Draft-OPD, its ablations, or DFlash-style SFT.")
    lr: float = Field(3e-4, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    warmup_ratio: float = Field(
        0.05, ge=0, lt=1, description="Fraction of num_steps spent in linear warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0 = no clipping.")
    num_steps: int = Field(1000, ge=1, description="Optimiser steps.")
    sequences_per_step: int = Field(4, ge=1, description="Sequences replayed per step.")
    anchors_per_sequence: int = Field(16, ge=1, description="Draft blocks (anchors) sampled per sequence.")
    gamma: float = Field(
        0.8, gt=0, description="Position decay w_k = gamma^(k-1) on rejected positions (eq. 12).")
    lambda_acc: float = Field(1.0, ge=0, description="Weight of the accepted-position forward KL (eq. 13).")
    lambda_rej: float = Field(1.0, ge=0, description="Weight of the rejected-position reverse KL (eq. 13).")
    first_rejected_only: bool = Field(False, description="Rejected group = only the first rejected position.")
    sft_position_decay: float = Field(
        7.0, gt=0, description="SFT cross-entropy weight exp(-(k-1)/decay) (DFlash).")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; null = torch's default.")
    checkpoint_every: int = Field(200, ge=1, description="Steps between checkpoints.")
    log_every: int = Field(10, ge=1, description="Steps between log lines.")
    output_dir: Path = Field(Path("runs/train"), description="Folder for checkpoints and logs.")
    device: str = Field(
        "cpu", pattern=r"^(cpu|cuda|mps|xpu)(:\d+)?$", description="torch device of the trainer.")
    seed: int = Field(0, description="Seed of anchor sampling and data order.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each beta must lie in [0, 1)")
        return betas

    @model_validator(mode="after")
    def _lambdas_positive(self) -> TrainerConfig:
        if self.lambda_acc + self.lambda_rej <= 0:
            raise ValueError("lambda_acc + lambda_rej must be > 0")
        return self


class BootstrapConfig(TrainerConfig):
    """The trainer's fields with the SFT warm-up's defaults: a partly written ``bootstrap`` section
    keeps them (a plain TrainerConfig would fall back to Draft-OPD into runs/train)."""

    objective: Literal["sft", "draft_opd", "all_forward", "all_reverse", "target_rollout"] = Field(
        "sft", description="Training objective of the warm-up (DFlash-style SFT by default).")
    lr: float = Field(1e-3, gt=0, description="Peak AdamW learning rate.")
    num_steps: int = Field(600, ge=1, description="Optimiser steps.")
    output_dir: Path = Field(Path("runs/bootstrap"), description="Folder for checkpoints and logs.")
    rollouts: bool = Field(
        True, description="Train on target rollouts of the data.num_prompts prompts (generated by vLLM); "
                          "false = text only (needs text_conversations > 0).")
    text_conversations: int = Field(
        0, ge=0, description="Train-split ShareGPT first exchanges (human turn + reply) added as text, "
                             "labelled with the target's greedy tokens in the feature pass; 0 = none. "
                             "A step draws sequences_per_step sequences uniformly, with replacement, "
                             "from one pool of rollouts and text sequences.")
    text_max_tokens: int = Field(
        256, ge=1, description="Reply tokens kept per text conversation (the chat-templated human turn "
                               "comes on top; longer than model.max_model_len in all are skipped).")

    @model_validator(mode="after")
    def _has_training_data(self) -> BootstrapConfig:
        if not self.rollouts and self.text_conversations == 0:
            raise ValueError("rollouts=false leaves no training data; set text_conversations > 0 "
                             "or rollouts=true")
        return self


class EvalConfig(_Strict):
    """Acceptance and throughput measurement with vLLM speculative decoding."""

    prompts: PromptSource = Field("sharegpt", description="Prompt set to evaluate on.")
    split: Literal["train", "held_out", "all"] = Field("held_out", description="Which prompt-id partition.")
    num_prompts: int = Field(64, ge=1, description="Prompts evaluated.")
    max_tokens: int = Field(128, ge=1, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 = greedy.")
    baseline: bool = Field(
        True, description="Also measure tokens/s without speculative decoding in the same run.")
    ngram: bool = Field(
        True, description="Also measure vLLM's ngram speculation (prompt lookup, no training) on the same prompts.")
    num_speculative_tokens: int | None = Field(
        None, ge=1, description="Draft tokens per step in `online-opd eval`; null = the drafter's block size.")
    max_num_seqs: list[int] = Field(
        [1, 32], min_length=1, description="Concurrency levels (vLLM max_num_seqs) to measure at.")


class CaptureConfig(_Strict):
    """What the serving engine records into the trace buffer (vllm_patches/capture.py)."""

    enabled: bool = Field(True, description="Capture verification outcomes of served requests.")
    buffer_dir: Path = Field(Path("runs/serve/buffer"), description="Trace buffer folder (segment files).")
    sample_rate: float = Field(
        1.0, ge=0, le=1, description="Fraction of requests recorded (decided per request, at random).")
    queue_size: int = Field(
        4096, ge=1, description="Finished records waiting for the writer; beyond it records are dropped.")
    flush_records: int = Field(256, ge=1, description="Records per segment file (at most).")
    flush_interval_s: float = Field(5.0, gt=0, description="Seconds before a partial segment is written.")
    max_bytes: int | None = Field(
        2 * 1024**3, gt=0, description="Retention: oldest segments are deleted beyond this size.")
    max_age_s: float | None = Field(
        7 * 24 * 3600.0, gt=0, description="Retention: segments older than this are deleted.")


class ServeConfig(_Strict):
    """`online-opd serve`: the OpenAI-compatible server and its admin surface."""

    host: str = Field("127.0.0.1", description="Bind address (vLLM --host).")
    port: int = Field(8000, ge=1, le=65535, description="Port (vLLM --port).")
    num_speculative_tokens: int | None = Field(
        None, ge=1, description="Draft tokens per step the server asks of the drafter (vLLM "
                                "num_speculative_tokens); null = the drafter's block size.")
    speculation: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: K per batch size from measured step costs and the drafter's acceptance, "
                            "changed at runtime (online_opd/speculation/); always: num_speculative_tokens "
                            "at every step; never: no speculative decoding (capture still records).")
    policy_interval_s: float = Field(
        10.0, gt=0, description="speculation auto: seconds between recomputations of the schedule (also "
                                "recomputed after every drafter reload).")
    policy_margin: float = Field(
        0.05, ge=0, lt=1, description="speculation auto: a K replaces the serving one only with predicted "
                                      "tokens/s more than this share higher (hysteresis).")
    policy_min_drafts: int = Field(
        32, ge=1, description="speculation auto: live blocks reaching a draft position before its measured "
                              "acceptance is used (else the manifest's tau, else assumed not to pay).")
    policy_explore_share: float = Field(
        0.01, ge=0, le=0.5, description="speculation auto: share of engine steps run at K > 0 whatever the "
                                        "schedule, so the cost and acceptance of speculating stay measured.")
    policy_explore_steps: int = Field(
        3, ge=2, description="speculation auto: steps per exploration burst (the first drafts only, the "
                             "others verify and are timed).")
    run_dir: Path = Field(Path("runs/serve"), description="Server state: registry, trainer state, logs.")
    registry_dir: Path | None = Field(None, description="Drafter registry; null = <run_dir>/registry.")
    admin_token_env: str = Field(
        "ONLINE_OPD_ADMIN_TOKEN",
        description="Env var holding the admin bearer token; the admin routes are off when it is unset.")
    stats_poll_s: float = Field(
        5.0, gt=0, description="Seconds between polls of the engine's capture/reload figures for /metrics.")
    reload_poll_s: float = Field(5.0, gt=0, description="Seconds between checks of the registry's current.")
    auto_reload: bool = Field(
        True, description="Hot-load the registry's current version when it changes (the reloader).")
    live_check_drafts: int = Field(
        1000, ge=1, description="Drafts served by a new version (and by the old one before it) before the "
                                "live check decides (online_opd/release/live_check.py).")
    live_check_min_windows: int = Field(
        20, ge=4, description="Status polls (stats_poll_s apart) those drafts must span on each side: the "
                              "test's variance comes from the spread between polls.")
    live_check_alpha: float = Field(
        0.01, gt=0, lt=0.5, description="Live check's one-sided level: the most often a version no "
                                        "worse than the previous one is rolled back.")
    live_check_timeout_s: float = Field(
        600.0, gt=0, description="Give up the live check (keep the version) if traffic is too thin.")
    rollback_tolerance: float = Field(
        0.02, ge=0, lt=1, description="Live check margin: roll back only when live tau is, with confidence, "
                                      "below (1 - tolerance) x the previous version's.")
    registry_keep_unpromoted: int | None = Field(
        20, ge=1, description="Registry retention: the newest N never-current versions (candidates, rejected) "
                              "are kept, with every version ever made current; older ones are deleted after "
                              "each publish. null = keep every version.")

    @property
    def registry(self) -> Path:
        return self.registry_dir or self.run_dir / "registry"


class GateConfig(_Strict):
    """Promotion gate: a candidate drafter replaces the serving one only when its simulated
    acceptance on held-out traffic is higher with confidence (online_opd/release/gate.py)."""

    every_steps: int = Field(50, ge=1, description="Trainer steps between gate evaluations of the candidate.")
    min_records: int = Field(
        8, ge=2, description="Held-out records needed for a decision; fewer = not promoted.")
    held_out_fraction: float = Field(
        0.1, gt=0, lt=1, description="Share of captured records never trained on (by a hash of the first "
                                     "`split_prefix_tokens` prompt tokens, online_opd/release/gate.py).")
    split_prefix_tokens: int = Field(
        64, ge=1, description="Prompt tokens hashed for the held-out split: siblings, repeats and the later "
                              "turns of a conversation whose first prompt is at least this long share them. "
                              "Must exceed any system prompt all requests share, or every record lands on "
                              "one side.")
    margin: float = Field(
        0.0, description="Promote iff the lower confidence bound of the tau gain exceeds this (tau units).")
    confidence: float = Field(0.9, gt=0.5, lt=1, description="One-sided confidence of that lower bound.")
    max_blocks_per_record: int = Field(64, ge=1, description="Anchors simulated per held-out record (cap).")
    max_records: int = Field(64, ge=1, description="Most recent held-out records evaluated, at most.")

    @model_validator(mode="after")
    def _can_pass(self) -> GateConfig:
        if self.max_records < self.min_records:
            raise ValueError(f"max_records={self.max_records} < min_records={self.min_records}: "
                             "no evaluation could pass")
        return self


class OnlineConfig(_Strict):
    """Online trainer (online_opd/train/online.py, run as a Ray actor by serve/trainer_actor.py): tails
    the trace buffer, replays recent records with the trainer section's objective, gates and publishes."""

    enabled: bool = Field(True, description="Run the online trainer beside the server.")
    window_records: int = Field(512, ge=1, description="Most recent train records that steps sample from.")
    fresh_fraction: float = Field(
        0.5, ge=0, le=1,
        description="Replay ratio: share of a step's sequences taken from records not yet trained on "
                    "(newest first); the rest are drawn uniformly from the window.")
    min_records: int = Field(4, ge=1, description="Train records needed before the first step.")
    simulate_below_coverage: float = Field(
        0.5, ge=0, le=1,
        description="A train record whose logged blocks produced less than this share of its output tokens "
                    "(served mostly without speculation, or with blocks longer than the drafter's K) is "
                    "replayed on the blocks the current drafter would have drafted over it "
                    "(online_opd/opd/rollout.py simulated_record; one more target forward). 0 = never: "
                    "such records train on their logged blocks only; 1 = whenever a decode step did not "
                    "speculate.")
    poll_s: float = Field(2.0, gt=0, description="Seconds between buffer tails (and the wait when idle).")
    settle_s: float = Field(
        1.0, ge=0, description="Segments younger than this are left for the next tail (several writers).")
    checkpoint_every: int = Field(50, ge=1, description="Steps between saves of the trainer's own state.")
    num_threads: int = Field(
        1, ge=1, description="torch CPU threads of the trainer (the rest of the cores stay with the engine).")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps; null = run until stopped.")
    state_dir: Path | None = Field(
        None, description="Trainer state (resume); null = <serve.run_dir>/trainer.")
    ray_address: str | None = Field(
        None, description="null = start a local Ray; 'auto' or ray://host:port joins a cluster.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs the trainer actor reserves in Ray.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs the trainer actor reserves in Ray.")
    device: str = Field(
        "cpu", pattern=r"^(cpu|cuda)(:\d+)?$",
        description="torch device of the trainer; cuda needs num_gpus > 0.")
    max_restarts: int = Field(
        3, ge=-1,
        description="Ray restarts of a crashed trainer actor (-1 = always); it resumes from its state.")

    def resolved_state_dir(self, run_dir: Path) -> Path:
        """``state_dir``, or ``<run_dir>/trainer`` when unset."""
        return self.state_dir or run_dir / "trainer"

    @model_validator(mode="after")
    def _device_has_gpu(self) -> OnlineConfig:
        if self.device.startswith("cuda") and self.num_gpus <= 0:
            raise ValueError("device cuda needs num_gpus > 0 (Ray hides GPUs from an actor reserving none)")
        return self


class OnlineOPDConfig(_Strict):
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
