"""Where an attempt's wall time goes: a ledger the train loop moves from bucket to bucket.

Every second from the process's start is in exactly one bucket, so the buckets of a snapshot sum
to its wall time. The writer records snapshots as `ledger` events (runfolder.goodput reads them):
at checkpoints, evals, at most every RECORD_EVERY_S while stepping, and when the attempt ends.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any

# Buckets (runfolder.goodput.BUCKETS says what each means).
STARTUP, RESTORE, COMPILE, DATA_WAIT, PRODUCTIVE, RECOMPUTED = (
    "startup", "restore", "compile", "data_wait", "productive", "recomputed",
)  # fmt: skip
EVAL, CHECKPOINT, PROFILE, FINISH = "eval", "checkpoint", "profile", "finish"
DATA_OPEN, MODEL_INIT = "data_open", "model_init"  # named parts of the start-up
RECORD_EVERY_S = 60.0  # while stepping; checkpoints and evals record anyway


def process_start_time() -> float:
    """When this process started (epoch seconds): from /proc on Linux, so interpreter start-up
    and imports count; else the time this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        # The process's age on the boot clock, taken from now: /proc/stat's btime is whole
        # seconds, and the wall clock may have been stepped since boot.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


class TimeLedger:
    """Cumulative seconds per bucket for this attempt; one bucket is open at a time."""

    def __init__(self, process_start: float | None = None) -> None:
        self.process_start = process_start if process_start is not None else process_start_time()
        now = time.time()
        # The time before the ledger existed (interpreter, imports, boot) is start-up.
        self.seconds: dict[str, float] = {STARTUP: max(0.0, now - self.process_start)}
        self.current = STARTUP
        self._since = time.monotonic()
        self._epoch_at = now - self._since  # epoch = monotonic + this: one clock for the sum
        self.redo_until = 0  # steps up to here were reached by an earlier attempt
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._recorded = time.monotonic()

    def switch(self, bucket: str) -> str:
        """Close the open bucket at now and open `bucket`; returns the one closed."""
        now = time.monotonic()
        closed = self.current
        self.seconds[closed] = self.seconds.get(closed, 0.0) + (now - self._since)
        self.current, self._since = bucket, now
        return closed

    @contextmanager
    def timing(self, bucket: str):
        """Time a block in `bucket`, then go back to the bucket that was open."""
        previous = self.switch(bucket)
        try:
            yield
        finally:
            self.switch(previous)

    def step_bucket(self, step: int, *, first_of_attempt: bool) -> str:
        """The bucket a step's own time goes to: the first step of an attempt compiles; a step an
        earlier attempt already reached is recomputed; the rest is productive."""
        if first_of_attempt:
            return COMPILE
        return RECOMPUTED if step <= self.redo_until else PRODUCTIVE

    def stepped(self, step: int) -> None:
        if self.first_step is None:
            self.first_step = step
        self.last_step = step

    def snapshot(self) -> dict[str, Any]:
        """The buckets so far (the open one up to now) and the wall time they sum to."""
        now = time.monotonic()
        seconds = dict(self.seconds)
        seconds[self.current] = seconds.get(self.current, 0.0) + (now - self._since)
        return {
            "process_start": self.process_start,
            "recorded_at": now + self._epoch_at,
            "seconds": {k: round(v, 4) for k, v in seconds.items()},
            "first_step": self.first_step,
            "last_step": self.last_step,
            "redo_until": self.redo_until,
            "pid": os.getpid(),
        }

    def record_due(self) -> bool:
        """True at most every RECORD_EVERY_S (the caller then records a snapshot)."""
        if time.monotonic() - self._recorded < RECORD_EVERY_S:
            return False
        self._recorded = time.monotonic()
        return True
