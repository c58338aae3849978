"""SIGTERM/SIGINT before the train loop: a restartable exit (42), not a death by signal (143).

A backend stops hosts with SIGTERM at any moment, also while they import jax, form the cluster,
build the model or compile the first step; the train loop's StopAgreement only covers the steps.
`StartupSignals` covers the time before it:

* While the main thread runs Python, the handler raises `StartupInterrupted` (a JaxjobError with
  exit code 42), so the CLI ends with one sentence and every `finally` runs (a run claim is
  released).
* The handler runs at whatever Python code the main thread is in, which may be a context whose
  exceptions CPython only reports as "Exception ignored" (a gc callback such as JAX's, a
  `__del__`). An `unraisablehook` catches that case and delivers the signal again, so it is raised
  at the next ordinary bytecode; a `StartupInterrupted` swallowed by a library's broad `except`
  is raised again by `end()`, so training never starts after a stop was asked for.
* While the main thread is blocked in C++ (`jax.distributed.initialize` waiting for peers, an XLA
  compile), Python handlers cannot run. Python's C-level handler still writes the signal number to
  the wakeup fd at once, so a watcher thread sees it; if the handler has not run within
  `GRACE_S`, the watcher prints the sentence and ends the process with 42 itself.
* After `jax.distributed.initialize`, JAX's preemption notifier owns SIGTERM (see
  coordination.py): a SIGTERM then stops every host at the first step's agreement instead.

`end()` hands over to the train loop's own handling (StopAgreement.install replaces the handlers).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_RESTARTABLE
from runtime.host import hostlog

GRACE_S = 2.0
REDELIVER_S = 0.05
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupInterrupted(JaxjobError):
    """SIGTERM/SIGINT arrived before training began: restartable."""

    exit_code = EXIT_RESTARTABLE


def _message(signum: int) -> str:
    return (
        f"stopped by {signal.Signals(signum).name} during start-up, before training began; "
        "restart it to continue (it resumes from the run's latest checkpoint)"
    )


class StartupSignals:
    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._handled = threading.Event()
        self._ended = threading.Event()
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._signum: int | None = None  # the last signal whose exception was raised
        self._old_unraisablehook: Any = None

    def install(self) -> StartupSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C handler must never block on a full pipe
        self._wakeup = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._old_unraisablehook = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable
        threading.Thread(
            target=self._watch, args=(r,), name="jaxjob-startup-signals", daemon=True
        ).start()
        return self

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._ended.is_set():
            return
        self._handled.set()
        self._signum = signum
        raise StartupInterrupted(_message(signum))

    def _deliver_again(self, signum: int) -> None:
        """Raised where CPython drops exceptions: send the signal again a moment later, from
        another thread, so the handler runs once that context has returned."""
        if not self._ended.is_set():
            timer = threading.Timer(REDELIVER_S, os.kill, args=(os.getpid(), signum))
            timer.daemon = True
            timer.start()

    def _on_unraisable(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, StartupInterrupted) and self._signum is not None:
            self._deliver_again(self._signum)
            return
        self._old_unraisablehook(unraisable)

    def _watch(self, r: int) -> None:
        try:
            while not self._ended.is_set():
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if not data or self._ended.is_set():
                    return  # EOF: end() closed the write end
                for signum in set(data) & set(_SIGNALS):
                    # The handler runs as soon as the main thread executes Python; only a main
                    # thread stuck in C++ needs the watcher to end the process.
                    if not self._handled.wait(GRACE_S) and not self._ended.is_set():
                        hostlog.fatal(_message(signum), EXIT_RESTARTABLE)
                    self._handled.clear()  # a later signal is judged on its own
        finally:
            os.close(r)

    def end(self) -> None:
        """Training is starting: put the previous handlers back and stop watching.

        Raises `StartupInterrupted` if a signal's exception was swallowed before it ended the
        start-up (by a broad `except` in some library): the stop still stands.
        """
        if self._ended.is_set():
            return
        self._ended.set()
        if self._old_unraisablehook is not None and sys.unraisablehook == self._on_unraisable:
            sys.unraisablehook = self._old_unraisablehook
        if threading.current_thread() is threading.main_thread() and self._wakeup is not None:
            from runtime.host import boot

            signal.set_wakeup_fd(self._old_wakeup)
            for sig, handler in self._previous.items():
                # After jax.distributed.initialize, JAX's notifier owns SIGTERM at the C level
                # (Python still reports our handler): setting one now would replace it.
                if sig == signal.SIGTERM and boot.kv_client() is not None:
                    continue
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, handler)
            os.close(self._wakeup[1])  # the watcher's read sees EOF and ends
            self._wakeup = None
        if self._signum is not None:
            raise StartupInterrupted(_message(self._signum))


_current: StartupSignals | None = None


def install() -> None:
    """Cover the start-up of a `runtime local`/`worker` process (call first thing)."""
    global _current
    if _current is None:
        _current = StartupSignals().install()


def end() -> None:
    """Called by the train loop right before its own signal handling takes over."""
    global _current
    current, _current = _current, None
    if current is not None:
        current.end()
