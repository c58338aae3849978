"""What a process is doing before its first step, said on a terminal.

A large model's start takes minutes on a real chip (data, parameters, a restore, the first
compile), and a silent terminal looks hung. Each phase is one line on stderr, `start: …`, shown
when stderr is a terminal; JAXJOB_STARTUP_LOG=1 shows it anywhere (a launched host's log, a
test waiting for a phase), =0 never.
"""

from __future__ import annotations

import os
import sys
import time

from runtime.observe.ledger import process_start_time

ENV = "JAXJOB_STARTUP_LOG"


def enabled() -> bool:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class StartupLog:
    """`say(phase)` (calling it) prints `start: [<seconds since the process started>] <phase>`."""

    def __init__(self, on: bool | None = None) -> None:
        self.on = enabled() if on is None else on
        self._started = process_start_time()

    def __call__(self, phase: str) -> None:
        if self.on:
            took = time.time() - self._started
            print(f"start: [{took:5.1f}s] {phase}", file=sys.stderr, flush=True)
