"""What the process table says about a host: alive (not a zombie, not a reused pid), stopped.

Linux's /proc/<pid>/stat gives the state letter and the start time; where there is no procfs
(macOS) a signal-0 probe is all there is, and nothing is ever seen as stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")
_STATE, _START = 0, 19  # fields 3 and 22 of /proc/<pid>/stat, counted after the command name


def _stat(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), which tells it from a later reuse of its
    number; None without procfs or once it is gone."""
    fields = _stat(pid)
    return int(fields[_START]) if fields else None


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a debugger: it runs nothing, answers nothing,
    and acts on no signal but SIGKILL and SIGCONT."""
    fields = _stat(pid)
    return bool(fields) and fields[_STATE] in ("T", "t")


def alive(pid: int, start: int | None = None) -> bool:
    """Whether `pid` still runs (not a zombie), and is the process that started at `start`
    when that is known."""
    if not _PROC.is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, owned by someone else
        return True
    fields = _stat(pid)
    if not fields or fields[_STATE] in ("Z", "X"):
        return False
    return start is None or int(fields[_START]) == start
