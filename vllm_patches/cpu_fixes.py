"""Corrections to vLLM's CPU stand-ins for Triton kernels, applied in every vLLM process.

vLLM 0.32's CPU override of the rejection sampler's ``expand_kernel``
(``vllm.utils.cpu_triton_utils._expand_kernel_impl``) passes
``_ensure_int64(output)`` to the C++ op: for an output that is not int64 that
is a fresh copy, so the real output keeps the uninitialised memory of
``new_empty``, and a float input is truncated to integers on the way in.
``apply_sampling_constraints`` expands the per-request temperatures (float32)
and top-k (int32) with it whenever a batch is not all-greedy, so greedy rows
stop being greedy and sampled rows use a wrong distribution.

``apply`` swaps in ``expand_kernel_impl`` (plain torch, every dtype). It runs
before the platform registers its overrides (``register`` is a general
plugin; ``WorkerBase.init_worker`` loads plugins first), and re-registers the
kernel if that already happened.

The second defect is in the runner vLLM's CPU runner inherits: for a request
whose sampled token is thrown away (its prefill is split over steps, so a step
samples from a partial prompt), ``GPUModelRunner._bookkeeping_sync`` rewinds the
request's seeded generator with ``gen.set_offset(gen.get_offset() - 4)``, the
Philox counter of a CUDA generator. A CPU generator (Mersenne Twister) has no
offset: ``RuntimeError: CPU Generator does not use offset`` ends the engine
core and every request in flight. It takes one request with the OpenAI
``seed`` field whose prefill is split: a long prompt, or a prompt that arrives
beside others and overflows the step's token budget.

``apply`` wraps ``_sample`` and ``_bookkeeping_sync``: the states of the CPU
generators of those requests are saved before sampling and restored after it,
which is exactly what the rewind means (the seeded stream continues as if the
discarded token was never drawn), and the rewind is skipped for them. Here live
only the fixes and their gate; the version range is checked by
``vllm_patches.check_vllm_version``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("online_opd.cpu_fixes")

#: Inclusive lower bound, exclusive upper bound of the vLLM versions with the defect.
AFFECTED_VLLM = ("0.32.0", "0.33.0")
#: Set to 1 to leave vLLM's CPU kernels as they are (to reproduce the defect).
DISABLE_ENV = "ONLINE_OPD_DISABLE_CPU_FIXES"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(
    output: torch.Tensor,  # [num_tokens]
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    replace_from: int | float,
    replace_to: int | float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's name)
) -> None:
    """``expand_kernel`` on CPU: output[cu[r-1]:cu[r]] = input[r], for any dtype.

    As in the Triton kernel: cu[-1] is taken as 0; input[r] == replace_from is
    written as replace_to; at most MAX_NUM_TOKENS positions per request are
    written and positions past cu[batch_size-1] are left as they are.
    """
    if input_val.numel() == 0:
        return
    ends = cu_num_tokens.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    num_written = ends - starts
    if MAX_NUM_TOKENS is not None:
        num_written = num_written.clamp(max=MAX_NUM_TOKENS)
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    request_of_token = torch.repeat_interleave(
        torch.arange(input_val.numel(), device=output.device), num_written)
    # position of token t = start of its request + its rank within the request
    first_written = torch.cumsum(num_written, 0) - num_written
    rank_in_request = torch.arange(request_of_token.numel(), device=output.device) \
        - first_written[request_of_token]
    output[starts[request_of_token] + rank_in_request] = values[request_of_token]


def is_cpu_fix_needed() -> bool:
    """True on vLLM's CPU platform within AFFECTED_VLLM, unless DISABLE_ENV is set."""
    from vllm_patches import UnsupportedVLLMVersion, check_vllm_version

    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    try:
        check_vllm_version(bounds=AFFECTED_VLLM)
    except UnsupportedVLLMVersion:
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """The CPU generators, by batch row, of the requests whose token this step discards."""
    if not runner.input_batch.generators:  # no seeded request: every step without seeds stops here
        return {}
    num_reqs = runner.input_batch.num_reqs
    discarded = runner.discard_request_mask.np[:num_reqs]
    return {row: gen for row, gen in runner.input_batch.generators.items()
            if row < num_reqs and discarded[row] and gen.device.type == "cpu"}


def rewind_by_state(sample):
    """Wrap ``GPUModelRunner._sample``: discarded requests' CPU generators end it in the state they began it."""
    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):
        states = {row: gen.get_state() for row, gen in discarded_cpu_generators(self).items()}
        out = sample(self, *args, **kwargs)
        for row, state in states.items():
            self.input_batch.generators[row].set_state(state)
        return out

    return _sample


def skip_offset_rewind(bookkeeping_sync):
    """Wrap ``GPUModelRunner._bookkeeping_sync``: its offset rewind does not see CPU generators (``_sample``
    already rewound them); they are back in ``input_batch.generators`` when it returns or raises."""
    @functools.wraps(bookkeeping_sync)
    def _bookkeeping_sync(self, *args, **kwargs):
        hidden = discarded_cpu_generators(self)
        generators = self.input_batch.generators
        for row in hidden:
            del generators[row]
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    return _bookkeeping_sync


def apply() -> bool:
    """Install both fixes (kernel, seeded rewind) where vLLM's CPU engine takes them from; True if
    either was installed now."""
    if not is_cpu_fix_needed():
        return False
    installed = _apply_seeded_rewind()
    return _apply_expand_kernel() or installed


def _apply_seeded_rewind() -> bool:
    """Wrap the runner's ``_sample`` and ``_bookkeeping_sync`` once per process; True if wrapped now."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_online_opd_seeded_rewind", False):
        return False
    GPUModelRunner._sample = rewind_by_state(GPUModelRunner._sample)
    GPUModelRunner._bookkeeping_sync = skip_offset_rewind(GPUModelRunner._bookkeeping_sync)
    GPUModelRunner._online_opd_seeded_rewind = True
    logger.info("online-opd: seeded requests with a split prefill rewind their CPU generators by state "
                "(vLLM's offset rewind is CUDA-only; %s=1 disables)", DISABLE_ENV)
    return True


def _apply_expand_kernel() -> bool:
    """Install expand_kernel_impl where vLLM's CPU platform takes it from; True if installed now.

    Idempotent. Covers both orders: the platform reads
    ``cpu_triton_utils._expand_kernel_impl`` when it registers its overrides,
    and a kernel already overridden with the broken one is registered again.
    """
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    if cpu_triton_utils._expand_kernel_impl is expand_kernel_impl:
        return False
    broken = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is not None and registered[1] is broken:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    logger.info("online-opd: vLLM's CPU expand_kernel replaced (lossless speculative "
                "decoding in mixed greedy/sampled batches; %s=1 disables)", DISABLE_ENV)
    return True
