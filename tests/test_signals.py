"""serve/signals.py: SIGINT/SIGTERM set a stop event, and the previous handlers come back."""

from __future__ import annotations

import signal
import threading

from serve.signals import stop_on_signals


def test_signal_sets_the_event_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        assert not stop.is_set()
        signal.raise_signal(signal.SIGTERM)  # would end the test process without the handler
        assert stop.is_set()
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_nothing_is_installed():
    seen = {}

    def worker():
        with stop_on_signals() as stop:
            seen["handler"] = signal.getsignal(signal.SIGINT)
            seen["is_set"] = stop.is_set()

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"handler": before, "is_set": False}
