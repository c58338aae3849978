"""Hosts whose supervisor is gone (it was SIGKILLed, say): find them, and stop them on cancel.

The supervisor records each host's pid and start time and its own process group (its hosts and
their children are in it) in supervisor.json. Hosts normally stop by themselves once their
supervisor dies (it asks the kernel for a SIGTERM then); these are the ones that did not (stuck,
stopped, ignoring SIGTERM). `launch cancel` then starts `python -m launch.backends.local stop
RUN_DIR` detached, which does what the supervisor's cancel would: SIGTERM, the cancel grace,
SIGKILL, and records the run cancelled.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from launch.backends.local.procs import alive
from launch.backends.local.supervisor import PLAN_FILE, POLL_S, STATE_FILE
from launch.state import read_json, utc_now, write_json_atomic


def live_hosts(st: dict[str, Any]) -> list[dict[str, Any]]:
    """The hosts of supervisor.json `st` that still run (a reused pid is not one of them)."""
    return [
        h
        for h in st.get("hosts", [])
        if h.get("returncode") is None and alive(h["pid"], h.get("start"))
    ]


def describe(hosts: list[dict[str, Any]]) -> str:
    """`host 1 (pid 42)` or `hosts 0, 1 (pids 41, 42)`."""
    s = "s" if len(hosts) > 1 else ""
    return (
        f"host{s} {', '.join(str(h['index']) for h in hosts)} "
        f"(pid{s} {', '.join(str(h['pid']) for h in hosts)})"
    )


def run_group(st: dict[str, Any]) -> int | None:
    """The run's process group, once a live host shows it is still the run's (the number of a
    group is not reused while any process is in it)."""
    pgid = st.get("pgid")
    if pgid and any(_group_of(h["pid"]) == pgid for h in live_hosts(st)):
        return int(pgid)
    return None


def signal_hosts(st: dict[str, Any], sig: int, group: int | None) -> None:
    """`sig` to the run's process group `group` (hosts and their children) and to every live
    host by its pid."""
    if group is not None:
        _send(lambda: os.killpg(group, sig))
    for h in live_hosts(st):
        _send(lambda pid=h["pid"]: os.kill(pid, sig))


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _send(kill: Any) -> None:
    try:
        kill()
    except (ProcessLookupError, PermissionError):
        pass


def _say(msg: str) -> None:
    print(f"{utc_now()} {msg}", flush=True)


def stop(run_dir: Path) -> int:
    """Cancel what a dead supervisor left running: SIGTERM (and SIGCONT, so a stopped host sees
    it), the plan's cancel grace, then SIGKILL; supervisor.json then says cancelled."""
    st = read_json(run_dir / STATE_FILE) or {}
    plan = read_json(run_dir / PLAN_FILE) or {}
    grace = float((plan.get("grace_s") or {}).get("cancel", 120.0))
    left = live_hosts(st)
    if not left:
        return 0
    _say(
        f"cancel: the supervisor (pid {st.get('pid')}) is gone; SIGTERM to {describe(left)}, "
        f"SIGKILL after {grace:g} s"
    )
    group = run_group(st)
    signal_hosts(st, signal.SIGTERM, group)
    signal_hosts(st, signal.SIGCONT, group)
    deadline = time.monotonic() + grace
    while (left := live_hosts(st)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if left:
        _say(f"cancel: grace period over: SIGKILL to {describe(left)}")
        signal_hosts(st, signal.SIGKILL, group)
    if group is not None:  # children a host left behind in the run's group
        _send(lambda: os.killpg(group, signal.SIGKILL))
    latest = read_json(run_dir / STATE_FILE) or st
    latest.update(
        state="cancelled",
        detail=f"cancelled after the supervisor (pid {st.get('pid')}) was gone: its hosts "
        "were stopped by `launch cancel`",
        cancel_requested=True,
        updated=utc_now(),
        ended=utc_now(),
    )
    write_json_atomic(run_dir / STATE_FILE, latest)
    _say(f"cancelled: {latest['detail']}")
    return 0
