"""The capture opt-out flag: how its values read, and vLLM's own 400 error for a value that reads neither way.

A client opts a request out of capture with ``vllm_xargs={"online_opd_capture": false}``.
vLLM accepts any string, number or list there, so a typo (``"flase"``) or a
structure would otherwise be guessed at in the worker. ``install`` wraps
vLLM's request admission (``InputProcessor._validate_params``, in the API
server, before the engine sees the request) so such a request gets vLLM's
validation error (HTTP 400, ``parameter`` naming the field) and is never run,
let alone captured. ``read_capture_flag`` is the one reading of the values,
used there and by the worker's capture (capture.py ``opted_out``).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("online_opd.request_checks")

#: ``vllm_xargs`` key a client sets to false to keep its request out of the buffer.
OPT_OUT_KEY = "online_opd_capture"
_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off"})


def read_capture_flag(value: Any) -> bool | None:
    """True (capture) or False (opted out) for a yes/no value; None when it is neither.

    vLLM's ``vllm_xargs`` turn JSON booleans into 1 and 0, so numbers 1 and 0 count too.
    """
    if isinstance(value, str):
        word = value.strip().lower()
        return True if word in _YES else False if word in _NO else None
    if isinstance(value, (bool, int, float)) and value in (0, 1):
        return bool(value)
    return None


def check_capture_flag(sampling_params: Any) -> None:
    """vLLM's validation error when the request's opt-out flag reads neither yes nor no."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if OPT_OUT_KEY not in extra or read_capture_flag(extra[OPT_OUT_KEY]) is not None:
        return
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(
        f"vllm_xargs.{OPT_OUT_KEY} must be true or false (also 1/0, \"yes\"/\"no\", \"on\"/\"off\"), got "
        f"{extra[OPT_OUT_KEY]!r}; send false to keep this request out of online-opd's trace buffer",
        parameter=f"vllm_xargs.{OPT_OUT_KEY}", value=extra[OPT_OUT_KEY])


def install() -> None:
    """Wrap vLLM's request admission with ``check_capture_flag`` (once per process)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "_online_opd", False):
        return

    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams):
            check_capture_flag(params)
        return result

    _validate_params._online_opd = True
    InputProcessor._validate_params = _validate_params
