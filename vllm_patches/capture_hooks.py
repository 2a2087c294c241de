"""Where the capture enters vLLM: patches of the V1 model runner (the CPU runner subclasses it) and of the
worker's shutdown, installed once per engine process from the environment (vllm_patches/__init__.py). What
the hooks record, and when they read it: capture.py.

The model runner's ``_update_states``, ``_sample`` and ``sample_tokens`` are wrapped; each wrapper calls the
process's ``Capture`` and then vLLM's own method, and never raises into vLLM (errors are logged once and
counted). Only one rank captures: tensor-parallel rank 0 of the last pipeline stage.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_patches import capture_features
from vllm_patches.capture import Capture, CaptureSettings

logger = logging.getLogger("online_opd.capture")

_CAPTURE: Capture | None = None


def current() -> Capture | None:
    return _CAPTURE


def _is_capturing_rank() -> bool:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank
    except Exception:  # parallel state not initialised (single process): capture
        return True


def install(settings: CaptureSettings) -> Capture:
    """Patch the V1 model runner (the CPU runner subclasses it) once per process."""
    global _CAPTURE
    if _CAPTURE is not None:
        return _CAPTURE
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cap = _CAPTURE = Capture(settings)
    orig_update, orig_sample, orig_sample_tokens = (
        GPUModelRunner._update_states, GPUModelRunner._sample, GPUModelRunner.sample_tokens)

    def _enabled(runner: Any) -> bool:
        enabled = getattr(runner, "_online_opd_capture", None)
        if enabled is None:
            enabled = runner._online_opd_capture = _is_capturing_rank()  # with or without speculation
        return enabled

    def _update_states(self, scheduler_output, *args, **kwargs):
        if _enabled(self):
            try:
                cap.on_schedule(scheduler_output)
            except Exception as exc:
                cap.error("_update_states", exc)
        return orig_update(self, scheduler_output, *args, **kwargs)

    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        if spec_decode_metadata is not None and _enabled(self):  # before: the sampler may change logits
            try:
                self._online_opd_step = cap.snapshot_step(
                    self.input_batch, spec_decode_metadata, logits if cap.settings.teacher_top_k > 0 else None)
            except Exception as exc:
                cap.error("_sample", exc)
        return orig_sample(self, logits, spec_decode_metadata, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        self._online_opd_step = None
        out = orig_sample_tokens(self, *args, **kwargs)
        if not _enabled(self):
            return out
        step, self._online_opd_step = self._online_opd_step, None
        try:
            if hasattr(out, "get_output"):  # async scheduling: read the step when vLLM does
                vllm_get_output = out.get_output

                def get_output():
                    result = vllm_get_output()
                    try:
                        cap.on_output(step, result.req_ids, result.sampled_token_ids)
                    except Exception as exc:
                        cap.error("get_output", exc)
                    return result

                out.get_output = get_output
            elif isinstance(out, ModelRunnerOutput) and out.req_ids:
                cap.on_output(step, out.req_ids, out.sampled_token_ids)
        except Exception as exc:
            cap.error("sample_tokens", exc)
        return out

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._sample = _sample
    GPUModelRunner.sample_tokens = sample_tokens
    _close_on_worker_shutdown(cap)
    if settings.hidden_sample_rate > 0:
        capture_features.install(cap, _enabled)
    logger.info("online-opd capture installed: buffer %s, sample rate %.3g",
                settings.buffer_dir, settings.sample_rate)
    return cap


SHUTDOWN_CLOSE_S = 5.0  # most seconds a stopping worker waits for its writer to write the records it holds


def _close_on_worker_shutdown(cap: Capture) -> None:
    """Write the held records when the worker process stops. A SIGTERM to the server's process group
    reaches the workers directly: vLLM's worker loop exits and calls ``WorkerWrapperBase.shutdown``, then
    the process ends with ``os._exit`` (multiprocessing), which runs no atexit hook and kills the writer
    thread with up to ``flush_interval_s`` of records. (A SIGTERM to the API server alone: vLLM kills
    the engine core and the workers outright, so the API server asks them to write first, endpoint.py
    ``_flush_before_shutdown``.)"""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    orig_shutdown = WorkerWrapperBase.shutdown

    def shutdown(self) -> None:
        try:
            cap.close(SHUTDOWN_CLOSE_S)
        except Exception as exc:
            cap.error("shutdown", exc)
        return orig_shutdown(self)

    WorkerWrapperBase.shutdown = shutdown


def install_from_env() -> Capture | None:
    from vllm_patches import CAPTURE_ENV, settings_from_env

    settings = settings_from_env(CAPTURE_ENV, CaptureSettings, "capture")
    return None if settings is None else install(settings)
