"""Waiting for a run to end and watching its status: `launch wait`, `launch submit --wait
--timeout` and `launch status --watch`.

How they end: 0 the run succeeded, 1 (EXIT_FAILED) it failed or was cancelled, 124
(EXIT_TIMED_OUT) it had not ended within `--timeout` (it goes on), 2 a bad option. What they wait
for is the run's latest submission (the handle its record keeps), never an end an earlier
submission recorded.
"""

from __future__ import annotations

import queue
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_TIMED_OUT
from launch.quiet import END, read_in_background

_DURATION = re.compile(
    r"(?:(?P<d>\d+(?:\.\d+)?)d)?(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?"
    r"(?:(?P<s>\d+(?:\.\d+)?)s)?|(?P<n>\d+(?:\.\d+)?)"
)
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "n": 1.0}


def parse_duration(text: str, option: str) -> float:
    """Seconds in `text`: `30s`, `10m`, `2h`, `1h30m`, `1d` or plain seconds (`90`, `0.5`).
    A bad value is one sentence naming `option` (exit 2)."""
    m = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or m is None or not any(m.groupdict().values()):
        raise JaxjobError(
            f"{option} {text!r} is not a duration; use e.g. 30s, 10m, 2h or 1h30m (plain "
            "numbers are seconds)"
        )
    seconds = sum(float(v) * _UNIT_S[k] for k, v in m.groupdict().items() if v)
    if seconds <= 0:
        raise JaxjobError(f"{option} {text!r} must be longer than 0 seconds")
    return seconds


class TimedOut(JaxjobError):
    """The run had not ended within --timeout; it goes on (exit 124, as coreutils `timeout`)."""

    exit_code = EXIT_TIMED_OUT


@dataclass(frozen=True)
class Deadline:
    """When waiting stops (`text`: the --timeout as the user wrote it, for the message)."""

    text: str
    at: float  # time.monotonic()

    @classmethod
    def parse(cls, text: str | None, option: str = "--timeout") -> Deadline | None:
        if text is None:
            return None
        return cls(text, time.monotonic() + parse_duration(text, option))

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def timed_out(self, run_id: str, st: dict[str, Any]) -> TimedOut:
        return TimedOut(
            f"run {run_id} has not ended within {self.text} (it is {st.get('state', 'unknown')}) "
            f"and goes on; launch cancel {run_id} stops it"
        )


def until(lines: Iterable[str], deadline: Deadline | None, tick: float = 0.25) -> Iterator[str]:
    """`lines` (which may block between lines: a backend's `logs(follow=True)`) until they end
    or `deadline` passes; they are read in a daemon thread, so a silent run cannot hold the
    deadline up."""
    if deadline is None:
        yield from lines
        return
    q = read_in_background(lines, "wait-logs")
    while not deadline.passed():
        try:
            got = q.get(timeout=min(tick, max(deadline.left(), 0.001)))
        except queue.Empty:
            continue
        if got is END:
            return
        if isinstance(got, BaseException):
            raise got
        yield str(got)


def watch(
    poll: Callable[[], tuple[list[str], bool]],
    *,
    interval: float,
    out: TextIO | None = None,
    tty: bool | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], str] | None = None,
) -> None:
    """Show `poll()`'s lines every `interval` seconds until it says the run has ended (its
    second value). On a terminal the same lines are redrawn in place; otherwise (piped, a file)
    the first poll prints every line and each later one only the lines that changed, each
    prefixed with the UTC time."""
    out = out if out is not None else sys.stdout
    tty = out.isatty() if tty is None else tty
    clock = clock or (lambda: time.strftime("%H:%M:%S", time.gmtime()))
    shown: list[str] = []
    drawn = 0  # lines on the terminal to redraw over
    while True:
        lines, ended = poll()
        if tty:
            width = max(20, shutil.get_terminal_size().columns - 1)  # no wrap: keeps the count
            lines = [ln[:width] for ln in lines]
            if lines != shown:
                if drawn:
                    out.write(f"\x1b[{drawn}F\x1b[J")  # back to the first line, clear below
                out.write("".join(f"{ln}\n" for ln in lines))
                drawn = len(lines)
        else:
            before = set(shown)
            for ln in lines:
                if ln not in before:
                    out.write(f"{clock()} {ln}\n")
        out.flush()
        shown = lines
        if ended:
            return
        sleep(interval)
