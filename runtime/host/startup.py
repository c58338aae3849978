"""SIGTERM/SIGINT before the train loop: a restartable exit (42), not a death by signal (143).

A backend stops hosts with SIGTERM at any moment, also while they import jax, form the cluster,
build the model or compile the first step; the train loop's StopAgreement only covers the steps.
`StartupSignals` covers the time before it:

* While the main thread runs our own code, the handler raises `StartupInterrupted` (a
  JaxjobError with exit code 42), so the CLI ends with one sentence and every `finally` runs (a
  run claim is released).
* Raised anywhere else, the exception would land inside a library: an import of a C extension cut
  short (finalising a half-imported jaxlib crashes with SIGSEGV), JAX's plugin discovery (which
  logs it as a traceback and carries on), a gc callback or `__del__` (CPython drops it as
  "Exception ignored"). So the handler raises only when every frame on the main thread's stack is
  ours or click's; otherwise it asks again `REDELIVER_S` later (`_thread.interrupt_main`, which
  never reaches the OS, so it cannot kill a process whose handlers are gone). A stop still pending
  when `end()` runs is raised there, so training never starts after a stop was asked for; one
  swallowed by a library's broad `except` likewise.
* While the main thread is blocked in C++ (`jax.distributed.initialize` waiting for peers, an XLA
  compile), Python handlers cannot run. Python's C-level handler still writes the signal number to
  the wakeup fd at once, so a watcher thread sees it; if no stop has been raised within
  `GRACE_S` of the first signal (blocked in C++, or in library code all that time), the watcher
  prints the sentence and ends the process with 42 itself.
* After `jax.distributed.initialize`, JAX's preemption notifier owns SIGTERM (see
  coordination.py): a SIGTERM then stops every host at the first step's agreement instead.

`end()` hands over to the train loop's own handling: StopAgreement installs its handlers first
(restoring, when it is done, the ones start-up replaced: `handler_before`), so no SIGTERM falls
into a gap where the default action would end the process with 143.
"""

from __future__ import annotations

import _thread
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import click

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_RESTARTABLE
from runtime.host import hostlog

GRACE_S = 2.0
REDELIVER_S = 0.05
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_ROOT = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_ROOT / pkg) + os.sep for pkg in ("jobspec", "runfolder", "runtime", "launch"))
_CLICK = str(Path(click.__file__).resolve().parent) + os.sep


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_OURS)


def _safe_to_raise(frame: FrameType | None) -> bool:
    """Whether the main thread is in our own code, with nothing but ours and click's below it
    (down to the outermost frame of ours; runpy and the console script are beneath that)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    while stack and not _ours(stack[-1]):
        stack.pop()
    if not stack or not _ours(stack[0]):
        return False
    return all(_ours(f) or f.f_code.co_filename.startswith(_CLICK) for f in stack)


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
        self._ended = threading.Event()
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._signum: int | None = None  # the last signal seen (raised or still pending)
        self._raised = threading.Event()  # a StartupInterrupted has been raised
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

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        global _stopped
        if self._ended.is_set():
            return
        self._signum = signum
        if not _safe_to_raise(frame):
            self._deliver_again(signum)
            return
        self._raised.set()
        _stopped = True
        raise StartupInterrupted(_message(signum))

    def _interrupt_again(self, signum: int) -> None:
        if not self._ended.is_set():
            _thread.interrupt_main(signum)

    def _deliver_again(self, signum: int) -> None:
        """Ask for the handler again a moment later, from another thread, once the main thread
        may have left the library code (or the context whose exceptions CPython drops)."""
        if not self._ended.is_set():
            timer = threading.Timer(REDELIVER_S, self._interrupt_again, args=(signum,))
            timer.daemon = True
            timer.start()

    def _on_unraisable(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, StartupInterrupted) and self._signum is not None:
            self._deliver_again(self._signum)
            return
        self._old_unraisablehook(unraisable)

    def _watch(self, r: int) -> None:
        deadline: float | None = None  # GRACE_S after the first signal no stop was raised for
        seen = signal.SIGTERM.value  # the last signal the wakeup fd named
        try:
            while not self._ended.is_set():
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([r], [], [], timeout)
                if self._ended.is_set():
                    return
                if not ready:
                    # The main thread is stuck in C++ (or in library code) past the grace time.
                    if not self._raised.is_set():
                        hostlog.fatal(_message(seen), EXIT_RESTARTABLE)
                    deadline = None
                    continue
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if not data:
                    return  # EOF: end() closed the write end
                ours = [b for b in data if b in _SIGNALS]
                if ours and deadline is None and not self._raised.is_set():
                    seen = ours[-1]
                    deadline = time.monotonic() + GRACE_S
        finally:
            os.close(r)

    def end(self) -> None:
        """Training is starting: put the previous handlers back and stop watching.

        Raises `StartupInterrupted` if a signal arrived whose stop is still pending, or whose
        exception was swallowed (by a broad `except` in some library): the stop still stands.
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
            global _stopped
            _stopped = True
            raise StartupInterrupted(_message(self._signum))


_current: StartupSignals | None = None
_stopped = False  # a start-up stop was raised in this process


def stopped() -> bool:
    """Whether a start-up stop was raised: the process must then end without Python's shutdown,
    since the exception may have cut an import of a C extension (jaxlib) short, and finalising a
    half-imported jaxlib crashes (SIGSEGV instead of 42)."""
    return _stopped


def handler_before(sig: int, handler: Any) -> Any:
    """`handler`, or the one start-up replaced if `handler` is start-up's: what a successor that
    installs its own handler while start-up still covers the signal restores later."""
    if _current is not None and handler == _current._on_signal:
        return _current._previous.get(sig, handler)
    return handler


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
