"""SIGTERM during `runtime data prepare`: one sentence and exit 42, after the clean-up Ctrl-C gets.

A backend or a person stops a prepare with SIGTERM; its default action ends the process at once
(exit 143, no word, the new shard folder left behind). `SigtermStop` turns it into
`PrepareStopped` (a JaxjobError with exit 42, restartable, as a prepare job's host exits) raised
in the main thread, where the prepare removes its unfinished folder as it does for
KeyboardInterrupt, and the CLI prints the one line.

It is installed before the prepare's modules are imported and armed after: an exception raised
inside an import of a C extension can leave it half made, so a SIGTERM that early waits for
`arm()`. Jax-free, so installing it costs nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_RESTARTABLE


class PrepareStopped(JaxjobError):
    """A prepare stopped by SIGTERM: running it again is safe (restartable)."""

    exit_code = EXIT_RESTARTABLE


class SigtermStop:
    """`with SigtermStop() as stop: ...imports...; stop.arm(what); prepare(...)`."""

    def __init__(self) -> None:
        self._what: str | None = None  # set by arm(): what was stopped, for the sentence
        self._pending = False
        self._previous: signal.Handlers | object | None = None

    def __enter__(self) -> SigtermStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def arm(self, what: str) -> None:
        """From now on a SIGTERM stops the prepare (one already received does so here); `what`
        completes the sentence "stopped by SIGTERM while ...", saying what to do next."""
        self._what = what
        if self._pending:
            self._stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._what is None:
            self._pending = True
            return
        self._stop()

    def _stop(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up
        raise PrepareStopped(f"stopped by SIGTERM while {self._what}")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
