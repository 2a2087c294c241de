"""Prometheus series online-opd adds beside vLLM's ``vllm:spec_decode_*`` counters.

One scrape target: the server's ``/metrics``. Series are ``online_opd_*``, labels
stay low-cardinality (no request ids). Figures that live in the engine process
(capture counters, buffer size, drafter version) are polled from the worker
with ``collective_rpc`` and exposed by :class:`PolledCollector`; figures that
the server process owns (reloads, trainer, gate) are ordinary prometheus-client
metrics created by :func:`server_metrics`.

With several API servers (``--api-server-count N``, or data parallelism, which
defaults to one API server per rank) vLLM runs prometheus-client in
multiprocess mode: each API server is a process of its own, and every /metrics
answer is read from the metric files of all of them, never from a process's
collectors. There only API server 0 polls, and :class:`MultiprocessMirror`
copies its collectors' figures into multiprocess metrics (metrics_multiprocess.py,
called from endpoint.py). When the server polls the engine: engine_poll.py.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from online_opd.release.live_check import latest_windows
from online_opd.release.registry import version_number
from online_opd.traces.records import acceptance_length

PREFIX = "online_opd"

# counters polled from the capturing worker: stats key -> (series name, help)
CAPTURE_COUNTERS = {
    "captured": ("records_captured", "Sequence records handed to the buffer writer."),
    "dropped": ("records_dropped", "Records dropped because the writer fell behind or failed."),
    "opted_out": ("records_opted_out", "Requests that opted out of capture (vllm_xargs)."),
    "not_sampled": ("records_not_sampled", "Requests left out by the capture sample rate."),
    "blocks": ("blocks_captured", "Verified draft blocks in captured records."),
    "teacher_blocks": ("teacher_blocks_captured", "Captured blocks carrying the verifier's top-k log-probabilities "
                                                  "(capture.teacher_top_k)."),
    "path_teacher_rows": ("path_teacher_rows_captured", "Plain-step rows of the verifier's top-k log-probabilities "
                                                        "in captured records (SequenceRecord.path_teacher)."),
    "hidden_records": ("hidden_records_captured", "Captured records carrying the target's aux hidden states "
                                                  "(capture.hidden_sample_rate)."),
    "hidden_over_limit": ("hidden_records_over_limit", "Requests that stopped keeping the target's aux hidden "
                                                       "states at the per-request byte limit."),
    "errors": ("capture_errors", "Internal capture errors (counted, never raised into vLLM)."),
}


#: the ngram fallback's counters (ngram_fallback.py), summed over engines
NGRAM_FALLBACK_COUNTERS = ("drafter_blocks", "drafter_accepted", "ngram_blocks", "ngram_accepted", "ngram_proposed",
                           "matches", "errors")


def drafter_totals(totals: tuple[float, float], status: dict | None) -> tuple[float, float]:
    """vLLM's cumulative (drafts, accepted tokens) less the ngram fallback's blocks: what the drafter's
    own blocks were accepted, for live acceptance per drafter version. The worker counts a block when
    the step that verified it drafts; vLLM's counters move when the API server reads that step, a
    moment later: a window may hold a block or two of skew, never a negative count."""
    fallback = (status or {}).get("ngram_fallback") or {}
    drafts, accepted = totals
    return (max(drafts - float(fallback.get("ngram_blocks") or 0), 0.0),
            max(accepted - float(fallback.get("ngram_accepted") or 0), 0.0))


def version_gauge(version: str | None) -> float:
    """``v0012`` -> 12.0 for the version gauge; NaN for a name outside the registry's scheme."""
    number = version_number(version or "")
    return float("nan") if number is None else float(number)


class PolledCollector(Collector):
    """Exposes the latest engine status (``OnlineOPDWorkerExtension.online_opd_status``)."""

    def __init__(self, latest: Callable[[], dict | None]):
        self._latest = latest

    def collect(self):
        status = self._latest()
        if not status:
            return
        capture = status.get("capture") or {}
        for key, (name, doc) in CAPTURE_COUNTERS.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(capture.get(key, 0)))
            yield family
        writer = capture.get("writer") or {}
        for key, name, doc in [("buffer_bytes", "buffer_bytes", "Bytes of trace-buffer segments on disk."),
                               ("buffer_segments", "buffer_segments", "Trace-buffer segment files on disk."),
                               ("held", "buffer_held_records",
                                "Records held in memory while buffer writes fail (written once one succeeds).")]:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(writer.get(key, 0)))
            yield family
        errors = CounterMetricFamily(f"{PREFIX}_buffer_write_errors",
                                     "Failed segment writes (read-only or full disk, ...): held and retried.")
        errors.add_metric([], float(writer.get("write_errors", 0)))
        yield errors
        version = status.get("version")
        family = GaugeMetricFamily(f"{PREFIX}_drafter_version",
                                   "Drafter version the engine serves (number in its name).")
        family.add_metric([], version_gauge(version))
        yield family
        info = GaugeMetricFamily(f"{PREFIX}_drafter_info", "Drafter version serving (label).",
                                 labels=["version"])
        info.add_metric([str(version)], 1.0)
        yield info
        fallback = status.get("ngram_fallback")
        if fallback:
            yield from _ngram_fallback_families(fallback)
        trim = status.get("draft_trim")
        if trim:
            yield from _draft_trim_families(trim)


def _ngram_fallback_families(fallback: dict):
    """``online_opd_ngram_fallback_*``: verified blocks and accepted tokens per proposer, matches."""
    for what, name, doc in [("blocks", "blocks", "Verified blocks with the ngram fallback on, by proposer."),
                            ("accepted", "accepted_tokens", "Accepted draft tokens of those blocks, by proposer.")]:
        family = CounterMetricFamily(f"{PREFIX}_ngram_fallback_{name}", doc, labels=["proposer"])
        for proposer in ("drafter", "ngram"):
            family.add_metric([proposer], float(fallback.get(f"{proposer}_{what}") or 0))
        yield family
    for key, doc in [("matches", "Drafted requests whose context had a full-length prompt-lookup match."),
                     ("errors", "Internal ngram fallback errors (the drafter's block kept; never raised).")]:
        family = CounterMetricFamily(f"{PREFIX}_ngram_fallback_{key}", doc)
        family.add_metric([], float(fallback.get(key) or 0))
        yield family


def _draft_trim_families(trim: dict):
    """``online_opd_draft_trim_*``: drafted blocks and tokens, what trimming kept, what was verified."""
    blocks = CounterMetricFamily(f"{PREFIX}_draft_trim_blocks", "Drafter blocks with draft trimming on: "
                                 "drafted, trimmed (cut shorter), verified (taught the calibration).",
                                 labels=["kind"])
    for kind, key in (("drafted", "blocks"), ("trimmed", "trimmed_blocks"), ("verified", "verified_blocks")):
        blocks.add_metric([kind], float(trim.get(key) or 0))
    yield blocks
    tokens = CounterMetricFamily(f"{PREFIX}_draft_trim_tokens", "Draft tokens: drafted, kept for "
                                 "verification, accepted (of the verified blocks).", labels=["kind"])
    for kind, key in (("drafted", "drafted_tokens"), ("kept", "kept_tokens"), ("accepted", "accepted_tokens")):
        tokens.add_metric([kind], float(trim.get(key) or 0))
    yield tokens
    errors = CounterMetricFamily(f"{PREFIX}_draft_trim_errors",
                                 "Internal draft trimming errors (the untrimmed drafts kept; never raised).")
    errors.add_metric([], float(trim.get("errors") or 0))
    yield errors
    thresholds = trim.get("thresholds") or []
    if len(thresholds) > 1:
        gauge = GaugeMetricFamily(f"{PREFIX}_draft_trim_threshold", "Trimming threshold r_b by batch size "
                                  "(the last one holds above).", labels=["batch_size"])
        for b, r in enumerate(thresholds[1:], start=1):
            gauge.add_metric([str(b)], float(r))
        yield gauge


class TrainerCollector(Collector):
    """Exposes the online trainer's latest stats (serve/trainer_process.py): ``None`` or
    ``{"up": False, ...}`` while it cannot answer; ``restarts`` (``{"actor": n, "ray": m}``) either way."""

    def __init__(self, latest: Callable[[], dict | None]):
        self._latest = latest

    def collect(self):
        stats = self._latest() or {}
        is_up = bool(stats) and stats.get("up", True)
        up = GaugeMetricFamily(f"{PREFIX}_trainer_up", "1 while the online trainer answers, else 0.")
        up.add_metric([], 1.0 if is_up else 0.0)
        yield up
        if stats.get("restarts") is not None:
            restarts = CounterMetricFamily(
                f"{PREFIX}_trainer_restarts", "Trainer restarts: of the actor by Ray (actor), of Ray and "
                "the trainer process after they died (ray).", labels=["level"])
            for level in ("actor", "ray"):
                restarts.add_metric([level], float(stats["restarts"].get(level, 0)))
            yield restarts
        if not is_up:
            return
        for key, name, doc in [
            ("steps", "trainer_steps", "Online trainer optimizer steps."),
            ("replayed_tokens", "trainer_replayed_tokens", "Tokens replayed (sequence + drafted blocks)."),
            ("trained_tokens", "trainer_trained_tokens",
             "Served tokens the trainer's steps learnt from: r + 1 per replayed block (twice if replayed "
             "twice). Against vllm:generation_tokens_total: whether the trainer keeps up with the traffic."),
            ("train_seconds", "trainer_step_seconds", "Seconds spent in optimizer steps (replay + update)."),
            ("gate_seconds", "trainer_gate_seconds",
             "Seconds the trainer spent in gate evaluations (gate.max_time_share bounds their share)."),
            ("gates_deferred", "gate_deferrals",
             "Gates due every gate.every_steps steps that waited, the trainer stepping on, to keep the gate "
             "within gate.max_time_share of the trainer's working seconds."),
            ("rest_seconds", "trainer_rest_seconds",
             "Seconds the trainer rested to keep to its duty cycle (online.duty_cycle, idle_duty_cycle)."),
            ("records_seen", "trainer_records_seen", "Buffer records read by the trainer."),
            ("records_invalid", "trainer_records_invalid", "Records failing capture fidelity (skipped)."),
            ("records_simulated", "trainer_records_simulated",
             "Replays on blocks the current drafter simulated (records served mostly without speculation)."),
            ("blocks_widened", "trainer_blocks_widened",
             "Replayed blocks replayed K wide on the sequence's tokens with the trained weights' greedy "
             "acceptance (trainer.widen_share)."),
            ("errors", "trainer_errors", "Failed trainer steps or gates (logged, training continues)."),
            ("gates", "gate_runs", "Gate evaluations of a candidate drafter."),
            ("promotions", "gate_promotions", "Candidates promoted by the gate."),
            ("rejections", "gate_rejections", "Candidates rejected by the gate."),
        ]:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(stats.get(key) or 0))
            yield family
        loss = GaugeMetricFamily(f"{PREFIX}_trainer_loss", "Last step's loss (total, accepted, rejected).",
                                 labels=["part"])
        for part, key in [("total", "loss"), ("accepted", "loss_accepted"), ("rejected", "loss_rejected")]:
            if stats.get(key) is not None:
                loss.add_metric([part], float(stats[key]))
        yield loss
        for key, name, doc in [("train_pool", "trainer_train_records", "Records in the training window."),
                               ("fresh_records", "trainer_fresh_records",
                                "Records of the window no step has replayed yet: a backlog that grows while "
                                "the trainer does not keep up."),
                               ("held_out_pool", "trainer_held_out_records", "Held-out records for the gate."),
                               ("engines_idle", "trainer_engines_idle",
                                "1 while the trainer sees every engine it serves idle (online.idle_duty_cycle).")]:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(stats.get(key) or 0))
            yield family
        if stats.get("objective"):
            objective = GaugeMetricFamily(
                f"{PREFIX}_trainer_objective", "1 for the objective the online trainer's next step uses "
                "(trainer.objective, or auto's choice).", labels=["objective"])
            objective.add_metric([str(stats["objective"])], 1.0)
            yield objective
        if stats.get("first_position_acceptance") is not None:
            a1 = GaugeMetricFamily(
                f"{PREFIX}_trainer_first_position_acceptance", "Position-1 acceptance rate of the newest "
                "verified blocks the trainer read (objective: auto decides on it).")
            a1.add_metric([], float(stats["first_position_acceptance"]))
            yield a1
        switches = CounterMetricFamily(f"{PREFIX}_trainer_objective_switches",
                                       "Objective changes made by objective: auto.")
        switches.add_metric([], float(stats.get("objective_switches") or 0))
        yield switches
        gate = stats.get("last_gate") or {}
        if gate:
            tau = GaugeMetricFamily(f"{PREFIX}_gate_tau", "Last gate's simulated tau on held-out records.",
                                    labels=["drafter"])
            for who in ("candidate", "serving"):
                if gate.get(f"tau_{who}") is not None:
                    tau.add_metric([who], float(gate[f"tau_{who}"]))
            yield tau
            if gate.get("record_diff_lower") is not None:
                lower = GaugeMetricFamily(f"{PREFIX}_gate_lower_bound",
                                          "Last gate's lower confidence bound of the tau gain.")
                lower.add_metric([], float(gate["record_diff_lower"]))
                yield lower


class ServedAcceptance:
    """Live acceptance per drafter version, from vLLM's own spec-decode counters.

    ``update`` attributes counter increments to the version serving at the time,
    one ``(drafts, accepted)`` window per poll; ``recent`` gives a version's
    newest windows (the live check's baseline), ``since`` those since a reload.
    """

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None
        self.windows: dict[str, list[tuple[float, float]]] = {}

    def update(self, version: str | None, drafts_total: float, accepted_total: float) -> None:
        last, self._last = self._last, (drafts_total, accepted_total)
        if last is None or version is None:
            return
        d, a = drafts_total - last[0], accepted_total - last[1]
        if d > 0:
            self.windows.setdefault(version, []).append((d, a))

    def totals(self, version: str) -> tuple[float, float]:
        pairs = self.windows.get(version, [])
        return sum(d for d, _ in pairs), sum(a for _, a in pairs)

    def recent(self, version: str, min_drafts: int, min_windows: int) -> list[tuple[float, float]]:
        """A version's newest windows holding ``min_drafts`` drafts in ``min_windows`` (a baseline)."""
        return latest_windows(self.windows.get(version, []), min_drafts, min_windows)

    def mark(self, version: str) -> int:
        """Position in a version's window list (to measure "since" a reload)."""
        return len(self.windows.get(version, []))

    def since(self, version: str, start: int) -> list[tuple[float, float]]:
        """A version's windows from position ``start`` (a ``mark``) on."""
        return list(self.windows.get(version, [])[start:])

    def collect_family(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_served_acceptance_length",
                                   "Live tau (1 + accepted/drafts) while each drafter version served.",
                                   labels=["version"])
        for version in self.windows:
            drafts, accepted = self.totals(version)
            tau = acceptance_length(accepted, drafts)
            if tau is not None:
                family.add_metric([version], tau)
        return family


def server_metrics(registry: CollectorRegistry) -> dict[str, Any]:
    """Metrics owned by the server process (reloads, rollbacks, gate, trainer)."""
    return {
        "reloads": Counter(f"{PREFIX}_reloads", "Drafter hot reloads by result (ok, refused, failed).",
                           ["result"], registry=registry),
        "reload_seconds": Histogram(
            f"{PREFIX}_reload_duration_seconds", "Time the engine spent inside a drafter reload call.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry),
        "rollbacks": Counter(f"{PREFIX}_rollbacks", "Drafter versions rolled back after a live check.",
                             registry=registry),
        "poll_errors": Counter(f"{PREFIX}_status_poll_errors", "Failed polls of the engine's status.",
                               registry=registry),
        "registry_errors": Counter(f"{PREFIX}_registry_errors",
                                   "Reloader polls that found the registry's CURRENT unreadable or unservable.",
                                   registry=registry),
        "registry_repairs": Counter(f"{PREFIX}_registry_repairs",
                                    "CURRENT moved to the newest good version by the reloader's check().",
                                    registry=registry),
    }


def batch_size_bucket(batch_size: int) -> str:
    """Powers of two, for a low-cardinality label: 1, 2-3, 4-7, 8-15, ..."""
    low = 1 << (max(batch_size, 1).bit_length() - 1)
    return "1" if low == 1 else f"{low}-{2 * low - 1}"


class SpeculationCollector(Collector):
    """The speculation policy's figures (vllm_patches/speculation_loop.py), from its latest update.

    PromQL: ``online_opd_spec_k`` is the K per batch-size range serving now;
    ``online_opd_policy_measured_tokens_per_second / online_opd_policy_predicted_tokens_per_second``
    is near 1 when the cost model holds; ``rate(online_opd_spec_steps_total{kind="explored"}[5m]) /
    rate(online_opd_spec_steps_total{kind="all"}[5m])`` is the recent exploration share.
    """

    def __init__(self, latest: Callable[[], dict | None]):
        self._latest = latest

    def collect(self):
        state = self._latest()
        if not state:
            return
        k = GaugeMetricFamily(f"{PREFIX}_spec_k", "Speculative tokens per step by batch-size range "
                              "(the policy's schedule).", labels=["batch_size_range"])
        for first, last, num in state["schedule"]:
            k.add_metric([f"{first}-{last}"], float(num))
        yield k
        yield self._step_seconds(state["costs"])
        steps = CounterMetricFamily(f"{PREFIX}_spec_steps", "Engine steps seen by the speculation control: "
                                    "all, explored (K set by exploration), timed (steady decode).",
                                    labels=["kind"])
        for kind, key in (("all", "steps"), ("explored", "explored_steps"), ("timed", "timed_steps")):
            steps.add_metric([kind], float(state.get(key) or 0))
        yield steps
        untimed = CounterMetricFamily(f"{PREFIX}_spec_untimed_seconds", "Seconds of engine steps the cost "
                                      "table does not time (prefill, mixed, K changes), by whether they drafted: "
                                      "the policy's predictions do not cover them.", labels=["kind"])
        for kind, (_, seconds, _) in (state.get("untimed") or {}).items():
            untimed.add_metric([kind], float(seconds))
        yield untimed
        share = GaugeMetricFamily(f"{PREFIX}_spec_exploration_share", "Explored steps / all steps since start.")
        share.add_metric([], state["explored_steps"] / state["steps"] if state.get("steps") else 0.0)
        yield share
        for key, name, doc in [
            ("predicted_tokens_per_s", "policy_predicted_tokens_per_second",
             "Output tokens/s the cost model predicts for the last interval's steady steps."),
            ("measured_tokens_per_s", "policy_measured_tokens_per_second",
             "Output tokens/s measured over the last interval's steady steps.")]:
            if state.get(key) is not None:
                family = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
                family.add_metric([], float(state[key]))
                yield family
        accept = GaugeMetricFamily(f"{PREFIX}_policy_acceptance", "Acceptance a_k = P(at least k accepted) "
                                   "the policy used, by draft position.", labels=["position"])
        for position, a in enumerate(state["acceptance_used"], start=1):
            accept.add_metric([str(position)], float(a))
        yield accept
        changes = CounterMetricFamily(f"{PREFIX}_policy_changes", "Speculation schedule changes applied.")
        changes.add_metric([], float(state.get("num_changes") or 0))
        yield changes
        stored = state.get("stored_costs")
        if stored is not None:  # serve.policy_remember_costs (online_opd/speculation/cost_store.py)
            family = GaugeMetricFamily(f"{PREFIX}_policy_stored_cost_buckets", "(b, K) step-cost buckets "
                                       "this server started from, stored by an earlier server on the same "
                                       "setup (0: it started with an empty table).")
            family.add_metric([], float(stored.get("buckets") or 0))
            yield family

    @staticmethod
    def _step_seconds(rows: list[list[float]]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_spec_step_seconds", "Measured seconds per steady engine step "
                                   "by batch-size bucket and K (step-weighted mean).", labels=["batch_size", "k"])
        sums: dict[tuple[str, int], list[float]] = {}
        for b, k, seconds, num_steps, *_ in rows:
            acc = sums.setdefault((batch_size_bucket(int(b)), int(k)), [0.0, 0.0])
            acc[0] += seconds * num_steps
            acc[1] += num_steps
        for (bucket, k), (total, n) in sorted(sums.items()):
            if n:
                family.add_metric([bucket, str(k)], total / n)
        return family
