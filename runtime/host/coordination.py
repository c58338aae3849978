"""Coordinated stop on a signal, and exit rather than hang when a peer host dies.

What jax 0.10.2 does on CPU/gloo, seen here, and what these classes add:

* SIGTERM: once `jax.distributed.initialize` ran, JAX's preemption notifier (C++) owns SIGTERM on
  every process and `multihost_utils.reached_preemption_sync_point(step)` returns True on all
  hosts at the same step (max step seen + 1) when any one host gets it. It works on CPU
  multi-process, so StopAgreement uses it. A Python SIGTERM handler installed after boot would
  replace the notifier and break the agreement, so StopAgreement never installs one there.
* SIGINT is not watched by JAX, so our handler records it and re-raises SIGTERM at this process,
  which feeds the same agreement; the reason (signal name) travels through the key-value store.
* A peer SIGKILLed mid-collective: the survivor's gloo collective raises JaxRuntimeError at once
  ("Gloo all-reduce failed ... Connection reset by peer"); JAX's atexit shutdown then blocks in
  its shutdown barrier until the coordination service's heartbeat timeout, when JAX aborts the
  process from C++ (SIGABRT, exit 134, "Terminating process because the JAX distributed service
  detected fatal errors ... Task 1 heartbeat timeout"). A peer that hangs (no TCP reset) leaves
  the collective blocked until that same abort. HostWatchdog exits first, with a sentence naming
  the host, as long as its timeout is below boot's heartbeat_timeout_s.
* Process 0 killed: it hosts the coordination service, and every survivor is aborted by JAX
  within a fraction of a second (exit 134); nothing in Python runs first. The watchdog covers the
  case where the service stops answering without closing its sockets (a frozen or lost host 0).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from jobspec.exit_codes import EXIT_HOST_LOST
from runtime.host import boot, hostlog


def _world() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


class StopAgreement:
    """All hosts stop at the same step when any host gets SIGTERM or SIGINT.

    `install()` after boot, `should_stop(step)` on every host after every step (all hosts must
    start from the same step), `restore()` when done. `reason` is the signal's name and
    `stop_step` the agreed step once `should_stop` returned True.
    """

    def __init__(self, *, run_id: str | None = None, attempt: int | None = None) -> None:
        self.run_id, self.attempt = boot.run_and_attempt(run_id, attempt)
        self.reason: str | None = None
        self.stop_step: int | None = None
        self._signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._multi = False

    @property
    def reason_key(self) -> str:
        return f"jaxjob/{self.run_id}/stop/{self.attempt}/reason"

    def install(self) -> None:
        self._multi = boot.kv_client() is not None and _world()[1] > 1
        if self._multi:
            from jax._src import distributed

            if distributed.global_state.preemption_sync_manager is None:
                raise RuntimeError(
                    "StopAgreement needs JAX's preemption service; leave "
                    "jax_enable_preemption_service on"
                )
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signum = signum
        # A second Ctrl-C falls through to the default handler and stops at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self._on_signal(signum, frame)
        try:
            boot.kv_client().key_value_set(self.reason_key, "SIGINT", allow_overwrite=False)
        except Exception:  # another host's reason is already there: keep it
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier turns it into a cluster-wide stop

    def should_stop(self, step: int) -> bool:
        if self.stop_step is not None:
            return True
        if self._multi:
            from jax.experimental import multihost_utils

            if not multihost_utils.reached_preemption_sync_point(step):
                return False
            self.reason = self._agreed_reason()
        elif self._signum is not None:
            self.reason = signal.Signals(self._signum).name
        else:
            return False
        self.stop_step = step
        return True

    def _agreed_reason(self) -> str:
        if self._signum is not None:
            return signal.Signals(self._signum).name
        try:
            return str(boot.kv_client().key_value_try_get(self.reason_key))
        except Exception:  # NOT_FOUND: nobody got SIGINT, so it was SIGTERM
            return "SIGTERM"

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class HostWatchdog:
    """Exit with EXIT_HOST_LOST when a peer host stops heartbeating, instead of hanging.

    Every host writes `jaxjob/<run>/heartbeat/<attempt>/<i>` (a counter) every `interval_s` from a
    daemon thread, reads all the others' in one call, and a second thread, which never blocks on
    the network, judges staleness on the local monotonic clock (no clock-skew assumptions). A
    host that finished calls `mark_done()` (value "done") and is never reported. Keep
    `timeout_s` below boot's `heartbeat_timeout_s`, or JAX's abort comes first.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        interval_s: float | None = None,
        run_id: str | None = None,
        attempt: int | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.5, min(5.0, timeout_s / 6))
        run, att = boot.run_and_attempt(run_id, attempt)
        self.prefix = f"jaxjob/{run}/heartbeat/{att}/"
        self.on_lost = on_lost or _exit_host_lost
        self.lost: int | None = None
        self._stop = threading.Event()
        self._done = False
        self._done_peers: set[int] = set()
        self._last_value: dict[int, str] = {}
        self._last_change: dict[int, float] = {}
        self._service_ok = 0.0
        self._threads: list[threading.Thread] = []
        self._me, self._n = 0, 1

    def start(self) -> None:
        if boot.kv_client() is None or self._threads:
            return  # one process: nobody to lose
        self._me, self._n = _world()
        now = time.monotonic()
        self._service_ok = now
        self._last_change = {i: now for i in range(self._n) if i != self._me}
        for target, name in ((self._beat, "beat"), (self._watch, "watch")):
            t = threading.Thread(target=target, name=f"jaxjob-watchdog-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            client = boot.kv_client()
            if client is None:
                return  # jax.distributed was shut down
            try:
                if not self._done:
                    count += 1
                    client.key_value_set(
                        f"{self.prefix}{self._me}", str(count), allow_overwrite=True
                    )
                entries = client.key_value_dir_get(self.prefix)
            except Exception:  # unreachable service: the watch thread judges it
                entries = None
            if entries is not None:
                now = time.monotonic()
                self._service_ok = now
                for key, value in entries:
                    peer = int(key.rsplit("/", 1)[-1])
                    if value == "done":
                        self._done_peers.add(peer)
                    if self._last_value.get(peer) != value:
                        self._last_value[peer], self._last_change[peer] = value, now
            self._stop.wait(self.interval_s)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s / 2)):
            if boot.kv_client() is None:
                return
            now = time.monotonic()
            for peer, seen in sorted(self._last_change.items()):
                if peer not in self._done_peers and now - seen > self.timeout_s:
                    self._declare(peer, "no heartbeat")
                    return
            if self._me != 0 and now - self._service_ok > self.timeout_s:
                # Process 0 hosts the coordination service: it not answering means host 0 is gone.
                self._declare(0, "its coordination service did not answer")
                return

    def _declare(self, peer: int, why: str) -> None:
        self.lost = peer
        self.on_lost(
            f"host {peer} of {self._n} stopped responding ({why} for {self.timeout_s:g} s); exiting"
        )

    def mark_done(self) -> None:
        """Tell the others this host finished on purpose; it keeps watching them until stop()."""
        self._done = True
        client = boot.kv_client()
        if client is not None and self._threads:
            client.key_value_set(f"{self.prefix}{self._me}", "done", allow_overwrite=True)

    def explain_failure(
        self, exc: BaseException | None = None, wait_s: float | None = None
    ) -> None:
        """After the host loop raised `exc`: give the watchdog time to name a lost host (it then
        ends the process); returns if none was declared lost within `wait_s` (default: the
        timeout plus a little). Returns at once for errors that are no lost host: a JaxjobError
        (one sentence for the user), KeyboardInterrupt, SystemExit."""
        from jobspec.errors import JaxjobError

        if not self._threads or isinstance(exc, JaxjobError | KeyboardInterrupt | SystemExit):
            return
        deadline = time.monotonic() + (wait_s if wait_s is not None else self.timeout_s + 5)
        while self.lost is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self.interval_s + 1)
        self._threads.clear()


def _exit_host_lost(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    hostlog.hard_exit(EXIT_HOST_LOST)
