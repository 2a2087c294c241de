"""Process signals as a stop flag: the one place online-opd installs signal handlers.

Only ``serve/`` owns the process, so only it turns SIGINT/SIGTERM into a
``threading.Event``; loops elsewhere (the scraper, training) take that event
and check it between units of work, and finish the current one cleanly.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                    stop: threading.Event | None = None) -> Iterator[threading.Event]:
    """Set (and yield) ``stop`` on any of ``signals``; the previous handlers come back on exit.

    Python runs handlers only in the main thread and refuses to install them
    elsewhere: off the main thread nothing is installed and the event is
    only set by whoever else holds it.
    """
    stop = stop if stop is not None else threading.Event()

    def handler(signum: int, _frame: object) -> None:
        logger.warning("%s received: stopping cleanly", signal.Signals(signum).name)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
