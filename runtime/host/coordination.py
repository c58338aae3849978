"""Coordinated stop on a signal, and exit rather than hang when a host dies or stops advancing.

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
* A host whose process lives but whose training does not move (its main thread blocked on a
  hung file system, a FIFO, a full pipe) keeps JAX's heartbeat and ours going, and its peers
  block in the next collective for ever. So the heartbeat carries the loop's progress and
  HostWatchdog declares the host furthest behind stalled once it has not moved for the timeout
  in the stepping phase (the rule is in its docstring); every host, the stalled one included,
  exits EXIT_HOST_LOST with a sentence naming it.
* Process 0 killed: it hosts the coordination service, and every survivor is aborted by JAX
  within a fraction of a second (exit 134); nothing in Python runs first. The watchdog covers the
  case where the service stops answering without closing its sockets (a frozen or lost host 0).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from jobspec.exit_codes import EXIT_HOST_LOST
from runfolder.storage import on_retry
from runtime.host import boot, hostlog, startup


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
            old = signal.signal(signal.SIGINT, self._on_sigint)
            self._previous[signal.SIGINT] = startup.handler_before(signal.SIGINT, old)
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                old = signal.signal(sig, self._on_signal)
                self._previous[sig] = startup.handler_before(sig, old)

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
        if self.stop_step is not None:
            # Stopped by a signal and checkpointed: the host only has its exit 42 left. A later
            # SIGTERM (srun --kill-on-bad-exit once a faster peer exited 42, a second scancel,
            # or any after JAX's preemption notifier is gone) must not turn it into a death by
            # signal (143) in the record.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


# The phases of a host's loop. Only "step" is judged for stalls: the others may legitimately
# take long (the first step's compile, an eval with its own compile, a save, the final save).
JUDGED_PHASES = frozenset({"step"})
_PENDING_OUTPUTS = 64  # dispatched steps whose outputs the beat thread watches for completion


@dataclass
class _View:
    """What one host last said (or, for this host, what it knows first-hand)."""

    phase: str = "start"
    step: int = -1
    seq: int = 0  # the n-th progress call within `step`: the same program point on every host
    moves: int = 0
    moved_at: float = 0.0  # local monotonic time `moves` last changed

    @property
    def position(self) -> tuple[int, int]:
        return (self.step, self.seq)


def stalled_hosts(views: dict[int, _View], now: float, timeout_s: float) -> list[int]:
    """The hosts whose training stopped advancing, by the rule in HostWatchdog's docstring."""
    if not views:
        return []
    behind = min(v.position for v in views.values())
    last = [i for i, v in sorted(views.items()) if v.position == behind]
    if all(views[i].phase in JUDGED_PHASES and now - views[i].moved_at > timeout_s for i in last):
        return last
    return []


class HostWatchdog:
    """Exit with EXIT_HOST_LOST when a peer host dies *or stops advancing*, instead of hanging.

    Every host writes `jaxjob/<run>/heartbeat/<attempt>/<i>` every `interval_s` from a daemon
    thread, reads all the others' in one call, and a second thread, which never blocks on the
    network, judges on the local monotonic clock (no clock-skew assumptions):

    * Dead: a peer whose heartbeat has not changed for `timeout_s` (or, seen from another host,
      host 0's coordination service not answering) is lost.
    * Stalled: the heartbeat carries the host loop's progress. The loop calls `progress(step,
      phase, outputs)` at program points every host passes in the same order (after each step
      is dispatched, before an eval, before a save, back to stepping); the n-th call within a
      step gives every host the same *position* (step, n). A host *moves* when it makes such a
      call or when the device finishes a step it dispatched (its outputs become ready), so a
      host whose main thread waits for the device is still moving while the device works. The
      hosts at the lowest position are the ones everybody else waits for (the others have
      passed that point and then block in a collective that needs them). They are declared
      stalled when each of them has not moved for `timeout_s` and each is in the "step" phase;
      phases that may take long for good reasons ("start" until the first step's compile is
      done, "eval", "checkpoint", "finish") are not judged. Every host applies the rule to the
      same views, its own included, so the stalled host exits by itself and its peers name it.
      Hence `timeout_s` must exceed the longest training step.

    A host that finished calls `mark_done()` (value "done") and is never reported. Keep
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
        self._views: dict[int, _View] = {}
        self._mine = _View(moved_at=time.monotonic())
        self._lock = threading.Lock()  # guards _mine and _outputs
        self._outputs: deque[Any] = deque(maxlen=_PENDING_OUTPUTS)
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
        self._views = {i: _View(moved_at=now) for i in range(self._n) if i != self._me}
        with self._lock:
            self._mine.moved_at = now
        for target, name in ((self._beat, "beat"), (self._watch, "watch")):
            t = threading.Thread(target=target, name=f"jaxjob-watchdog-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        # Riding out a storage outage (runtime.storage_retry_s) is working, not stalling.
        on_retry(self.moved)

    def moved(self) -> None:
        """Count as progress without changing the position (a storage retry, for one)."""
        with self._lock:
            self._mine.moves += 1
            self._mine.moved_at = time.monotonic()

    def progress(self, step: int, phase: str = "step", outputs: Any = None) -> None:
        """Called by the host loop at points every host passes in the same order: `step` is the
        last step dispatched, `phase` what the host does until the next call ("step" is judged
        for stalls, the others are not), `outputs` that step's device outputs (any pytree of
        jax arrays): the device finishing them counts as progress too. Cheap; never blocks."""
        with self._lock:
            m = self._mine
            m.seq = m.seq + 1 if step == m.step else 0
            m.step, m.phase = step, phase
            m.moves += 1
            m.moved_at = time.monotonic()
            if outputs is not None:
                self._outputs.append(outputs)

    def _device_moved(self) -> None:
        """Count steps whose outputs became ready since the last look (never waits for them)."""
        import jax

        with self._lock:
            ready = 0
            while self._outputs:
                leaves = jax.tree.leaves(self._outputs[0])
                try:
                    done = all(x.is_ready() for x in leaves if hasattr(x, "is_ready"))
                except Exception:  # deleted or failed: nothing more will come of it
                    done = True
                if not done:
                    break
                self._outputs.popleft()
                ready += 1
            if ready:
                self._mine.moves += 1
                self._mine.moved_at = time.monotonic()

    def _my_value(self, count: int) -> str:
        with self._lock:
            m = self._mine
            return json.dumps({"beat": count, "phase": m.phase, "step": m.step, "seq": m.seq,
                               "moves": m.moves})  # fmt: skip

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            client = boot.kv_client()
            if client is None:
                return  # jax.distributed was shut down
            try:
                self._device_moved()
            except Exception:  # a readiness probe must never stop the heartbeat
                pass
            try:
                if not self._done:
                    count += 1
                    client.key_value_set(
                        f"{self.prefix}{self._me}", self._my_value(count), allow_overwrite=True
                    )
                entries = client.key_value_dir_get(self.prefix)
            except Exception:  # unreachable service: the watch thread judges it
                entries = None
            if entries is not None:
                now = time.monotonic()
                self._service_ok = now
                for key, value in entries:
                    self._seen(int(key.rsplit("/", 1)[-1]), value, now)
            self._stop.wait(self.interval_s)

    def _seen(self, peer: int, value: str, now: float) -> None:
        if peer == self._me:
            return
        if value == "done":
            self._done_peers.add(peer)
        if self._last_value.get(peer) == value:
            return
        self._last_value[peer], self._last_change[peer] = value, now
        try:
            said = json.loads(value)
            view = self._views.setdefault(peer, _View(moved_at=now))
            if said["moves"] != view.moves:
                view.moves, view.moved_at = said["moves"], now
            view.phase, view.step, view.seq = said["phase"], said["step"], said["seq"]
        except (ValueError, KeyError, TypeError):  # "done", or a bare counter
            pass

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
            if not self._done and self._judge_progress(now):
                return

    def _judge_progress(self, now: float) -> bool:
        with self._lock:
            mine = _View(**vars(self._mine))
        views = {i: v for i, v in self._views.items() if i not in self._done_peers}
        # Only among live hosts: a peer whose heartbeat went quiet is the dead-host rule's (its
        # progress stops a little before its heartbeat does, and that must not read as a stall).
        fresh_s = 3 * self.interval_s + 1.0
        if any(now - self._last_change.get(i, now) > fresh_s for i in views):
            return False
        views[self._me] = mine
        stalled = stalled_hosts(views, now, self.timeout_s)
        if not stalled:
            return False
        step = views[stalled[0]].step
        t = f"{self.timeout_s:g} s"
        if len(stalled) > 1:
            names = ", ".join(str(i) for i in stalled)
            message = (
                f"hosts {names} of {self._n} stopped advancing together at step {step} (no "
                f"progress for {t}: a collective that never completes?); exiting"
            )
        elif stalled[0] == self._me:
            message = (
                f"this host (host {self._me} of {self._n}) stopped advancing: no progress past "
                f"step {step} for {t} while training (its main thread is stuck); exiting"
            )
        else:
            message = (
                f"host {stalled[0]} of {self._n} stopped advancing: no progress past step "
                f"{step} for {t} while its heartbeat went on; exiting"
            )
        self.lost = stalled[0]
        self.on_lost(message)
        return True

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
        with self._lock:  # waiting here is no stall; what the host does after it is judged again
            phase, self._mine.phase = self._mine.phase, "failing"
        deadline = time.monotonic() + (wait_s if wait_s is not None else self.timeout_s + 5)
        while self.lost is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.2)
        self.progress(self._mine.step, phase)

    def stop(self) -> None:
        on_retry(self.moved, remove=True)
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self.interval_s + 1)
        self._threads.clear()


def _exit_host_lost(message: str) -> None:
    hostlog.fatal(message, EXIT_HOST_LOST)
