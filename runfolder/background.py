"""One call on a daemon thread, as a Future: for work that cannot be cancelled from outside and
must not hold the process at its exit (storage calls, the ahead compile, the backend's start).
Nothing here imports jax."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_background(fn: Callable[[], T], name: str) -> Future:
    """`fn()` on a daemon thread, and its Future: for a call that cannot be cancelled from
    outside (a storage read blocked in a socket, an XLA compile) and must not hold the process at
    its exit the way an executor's threads, which are joined then, would."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
