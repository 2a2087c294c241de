"""Training-side config sections: trainer (objective, optimiser, loop), bootstrap (the offline SFT
warm-up) and eval (acceptance and throughput measurement).

Re-exported by online_opd/config.py, which holds the root model and the loader; import them from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from online_opd.config_base import PromptSource, StrictModel

__all__ = ["TrainerConfig", "AutoObjectiveConfig", "BootstrapConfig", "EvalConfig"]


ReplayObjective = Literal["draft_opd", "all_forward", "all_reverse", "target_rollout", "lk"]


class AutoObjectiveConfig(StrictModel):
    """``trainer.objective: auto``: the objective chosen from the position-1 acceptance rate of the newest
    verified blocks, with hysteresis (online_opd/opd/objective_schedule.py)."""

    weak: ReplayObjective = Field(
        "lk", description="Objective while the drafter's blocks mostly fail at their first token (and at the "
                          "start): the LK loss, which beat target-rollout KL there (docs/draft_opd_vs_paper.md "
                          "section 7).")
    strong: ReplayObjective = Field(
        "draft_opd", description="Objective once the position-1 acceptance reaches up_at.")
    up_at: float = Field(0.6, gt=0, le=1, description="Position-1 acceptance rate at or above which the "
                                                      "schedule switches from weak to strong.")
    down_at: float = Field(0.5, ge=0, lt=1, description="Position-1 acceptance rate at or below which it "
                                                        "switches back to weak (below up_at: hysteresis).")
    window_blocks: int = Field(2048, ge=1, description="Newest verified blocks the rate is measured on.")
    min_blocks: int = Field(256, ge=1, description="Blocks needed in the window before any decision.")
    min_steps_between_switches: int = Field(
        50, ge=0, description="Optimizer steps after a switch before the next one may come.")
    trial_gates: int = Field(
        8, ge=0, description="Gates in a row on strong that promote nothing, with candidates below the serving "
                             "version (trial_confidence bound), after which the schedule goes back to weak and "
                             "the trainer restarts from the serving version (0: never).")
    retry_margin: float = Field(
        0.1, ge=0, le=1, description="After a failed trial of strong, up_at becomes the trial's position-1 "
                                     "acceptance plus this.")
    trial_confidence: float = Field(
        0.9, ge=0.5, lt=1, description="Confidence of the upper bound on the trial gates' mean tau difference "
                                       "(candidate - serving) that must be <= 0 to end a trial.")

    @model_validator(mode="after")
    def _consistent(self) -> AutoObjectiveConfig:
        if self.weak == self.strong:
            raise ValueError(f"trainer.auto.weak and strong must differ, both are {self.weak!r}")
        if self.down_at >= self.up_at:
            raise ValueError(f"trainer.auto.down_at ({self.down_at}) must be below up_at ({self.up_at})")
        if self.min_blocks > self.window_blocks:
            raise ValueError(f"trainer.auto.min_blocks ({self.min_blocks}) exceeds window_blocks "
                             f"({self.window_blocks})")
        return self


class TrainerConfig(StrictModel):
    """Distillation objective, optimiser and loop of the drafter trainer."""

    objective: Literal["sft", "draft_opd", "all_forward", "all_reverse", "target_rollout", "lk", "auto"] = Field(
        "auto", description="Training objective: auto (chosen from live acceptance between trainer.auto.weak "
                            "and strong: LK, then Draft-OPD), Draft-OPD, its ablations, the "
                            "LK loss -log acceptance rate on the verified trajectory (lk), or DFlash-style SFT.")
    auto: AutoObjectiveConfig = Field(
        default_factory=AutoObjectiveConfig, description="The objective schedule of objective: auto.")
    lr: float = Field(1e-3, gt=0, description="Peak AdamW learning rate (the online trainer's constant one after "
                                             "warm-up); 1e-3 beat 3e-4 for LK offline, and the online figures ran at it.")
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
    lk_temperature: float = Field(
        1.0, ge=0, description="Teacher temperature of objective lk: p = softmax(target logits / T); 0 = the "
                               "target's greedy token (T=0 verification's acceptance).")
    widen_share: float = Field(
        0.0, ge=0, le=1,
        description="Objectives that read positions k <= r + 1 only (lk, target_rollout): the share of the "
                    "replayed blocks replayed K wide at their anchor on the sequence's own tokens, acceptance "
                    "from the drafter's greedy drafts at the trained weights (a block served K' < K wide, as "
                    "the speculation policy drafts at some batch sizes, is widened; a K-wide one re-drafted); "
                    "0 = as served: a block served at K'=1 trains position 1 only, and every block the "
                    "positions the serving version's drafts reached.")
    loss_pooling: Literal["batch", "sequence"] = Field(
        "batch", description="How the objective averages a step's sequences: 'batch' pools every replayed "
                             "(block, position) of the step into I_acc / I_rej (paper eq. 10-11); 'sequence' "
                             "scores each sequence on its own and averages the sequences equally.")
    captured_teacher: bool = Field(
        True, description="Replay a block with the verifier's top-k log-probabilities where its record carries "
                           "them (capture.teacher_top_k): no target forward over its drafted positions, the "
                           "tail mass spread over the rest of the vocabulary; and the drafter's context from "
                           "the record's captured features (capture.hidden_sample_rate) in replay and in "
                           "simulated blocks. false: always recompute.")
    sft_position_decay: float = Field(
        7.0, gt=0, description="SFT cross-entropy weight exp(-(k-1)/decay) (DFlash).")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; null = torch's default.")
    checkpoint_every: int = Field(200, ge=1, description="Steps between checkpoints.")
    log_every: int = Field(10, ge=1, description="Steps between log lines.")
    output_dir: Path = Field(Path("runs/train"), description="Folder for checkpoints and logs.")
    device: str = Field(
        "cpu", pattern=r"^(cpu|cuda|mps|xpu)(:\d+)?$", description="torch device of the trainer.")
    seed: int = Field(0, description="Seed of anchor sampling and data order.")
    num_workers: int = Field(
        1, ge=1, description="Data-parallel training processes (serve/trainer_dp.py: Ray Train's TorchTrainer, "
                             "gloo on the CPU, NCCL with device cuda, one GPU each), each replaying its slice "
                             "of every step's sequences_per_step; the update is the one-process update. "
                             "Online too (serve/trainer_online_dp.py): the trainer actor's rank 0 decides, "
                             "the other workers hold replicas. 1 = train in this process, without Ray.")
    ray_address: str | None = Field(
        None, min_length=1,
        description="Ray cluster of the num_workers > 1 workers: host:port or 'auto' (`ray start --head` "
                    "plus `ray start --address` on each node); null = a local Ray on this machine.")
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources each data-parallel worker reserves on top of one CPU (and one GPU with "
                    "device cuda), e.g. {CPU: 4} or a custom node resource that places one worker per node.")

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

    @field_validator("worker_resources")
    @classmethod
    def _resources_non_negative(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if amount < 0:
                raise ValueError(f"worker_resources[{name!r}] = {amount} must be >= 0")
        return resources

    @model_validator(mode="after")
    def _workers_fit(self) -> TrainerConfig:
        if self.num_workers == 1:
            return self
        if self.sequences_per_step < self.num_workers:
            raise ValueError(f"num_workers={self.num_workers} needs sequences_per_step >= num_workers (each "
                             f"worker replays its slice of a step's sequences), got {self.sequences_per_step}; "
                             "raise sequences_per_step or lower num_workers")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"num_workers={self.num_workers} runs on device 'cpu' or 'cuda' (Ray Train gives "
                             f"each worker its GPU), got {self.device!r}")
        return self


class BootstrapConfig(TrainerConfig):
    """The trainer's fields with the SFT warm-up's defaults: a partly written ``bootstrap`` section
    keeps them (a plain TrainerConfig would fall back to Draft-OPD into runs/train)."""

    objective: Literal["sft", "draft_opd", "all_forward", "all_reverse", "target_rollout", "lk"] = Field(
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
    feature_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the target forward that computes the warm-up's features and text "
                            "labels (stored in bfloat16 either way; the drafter trains in float32). auto = "
                            "bfloat16 where model.dtype serves in bfloat16 (the features vLLM serves "
                            "with; 2.9x the tokens/s of float32 on this CPU's AMX), else float32.")
    text_max_tokens: int = Field(
        256, ge=1, description="Reply tokens kept per text conversation (the chat-templated human turn "
                               "comes on top; longer than model.max_model_len in all are skipped).")
    time_budget_s: float | None = Field(
        None, gt=0, description="Wall seconds for the whole bootstrap, sized to the machine it runs on "
                                "(online_opd/train/budget.py): rollouts in full, the text feature pass up to "
                                "text_feature_share of it, then as many SFT steps as a measured step time "
                                "fits (at most num_steps), stopped at its end in any case; null = no budget.")
    text_feature_share: float = Field(
        0.4, gt=0, le=1, description="With time_budget_s: the text feature pass stops, between "
                                     "conversations, once this share of the budget has passed.")
    narrow_block_share: float = Field(
        0.0, ge=0, le=1, description="DFlash: the share of SFT blocks drafted narrower than block_size, "
                                     "at a width drawn uniformly from 1..block_size-1, as the speculation "
                                     "policy serves K' < K (a K'-block drafts from K' mask slots, not the "
                                     "first K' of K); 0 = every block at block_size.")
    overlap_features: bool = Field(
        False, description="Compute the text features in a second process beside the SFT (half the "
                           "threads each; serve/feature_stream.py): the SFT starts once the rollouts' "
                           "features are done and its pool grows while it trains; the feature pass then "
                           "runs until the budget's end (text_feature_share does not apply). Single-process "
                           "bootstraps on 2+ threads only (num_workers > 1 computes the text first).")

    @model_validator(mode="after")
    def _has_training_data(self) -> BootstrapConfig:
        if not self.rollouts and self.text_conversations == 0:
            raise ValueError("rollouts=false leaves no training data; set text_conversations > 0 "
                             "or rollouts=true")
        return self

    @model_validator(mode="after")
    def _workers_on_cpu(self) -> BootstrapConfig:
        if self.num_workers > 1 and self.device != "cpu":
            raise ValueError(f"num_workers={self.num_workers}: the bootstrap trains on the CPU (gloo workers), "
                             f"got device {self.device!r}; set bootstrap.device: cpu")
        return self


class EvalConfig(StrictModel):
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
