"""No silent waits: a wait that lasts says what it waits for.

:func:`said_while_waiting` wraps a blocking call (a checkpoint committing to a slow
bucket, telemetry being uploaded at the end of a run): if it lasts over ``after_s`` a
line names what the process waits for and for how long, again every ``every_s``, so a
run never sits silent at exit. Pure Python (the bottom layer).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from absl import logging


@contextlib.contextmanager
def said_while_waiting(what: str, after_s: float = 5.0, every_s: float = 10.0,
                       why: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """Logs ``waiting for WHAT (N s so far)`` while the block runs past ``after_s``
    seconds, then every ``every_s`` seconds; silent for a block that ends sooner.
    ``why()``: what the wait is known to be about at that moment (e.g. "the bucket
    answered 503 Service Unavailable; its client retries"), added to the line."""
    done = threading.Event()
    started = time.monotonic()

    def say() -> None:
        wait = after_s
        while not done.wait(wait):
            reason = why()
            logging.warning("waiting for %s (%.0f s so far%s)", what,
                            time.monotonic() - started, f"; {reason}" if reason else "")
            wait = every_s

    thread = threading.Thread(target=say, daemon=True, name="waiting-notice")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
