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


@pytest.fixture(scope="module")
def replay_pair():
    """(target, drafter) of the replay tests (tests/tiny.py ``replay_models``), one pair per module."""
    from tests.tiny import replay_models

    return replay_models()


@pytest.fixture(scope="module")
def target(replay_pair):
    """The replay pair's 3-layer target; a module that needs another target defines its own ``target``."""
    return replay_pair[0]


@pytest.fixture(scope="module")
def drafter(replay_pair):
    """The replay pair's DFlash drafter (block size 4, weights near zero); a module may define its own."""
    return replay_pair[1]


# ---------------------------------------------------------------- what a module leaves running

_LEFT_BEHIND: list[str] = []


@pytest.fixture(autouse=True, scope="module")
def _nothing_left_running(request):
    """Threads of this process and child processes that a test module leaves running take the two cores
    (and this process's GIL) from the modules after it: a test's client then lags its server by seconds.
    Listed at the end of the run (``pytest_terminal_summary``) with the module that left them."""
    import threading

    import psutil

    me = psutil.Process()
    threads = set(threading.enumerate())
    children = {p.pid for p in me.children(recursive=True)}
    yield
    left = [f"thread {t.name}" for t in threading.enumerate() if t not in threads and t.is_alive()]
    for p in me.children(recursive=True):
        if p.pid in children:
            continue
        try:
            left.append(f"process {p.pid} {' '.join(p.cmdline()[:4])[:120]} ({p.status()})")
        except psutil.Error:  # ended meanwhile
            pass
    if left:
        _LEFT_BEHIND.append(f"{request.module.__name__}: " + "; ".join(left))


def pytest_terminal_summary(terminalreporter):
    if _LEFT_BEHIND:
        terminalreporter.section("left running after a test module")
        for line in _LEFT_BEHIND:
            terminalreporter.write_line(line)
