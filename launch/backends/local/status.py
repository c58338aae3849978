"""A local run's state and host logs, read from the supervisor's files and the process table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launch.backend import TERMINAL, Handle, tail_lines
from launch.backends.local.orphans import describe, live_hosts
from launch.backends.local.procs import alive as process_alive
from launch.backends.local.supervisor import CANCEL_FILE, STATE_FILE, SUPERVISOR_LOG
from launch.state import read_json

# In the supervisor's command line (`python -m launch.backends.local supervise ...`).
SUPERVISOR_MODULE = "launch.backends.local"


def is_supervisor(pid: int | None) -> bool:
    """Whether `pid` is a live supervisor (not a zombie, not a recycled pid)."""
    if not pid or not process_alive(pid):
        return False
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return True  # no procfs (macOS): the signal check is all there is
    try:
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return SUPERVISOR_MODULE.encode() in cmdline


def _not_started(run_dir: Path, pid: int | None, alive: bool, cancel_asked: bool) -> dict[str, Any]:
    """Status before the supervisor wrote its first state."""
    if alive:
        return {"state": "pending", "detail": "the supervisor is starting", "pid": pid}
    return {
        "state": "cancelled" if cancel_asked else "failed",
        "detail": f"the supervisor (pid {pid}) exited before starting the hosts; "
        f"see {run_dir / SUPERVISOR_LOG}",
        "pid": pid,
    }


def own_state(handle: Handle) -> dict[str, Any] | None:
    """supervisor.json when it is of the handle's submission, else None: a run resubmitted under
    its run_id keeps its folder, and the file there is then another submission's (a handle from
    before submission ids takes the file as it is)."""
    st = read_json(Path(handle.data["run_dir"]) / STATE_FILE)
    wanted = handle.data.get("submission_id")
    if st is not None and wanted is not None and st.get("submission_id") != wanted:
        return None
    return st


def status(handle: Handle) -> dict[str, Any]:
    """The run's state, from supervisor.json and whether the supervisor still lives."""
    run_dir = Path(handle.data["run_dir"])
    st = own_state(handle)
    cancel_asked = (run_dir / CANCEL_FILE).exists()
    if st is None:
        pid = handle.data.get("pid")
        return _not_started(run_dir, pid, is_supervisor(pid), cancel_asked)
    # None until the supervisor's first write: submit wrote the state, the handle has the pid.
    pid = st.get("pid") or handle.data.get("pid")
    out = {
        "state": st["state"],
        "detail": st["detail"],
        "pid": pid,
        "attempt": st["attempt"],
        "restarts": st["restarts"],
        "max_restarts": st["max_restarts"],
        "hosts": st["hosts"],
        "log_dir": str(run_dir / "logs"),
        "supervisor_log": str(run_dir / SUPERVISOR_LOG),
    }
    if st["state"] in ("starting", "restarting"):
        out["state"] = "pending"
    elif st["state"] == "stopping":
        out["state"] = "running"
    if out["state"] not in TERMINAL and not is_supervisor(pid):
        if alive := live_hosts(st):  # what it left still trains: not failed, and cancellable
            note = (
                "`launch cancel` is stopping them"
                if cancel_asked
                else f"nothing restarts them; `launch cancel {st['run_id']}` stops them"
            )
            out["state"], out["supervisor_gone"] = "running", True
            out["detail"] = (
                f"the supervisor (pid {pid}) is gone; {describe(alive)} "
                f"{'is' if len(alive) == 1 else 'are'} still running: {note}"
            )
            return out
        out["state"] = "cancelled" if cancel_asked else "failed"
        out["detail"] = (
            f"the supervisor (pid {pid}) is gone while the run was {st['state']}; "
            f"see {run_dir / SUPERVISOR_LOG}"
        )
    return out


def _attempt_dirs(log_dir: Path, first: int = 0) -> list[tuple[int, Path]]:
    found = []
    for d in log_dir.glob("attempt-*"):
        suffix = d.name.removeprefix("attempt-")
        if suffix.isdigit() and int(suffix) >= first:
            found.append((int(suffix), d))
    return sorted(found)


def _host_files(attempt_dir: Path, host: int | None) -> list[tuple[int, Path]]:
    found = []
    for f in attempt_dir.glob("host-*.log"):
        suffix = f.stem.removeprefix("host-")
        if suffix.isdigit() and (host is None or int(suffix) == host):
            found.append((int(suffix), f))
    return sorted(found)


def logs(
    handle: Handle, *, host: int | None, follow: bool, tail: int | None, since_submission=False
) -> Iterator[str]:
    """Every attempt's host log lines, prefixed `[host N] `; with follow, until the run ends.
    `since_submission`: only the attempts this handle's submission started (not those of an
    earlier submission of the same run_id)."""
    log_dir = Path(handle.data["run_dir"]) / "logs"
    first = handle.data.get("first_attempt", 0) if since_submission else 0
    if not follow:
        yield from _read_all(log_dir, host, tail, first)
        return
    yield from _follow(handle, log_dir, host, tail, first)


def _read_all(log_dir: Path, host: int | None, tail: int | None, first: int = 0) -> Iterator[str]:
    lines: list[tuple[int, str]] = []  # (host, line) in attempt order
    for _, d in _attempt_dirs(log_dir, first):
        for i, f in _host_files(d, host):
            lines += [(i, ln) for ln in f.read_text(errors="replace").splitlines()]
    if tail is not None:
        # Like `kubectl logs --tail`: the last K lines of each host, in the order written.
        per_host: dict[int, list[int]] = {}
        for k, (i, _) in enumerate(lines):
            per_host.setdefault(i, []).append(k)
        keep = {k for ks in per_host.values() for k in tail_lines(ks, tail)}
        lines = [x for k, x in enumerate(lines) if k in keep]
    for i, ln in lines:
        yield f"[host {i}] {ln}"


def _new_data(f: Path, offsets: dict[Path, int]) -> bytes:
    """The bytes appended to `f` since the last read (its offset is then moved on)."""
    with open(f, "rb") as fh:
        fh.seek(offsets.get(f, 0))
        data = fh.read()
    offsets[f] = offsets.get(f, 0) + len(data)
    return data


def _follow(
    handle: Handle, log_dir: Path, host: int | None, tail: int | None, first: int
) -> Iterator[str]:
    """Stream new lines of every attempt's host logs (from attempt `first`) until the run has
    ended."""
    offsets: dict[Path, int] = {}
    partial: dict[Path, bytes] = {}
    if tail is not None:  # start from the last K lines, then follow
        yield from _read_all(log_dir, host, tail, first)
        for _, d in _attempt_dirs(log_dir, first):
            for _, f in _host_files(d, host):
                offsets[f] = f.stat().st_size
    while True:
        ended = status(handle)["state"] in TERMINAL  # before reading: no line is lost
        got = False
        for _, d in _attempt_dirs(log_dir, first):
            for i, f in _host_files(d, host):
                data = _new_data(f, offsets)
                if not data:
                    continue
                got = True
                *complete, rest = (partial.pop(f, b"") + data).split(b"\n")
                if rest:
                    partial[f] = rest
                for ln in complete:
                    yield f"[host {i}] {ln.decode(errors='replace')}"
        if ended and not got:
            for f, rest in partial.items():
                yield f"[host {f.stem.removeprefix('host-')}] {rest.decode(errors='replace')}"
            return
        if not got:
            time.sleep(0.2)
