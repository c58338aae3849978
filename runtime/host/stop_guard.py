"""A SIGTERM/SIGINT to a single-process run ends it within seconds, also when its storage has
stopped answering.

StopAgreement's handler only records the signal; the loop stops at the next step, saves and
exits 42. A storage that does not answer can keep the main thread from ever getting there:

* inside one of our storage calls (runfolder.storage.with_retries): `storage.interrupt` makes that
  call give up STOP_GRACE_S after the signal and no call retry after it, so the run ends the way
  any storage fault does: its own sentence, exit 45;
* inside a call no deadline of ours covers (an Orbax save, a data read), perhaps blocked in C++
  where no Python handler runs at all: the watcher thread here learns of the signal from the
  signal wakeup fd the moment it arrives and, WAIT_S later, if the process is still there, asks
  the run's storage whether it answers (one listing with a deadline). If it does not, the
  watcher ends the process: exit 45, one sentence (the storage call's own when one already gave
  up). While the storage answers, a slow final save goes on (the backend's grace bounds it).

One process only: with several, JAX's preemption notifier owns SIGTERM (coordination.py) and
the host watchdog covers a host that stops advancing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from jobspec.exit_codes import EXIT_STORAGE_FAULT
from runfolder import storage
from runtime.host import boot, hostlog

WAIT_S = 20.0  # after the signal: time for the loop's own way out (a save, or a storage fault)
PROBE_S = 5.0  # how long the storage has to answer the watcher's probe
PROBE_EVERY_S = 10.0  # while it does answer, how often it is asked again
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopGuard:
    """`install()` once the loop's signal handlers are in place (start-up's wakeup fd is gone),
    `end()` when the loop is done; `probe` is one unretried call to the run's storage."""

    def __init__(self, probe: Callable[[], object], where: str) -> None:
        self._probe = probe
        self._where = where
        self._write: int | None = None
        self._old_wakeup = -1

    def install(self) -> StopGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # the wakeup fd can only be set from the main thread
        if boot.kv_client() is not None:
            import jax

            if jax.process_count() > 1:
                return self
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C-level handler must never block on a full pipe
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._write = w
        threading.Thread(
            target=self._watch, args=(r,), name="jaxjob-stop-guard", daemon=True
        ).start()
        return self

    def end(self) -> None:
        """Stop listening for signals; a countdown already started goes on (a process still
        there after a stop, on a dead storage, is ended all the same)."""
        if self._write is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._write)  # the watcher's read sees EOF and ends, unless it counts down
        self._write = None

    def _watch(self, r: int) -> None:
        try:
            signum = None
            while signum is None:
                data = os.read(r, 64)
                if not data:
                    return  # end(): no stop was asked for
                ours = [b for b in data if b in _SIGNALS]
                signum = ours[0] if ours else None
        except OSError:
            return
        finally:
            os.close(r)
        name = signal.Signals(signum).name
        storage.interrupt(name)
        time.sleep(WAIT_S)
        if storage.gave_up() is not None:
            # A call gave up: the loop is on its way out with that sentence; give it the time
            # to write its records on a storage that may answer again, then end it.
            time.sleep(WAIT_S)
        while True:
            why = storage.answers(self._probe, PROBE_S)
            if why is not None:
                hostlog.fatal(
                    storage.gave_up()
                    or (
                        f"stopped by {name}, but the run's storage ({self._where}) does not "
                        f"answer ({why}), so nothing more can be saved and the run ends without "
                        "a final checkpoint; it is restartable once the storage answers again"
                    ),
                    EXIT_STORAGE_FAULT,
                )
                return
            time.sleep(PROBE_EVERY_S)
