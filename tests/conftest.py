"""Shared test setup: one torch thread per test process (the CI machine has two
cores, and oversubscribed torch threads slow CPU tests by an order of magnitude)."""

import torch

torch.set_num_threads(1)


import os  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A bootstrap run whose drafter memorised six target rollouts (tests/serving.py).

    Set ONLINE_OPD_TEST_RUN=DIR to keep and reuse it between local test runs."""
    from tests.serving import bootstrap

    run = Path(os.environ["ONLINE_OPD_TEST_RUN"]) if os.environ.get("ONLINE_OPD_TEST_RUN") \
        else tmp_path_factory.mktemp("trained")
    bootstrap(run)
    return run


@pytest.fixture(scope="session")
def rollouts(trained_run) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, non-speculative greedy output ids) of the prompts the trained run's drafter memorised."""
    from tests.serving import memorised_rollouts

    return memorised_rollouts(trained_run)
