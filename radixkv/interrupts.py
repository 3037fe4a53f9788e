"""Ctrl-C held back while the engine's books change.

A ``KeyboardInterrupt`` from SIGINT can land between any two bytecodes. Inside a cache operation (an edge
split half done) no later repair could trust the cache, so the engine runs its bookkeeping (scheduling,
commit, sampling, finishing) under :func:`deferred_interrupts`, and a Ctrl-C pressed there is raised when
the block ends; one pressed during the model's forward, which changes no books, is raised at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT until the block exits, then raise ``KeyboardInterrupt`` if one came.

    Only in the main thread and only while Python's default handler is installed (a program with its own
    handler, e.g. an asyncio server, keeps it). Costs two ``signal.signal`` calls.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
