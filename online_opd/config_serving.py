"""Serving-side config sections: serve (the server, its admin surface, the speculation policy and the
live check), capture, gate, online (the online trainer beside the server) and cpu (vLLM's CPU runtime).

Re-exported by online_opd/config.py, which holds the root model and the loader; import them from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from online_opd.config_base import StrictModel
from online_opd.traces.storage import check_location, is_uri

__all__ = ["CaptureConfig", "ServeConfig", "GateConfig", "OnlineConfig", "CpuConfig"]


class CaptureConfig(StrictModel):
    """What the serving engine records into the trace buffer (vllm_patches/capture.py)."""

    enabled: bool = Field(True, description="Capture verification outcomes of served requests.")
    buffer_dir: Path | str = Field(
        Path("runs/serve/buffer"), description="Trace buffer: a folder, or s3://bucket/prefix on an S3-compatible "
                                               "store (endpoint and credentials from the AWS_* variables).")
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
    retention_interval_s: float = Field(
        30.0, ge=0, description="Least seconds between two retention passes of a writer (each lists the "
                                "whole buffer; 0 = after every segment). The bounds may be exceeded by "
                                "this much traffic.")
    teacher_top_k: int = Field(
        0, ge=0, le=1024, description="The verifier as teacher: per verified block, the target's top-k "
                                      "log-probabilities at each drafted position and the bonus position, "
                                      "taken from vLLM's own verification logits; replay then runs no target "
                                      "forward over the drafted positions. A step without a block keeps its "
                                      "one row too (SequenceRecord.path_teacher), from which LK and "
                                      "target-rollout KL replay simulated blocks. 0 = off.")
    teacher_sample_rate: float = Field(
        1.0, ge=0, le=1, description="Share of the captured requests whose blocks carry the teacher signal "
                                     "(decided per request; costs a top-k over their verified rows and plain-step "
                                     "rows).")
    hidden_sample_rate: float = Field(
        0.0, ge=0, le=1, description="Share of the teacher-carrying requests whose record also keeps the "
                                     "target's aux hidden states the DFlash drafter reads (the serving "
                                     "dtype, layers x hidden size values per token: 5.8 kB per token for "
                                     "SmolLM2-135M in bfloat16); replay then runs no target forward for "
                                     "them. Needs teacher_top_k > 0. 0 = off.")

    @model_validator(mode="after")
    def _hidden_needs_the_teacher(self):
        if self.hidden_sample_rate > 0 and self.teacher_top_k == 0:
            raise ValueError("capture.hidden_sample_rate > 0 needs capture.teacher_top_k > 0 (the features "
                             "spare replay's target forward only where the blocks carry the teacher too)")
        return self

    @field_validator("buffer_dir", mode="before")
    @classmethod
    def _folder_or_uri(cls, value: object) -> object:
        """A folder stays a Path; an s3:// URI stays a string (a Path would fold its '//')."""
        return check_location(value) if isinstance(value, (str, Path)) else value


class NgramFallbackConfig(StrictModel):
    """`serve.ngram_fallback`: prompt lookup replaces the drafter's block where it pays (speculation/hybrid.py)."""

    enabled: bool = Field(
        False, description="Where a request's context has a full-length prompt-lookup match (vLLM's ngram method), "
                           "draft it instead of the drafter's block when that request's (else all requests') "
                           "ngram blocks were accepted at least as well as the drafter's. Needs speculation "
                           "(auto or always) and synchronous scheduling (vLLM's CPU backend); output unchanged.")
    prompt_lookup_min: int = Field(2, ge=1, description="Shortest context suffix matched (vLLM prompt_lookup_min).")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest context suffix matched (vLLM prompt_lookup_max).")
    explore_every: int = Field(
        16, ge=1, description="A request whose matches lose to the drafter still takes every N-th one, so both "
                              "stay measured.")

    @model_validator(mode="after")
    def _lookup_range(self) -> "NgramFallbackConfig":
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({self.prompt_lookup_min})")
        return self


class DraftTrimConfig(StrictModel):
    """`serve.draft_trim`: each request verifies only the drafted tokens its drafter is confident enough
    in to pay at the step's batch size (speculation/trim.py)."""

    enabled: bool = Field(
        False, description="Cut each request's drafted block to the leading tokens whose calibrated "
                           "probability of all being accepted exceeds the batch size's threshold (the "
                           "marginal cost of a verified token, from the measured step costs). Needs "
                           "speculation auto (its policy sets the thresholds) or a fixed threshold, and "
                           "synchronous scheduling (vLLM's CPU backend); DFlash drafters; output unchanged.")
    threshold: float | None = Field(
        None, ge=0, le=1, description="One fixed threshold at every batch size instead of the policy's "
                                      "(also with speculation always); null = from the step costs.")
    prior: float = Field(
        4.0, gt=0, description="Pseudo-blocks at the bin's own confidence that each (position, confidence "
                               "bin) of the online calibration starts from.")
    outlook_blocks: int = Field(
        1024, ge=16, description="Recent untrimmed blocks whose confidences predict what trimming at any "
                                 "threshold drafts and accepts (the policy's estimate).")


class ServeConfig(StrictModel):
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
                              "acceptance is used (else the manifest's: a live check's or the gate's "
                              "tau, else the served acceptance `online-opd eval --record` measured; "
                              "else assumed not to pay).")
    policy_explore_share: float = Field(
        0.01, ge=0, le=0.5, description="speculation auto: share of engine steps run at K > 0 whatever the "
                                        "schedule, so the cost and acceptance of speculating stay measured.")
    policy_explore_share_unmeasured: float = Field(
        0.01, ge=0, le=0.5, description="speculation auto: the exploration share while the serving drafter "
                                        "version's acceptance is not measured live yet (a fresh server, "
                                        "after each reload); the higher of this and policy_explore_share. "
                                        "0.05 with the ngram fallback learns sooner that speculating pays, at "
                                        "a cost while nothing does (README figures).")
    policy_explore_steps: int = Field(
        3, ge=2, description="speculation auto: steps per exploration burst (the first drafts only, the "
                             "others verify and are timed).")
    policy_remember_costs: bool = Field(
        True, description="speculation auto: keep the measured step costs across restarts, per setup (machine, "
                          "vLLM, target, dtype, drafter shape, engine, CPU, capture and speculation "
                          "settings): a server starts from the table an earlier one measured on the same "
                          "setup instead of the conservative schedule (K = 0 above batch size 1 until "
                          "exploration has timed speculative steps there).")
    policy_costs_file: Path | None = Field(
        None, description="speculation auto: the stored step costs (JSON, one table per setup, at most 8); "
                          "null = <run_dir>/step_costs.json.")
    policy_stored_cost_steps: int = Field(
        16, ge=0, description="speculation auto: live steps a stored (b, K) cost counts as, at most: live "
                              "steps take over (at 16 live steps they weigh half, at 300 95%).")
    ngram_fallback: NgramFallbackConfig = Field(default_factory=NgramFallbackConfig)
    draft_trim: DraftTrimConfig = Field(default_factory=DraftTrimConfig)
    run_dir: Path = Field(Path("runs/serve"), description="Server state: registry, trainer state, logs.")
    registry_dir: Path | None = Field(None, description="Drafter registry; null = <run_dir>/registry.")
    admin_token_env: str = Field(
        "ONLINE_OPD_ADMIN_TOKEN",
        description="Env var holding the admin bearer token; the admin routes are off when it is unset.")
    stats_poll_s: float = Field(
        5.0, gt=0, description="Seconds between polls of the engine's capture/reload figures for /metrics "
                               "while the engine works (and for stats_settle_s after).")
    stats_settle_s: float = Field(
        30.0, ge=0, description="Seconds after the engine's last work (tokens, running or waiting requests) "
                                "that polls stay stats_poll_s apart: the buffer writer's flushes and retries.")
    stats_idle_poll_s: float = Field(
        60.0, gt=0, description="Seconds between polls of an idle engine. Each poll makes vLLM's worker "
                                "busy-wait on its message queue for about a second, a whole core on CPU.")
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

    @property
    def costs_file(self) -> Path:
        return self.policy_costs_file or self.run_dir / "step_costs.json"

    @field_validator("run_dir", "registry_dir", "policy_costs_file", mode="before")
    @classmethod
    def _posix_folder(cls, value: object) -> object:
        if isinstance(value, str) and is_uri(value):
            raise ValueError("must be a local or shared POSIX folder (NFS, Lustre, ...) mounted on every replica, "
                             "not a URI: the drafter registry's publish and rollback need compare-and-swap on "
                             "its CURRENT pointer (flock + atomic rename), which object stores reached through "
                             "pyarrow.fs cannot do (no conditional PUT)")
        return value


class GateConfig(StrictModel):
    """Promotion gate: a candidate drafter replaces the serving one only when its simulated
    acceptance on held-out traffic is higher with confidence (online_opd/release/gate.py)."""

    every_steps: int = Field(50, ge=1, description="Trainer steps between gate evaluations of the candidate.")
    min_records: int = Field(
        8, ge=2, description="Distinct held-out prompts (records sharing a held-out key count once: they are "
                             "one sample) needed for a decision; fewer = not promoted.")
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
    max_records: int = Field(64, ge=1, description="Most recent held-out records evaluated, at most (the online "
                                                   "trainer keeps the newest record of each held-out prompt).")
    captured_features: bool = Field(
        True, description="Give both drafters the target features a record carries (capture.hidden_sample_rate) "
                          "instead of a target forward over its context: the features the served drafter saw. "
                          "false: always recompute them.")
    max_time_share: float = Field(
        1.0, gt=0, le=1,
        description="Most share of the online trainer's working seconds (its steps plus its gates) the gate "
                    "may take: a gate falling due every `every_steps` steps waits, the trainer stepping on, "
                    "until its seconds so far are at most this share of the two together. The gate runs in "
                    "the trainer's thread, and at T > 0 (a target forward per held-out record) or with a large "
                    "target it can take most of that time. 1 = gate whenever due.")
    captured_teacher: bool = Field(
        True, description="Verify a T > 0 record's blocks on its captured top-k rows (capture.teacher_top_k: "
                          "the served target's own verification, the tail spread uniformly) when they hold "
                          "every row both drafters' blocks need; then no target forward. Otherwise, and "
                          "false: the packed target forward, for all the record's blocks (one source per "
                          "record). T = 0 records need neither (read off the tokens).")

    @model_validator(mode="after")
    def _can_pass(self) -> GateConfig:
        if self.max_records < self.min_records:
            raise ValueError(f"max_records={self.max_records} < min_records={self.min_records}: "
                             "no evaluation could pass")
        return self


class OnlineConfig(StrictModel):
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
                    "(online_opd/opd/rollout.py simulated_record; one more target forward, none for a record "
                    "with captured features). 0 = never: "
                    "such records train on their logged blocks only; 1 = whenever a decode step did not "
                    "speculate.")
    ema_decay: float = Field(
        0.995, ge=0, lt=1,
        description="The gate scores, and the registry publishes, an exponential moving average of the trained "
                    "weights (online_opd/train/ema.py), training going on from the weights themselves: after n "
                    "steps since the trainer started from a version the average keeps min(ema_decay, "
                    "(1 + n) / (10 + n)) of itself at each step. 0 = the trained weights themselves.")
    poll_s: float = Field(2.0, gt=0, description="Seconds between buffer tails (and the wait when idle).")
    settle_s: float = Field(
        1.0, ge=0, description="Segments younger than this are left for the next tail (several writers).")
    checkpoint_every: int = Field(50, ge=1, description="Steps between saves of the trainer's own state.")
    num_threads: int = Field(
        1, ge=1, description="torch CPU threads of the trainer (the rest of the cores stay with the engine).")
    cpu_priority: Literal["idle", "normal"] = Field(
        "idle",
        description="Scheduling class of the trainer's process and the local Ray it starts (Linux): idle = "
                    "SCHED_IDLE, they run only on CPU time the engine and the API server leave unused and "
                    "never preempt them (under full load the trainer may barely step); normal = they compete "
                    "with the engine like any process. A trainer on a cluster (online.ray_address) is "
                    "scheduled by its own node.")
    duty_cycle: float = Field(
        1.0, ge=0, le=1,
        description="Share of its wall time the trainer computes while the engines serve: after each step (and "
                    "gate) that took t seconds it rests t*(1-d)/d. 1 = back to back (a trainer on devices of its "
                    "own); below 1 where it shares the engine's cores: the lower d, the less it slows serving "
                    "(README, Known issues); 0 = no training while they serve, only while they are idle.")
    idle_duty_cycle: float = Field(
        1.0, gt=0, le=1,
        description="The duty cycle once every engine the trainer serves has been idle (no request running or "
                    "waiting, no token generated) for idle_after_s, as the trainer process reads it from its "
                    "server's /metrics: a server that shares its cores with the trainer lends them while it "
                    "has no traffic. A rest is cut short when the engines turn idle; unknown load (no scrape "
                    "yet, a failed one, a trainer with no server) counts as serving.")
    idle_after_s: float = Field(
        10.0, ge=0,
        description="Seconds of no load before the engines count as idle (idle_duty_cycle): longer than the "
                    "gaps between requests of a steady client, so that those do not start a step.")
    hibernate_after_s: float | None = Field(
        None, ge=0,
        description="With duty_cycle 0 and a local Ray: the trainer process starts Ray and the trainer actor "
                    "only once the engines have been idle for idle_after_s, and stops them (state saved) once "
                    "the engines have served for this many seconds, so that under traffic nothing of the "
                    "trainer runs but its process's load reads; null = Ray and the actor run throughout. "
                    "Ignored (they run throughout) with duty_cycle > 0 or a Ray cluster (ray_address).")
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


class CpuConfig(StrictModel):
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
