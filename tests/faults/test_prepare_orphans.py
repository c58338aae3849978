"""Issue 28, item 7: `runtime data prepare --workers K` SIGKILLed leaves no process behind.

Its pool workers die with it (PR_SET_PDEATHSIG on Linux, a parent-pid watch elsewhere), and the
multiprocessing resource tracker, whose pipe only they kept open, ends with them.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runs import ROOT

HANG_S = 300  # bounds a hang only: the processes end at once when it works


def _session(sid: int) -> dict[int, str]:
    """pid -> command line of every process in session `sid` (from /proc)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            # Fields after the command name "(...)": state ppid pgrp session ...
            state, _, _, session = stat.rsplit(")", 1)[1].split()[:4]
            if int(session) != sid or state == "Z":  # a zombie has ended, unreaped
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # it ended meanwhile
    return found


def _open_inputs(pid: int, folder: Path) -> bool:
    """Whether process `pid` has a file of `folder` open: it is tokenizing a part."""
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except FileNotFoundError:
        return False
    for name in names:
        try:
            if os.readlink(f"{fds}/{name}").startswith(f"{folder}/"):
                return True
        except FileNotFoundError:
            continue
    return False


def _inputs(folder: Path, files: int = 4) -> Path:
    """`files` .jsonl.gz inputs of ~150 MB of text each, ~0.5 MB on disk (one gzip member of
    10 MB, repeated: gzip reads concatenated members as one stream). Tokenizing a part takes
    far longer than the test needs to see both workers at work."""
    folder.mkdir()
    line = (json.dumps({"text": "lorem ipsum dolor sit amet " * 40}) + "\n").encode()
    member = gzip.compress(line * 10_000, compresslevel=1)
    for i in range(files):
        (folder / f"in-{i}.jsonl.gz").write_bytes(member * 15)
    return folder


def test_workers_and_tracker_end_with_a_killed_prepare(tmp_path):
    inputs = _inputs(tmp_path / "in")
    cmd = [sys.executable, "-m", "runtime", "data", "prepare", "--input", f"{inputs}/*.jsonl.gz",
           "--out", str(tmp_path / "ds"), "--workers", "2", "--part-size", "1K", "--no-progress"]  # fmt: skip
    # Its own session: every process it starts (workers, tracker) carries its id.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    sid = proc.pid
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + HANG_S
        while True:  # an event: both workers are reading their parts
            assert proc.poll() is None, ("it ended before its workers ran", proc.stderr.read())
            seen = _session(sid)
            workers = [p for p, c in seen.items() if "--multiprocessing-fork" in c]
            if len([p for p in workers if _open_inputs(p, inputs)]) >= 2:
                break
            assert time.monotonic() < deadline, f"two workers did not start in {HANG_S} s"
            time.sleep(0.05)
        assert any("resource_tracker" in c for c in seen.values()), seen
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + HANG_S
        while left := _session(sid):
            assert time.monotonic() < deadline, f"left behind {HANG_S} s after the kill: {left}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        proc.stderr.close()
        for pid in _session(sid):  # what the prepare left behind (the bug): stopped here
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# Where PR_SET_PDEATHSIG is missing, a worker watches its parent's pid: a process made to rely
# on that alone, whose parent is then SIGKILLed.
WATCHER = """
import os, sys, time
import runtime.data.prepare.workers as w
w._death_signal = lambda: False  # as off Linux: the pid watch is all there is
w.exit_with_parent(os.getppid())
open(sys.argv[1], "w").close()
time.sleep(600)
"""
PARENT = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"


def test_without_the_death_signal_a_worker_watches_its_parent(tmp_path):
    ready = tmp_path / "watching"
    proc = subprocess.Popen([sys.executable, "-c", PARENT, WATCHER, str(ready)], cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    sid = proc.pid
    try:
        deadline = time.monotonic() + HANG_S
        while not ready.exists():  # an event: the child is past exit_with_parent
            assert proc.poll() is None, "the parent ended early"
            assert time.monotonic() < deadline, f"the child did not start in {HANG_S} s"
            time.sleep(0.05)
        assert len(_session(sid)) == 2
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + HANG_S
        while left := _session(sid):
            assert time.monotonic() < deadline, f"left behind {HANG_S} s after the kill: {left}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        for pid in _session(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
