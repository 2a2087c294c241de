"""Which vLLM model runner the hooks need, and the refusal when vLLM would use another.

Capture (``capture.py``) patches the V1 model runner's ``_update_states``, ``_sample`` and
``sample_tokens``; hot reload (``worker_ext.py``) reads ``model_runner.drafter``. vLLM 0.32's
Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``, ``vllm/v1/worker/cpu/model_runner.py``)
has neither: under it nothing would be captured, without an error, and the reload RPC would raise
AttributeError. vLLM picks V2 by default wherever Triton is present and the features allow it
(``VllmConfig.use_v2_model_runner``), that is on most GPU installs; on this CPU it falls back to V1
because Triton has no CPU backend.

So ``online-opd serve`` runs vLLM with ``VLLM_USE_V2_MODEL_RUNNER=0`` (``v1_runner_env``) and
refuses, before vLLM starts, a user's ``VLLM_USE_V2_MODEL_RUNNER=1``. Some vLLM features force V2
whatever the variable says (watermarking, HiSparse attention); ``check_v1_runner`` runs on the
final engine config in the API server and stops the server with the same explanation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"

_WHY = ("online-opd's capture and drafter hot reload hook vLLM's V1 model runner; Model Runner V2 "
        "is not supported yet (nothing would be captured and reloads would fail)")


class ModelRunnerV2Unsupported(RuntimeError):
    """vLLM would run Model Runner V2, which the online-opd hooks do not support."""


def v1_runner_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment entry that makes vLLM use the V1 model runner.

    Unset or empty: ``{V2_ENV: "0"}``. Already off ("0"): kept. On (any other integer, as vLLM's
    ``maybe_convert_bool`` reads it) or not an integer: ModelRunnerV2Unsupported, naming the fix.
    """
    raw = environ.get(V2_ENV)
    if raw is None or not raw.strip():
        return {V2_ENV: "0"}
    try:
        on = bool(int(raw))
    except ValueError:
        raise ModelRunnerV2Unsupported(
            f"{V2_ENV}={raw!r} is not an integer (vLLM reads it with int()); unset it or set it to 0: "
            f"{_WHY}") from None
    if on:
        raise ModelRunnerV2Unsupported(
            f"{V2_ENV}={raw} asks vLLM for Model Runner V2, but {_WHY}. Unset {V2_ENV} or set it to 0 "
            "(online-opd serve does so by default), or serve with plain `vllm serve` without online-opd.")
    return {V2_ENV: raw.strip()}


def check_v1_runner(vllm_config: Any) -> None:
    """Raise ModelRunnerV2Unsupported when the engine's final config runs Model Runner V2
    (e.g. forced by watermarking or HiSparse attention despite ``VLLM_USE_V2_MODEL_RUNNER=0``)."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise ModelRunnerV2Unsupported(
            f"vLLM chose Model Runner V2 for this engine ({V2_ENV}={os.environ.get(V2_ENV, 'unset')}); "
            f"{_WHY}. Features that force V2 "
            "(watermarking, HiSparse attention) cannot be combined with online-opd serve yet.")
