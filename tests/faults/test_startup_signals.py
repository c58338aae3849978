"""SIGTERM during start-up ends a host with the restartable code 42 and one sentence, not 143.

Three moments before the train loop's own signal handling exists: the main thread running
Python (probing for the coordinator), the main thread blocked in C++ (jax.distributed waiting for
a peer that never comes), and `runtime local` blocked in a library call once jax is imported
(waiting for the run's owner lock). Each test waits until the process is in its moment (seen
from outside: a socket, a listening port, a lock waiter) and holds it there (a coordinator that
never answers, a peer that never comes, a lock the test keeps), so the signal cannot land before
or after it, however slow the machine is.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runs import ROOT, stderr_lines, tiny_config, write_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", *args],
        cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _term_when(
    proc: subprocess.Popen, there: Callable[[], bool], what: str, timeout: float = 180
) -> tuple[int, str, float]:
    """SIGTERM `proc` once `there()` says it is in the moment under test (polled: the start-up
    before it takes as long as the machine's load makes it); the test holds it there."""
    try:
        deadline = time.monotonic() + timeout
        while not there():
            assert proc.poll() is None, (f"it ended before {what}", proc.communicate())
            assert time.monotonic() < deadline, f"it was not {what} after {timeout} s"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _connecting_to(port: int) -> bool:
    """Whether a TCP connect to 127.0.0.1:`port` is waiting for its answer (SYN_SENT, st 02)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(r[3] == "02" and int(r[2].split(":")[1], 16) == port for r in rows)


def _waits_for_lock(pid: int, path: Path) -> bool:
    """Whether process `pid` is blocked waiting for a lock on the file at `path` (/proc/locks
    lists each waiter after "->": FLOCK ADVISORY WRITE <pid> <major:minor:inode> ...)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields:
                at = fields.index("->")
                pid_field, dev_inode = fields[at + 4], fields[at + 5]
                if pid_field == str(pid) and dev_inode.rsplit(":", 1)[1] == str(inode):
                    return True
    return False


def _worker_env(tmp_path: Path, process_id: int, coordinator: str) -> dict[str, str]:
    return {
        "JAXJOB_RUN_ID": "boot", "JAXJOB_NUM_PROCESSES": "2", "JAXJOB_PROCESS_ID": str(process_id),
        "JAXJOB_COORDINATOR": coordinator, "JAXJOB_OUTPUT_URI": str(tmp_path / "runs"),
        "JAXJOB_ATTEMPT": "0",
    }  # fmt: skip


def _assert_restartable(rc: int, err: str) -> None:
    assert rc == 42, err
    lines = [ln for ln in stderr_lines(err) if ln.startswith("error:")]
    assert len(lines) == 1 and "SIGTERM during start-up" in lines[0], err
    assert "Traceback" not in err, err


def test_sigterm_while_blocked_in_cluster_formation(tmp_path, prepared):
    """Process 0 of 2 hosts the coordinator and waits in C++ for process 1, which never starts.

    Its coordination service listens once `jax.distributed.initialize` runs, and the cluster
    never forms (boot_timeout_s is 300 s): from then on it can only be in there."""
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    port = free_port()
    env = _worker_env(tmp_path, 0, f"127.0.0.1:{port}")
    proc = _start(["worker", str(cfg), "--set", "runtime.boot_timeout_s=300"], env)
    rc, err, took = _term_when(proc, lambda: _listening(port), "forming the cluster")
    _assert_restartable(rc, err)
    # The watcher ends it GRACE_S (2 s) after the signal, not the boot timeout (300 s) later:
    # 10x the grace, for a loaded machine.
    assert took < 20, f"took {took:.1f} s to stop"


def test_sigterm_while_probing_for_the_coordinator(tmp_path, prepared):
    """Process 1 of 2 retries a TCP connect to a coordinator nobody runs (Python code).

    The test sees the probe: a listener whose accept queue it filled drops the probe's SYN, so
    the connect waits (SYN_SENT). Then the listener goes, and every later connect is refused at
    once, as with no coordinator at all; boot_timeout_s is 300 s, so it keeps probing."""
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.listen(0)
        filler.connect(("127.0.0.1", port))  # a full accept queue: later SYNs are dropped
        env = _worker_env(tmp_path, 1, f"127.0.0.1:{port}")
        proc = _start(["worker", str(cfg), "--set", "runtime.boot_timeout_s=300"], env)
        deadline = time.monotonic() + 180
        while not _connecting_to(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(("it never probed the coordinator", proc.communicate()))
            time.sleep(0.05)
    # Closed: the connect that waited is refused at its next SYN (and the later ones at once).
    rc, err, _ = _term_when(proc, lambda: not _connecting_to(port), "probing the coordinator")
    _assert_restartable(rc, err)


def test_sigterm_during_local_start_up(tmp_path, prepared):
    """`runtime local` after it imported jax, while it waits for the run's owner lock, which the
    test holds (as a second process on the run would) until the process has ended."""
    run = tmp_path / "runs" / "t"
    run.mkdir(parents=True)
    lock = run / ".owner.lock"  # what runtime/run/owner.py flocks around every owner.json change
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = _start(["local", str(cfg)], {})
        rc, err, _ = _term_when(
            proc, lambda: _waits_for_lock(proc.pid, lock), "waiting for the owner lock"
        )
    finally:
        os.close(fd)
    _assert_restartable(rc, err)
    # Stopped before it claimed the run or read its data: no claim, no step rows.
    assert sorted(p.name for p in run.iterdir()) == [".owner.lock"], list(run.iterdir())


_SWALLOWING_CONTEXTS = """
import os, signal, sys, time
from runtime.host import startup

class Dropper:
    def __del__(self):  # CPython reports exceptions raised here as 'Exception ignored'
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):
            pass

startup.install()
try:
    if sys.argv[1] == "del":
        Dropper()
        time.sleep(60)  # the stop ends it long before (the watcher's grace is 2 s), loaded or not
        print("not stopped")
    else:
        try:  # a library's broad except would swallow the stop: it is not raised in there
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100000):
                pass
        except Exception:
            print("swallowed")
        startup.end()
        print("not stopped")
except startup.StartupInterrupted as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


def test_a_stop_raised_where_python_drops_exceptions_still_stops():
    for where in ("del", "except"):
        proc = subprocess.run(
            [sys.executable, "-c", _SWALLOWING_CONTEXTS, where],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 42, (where, proc.stdout, proc.stderr)
        assert "not stopped" not in proc.stdout and "swallowed" not in proc.stdout, where
        assert "Exception ignored" not in proc.stderr, proc.stderr
        assert "SIGTERM during start-up" in proc.stderr, proc.stderr


_HANDOVER = """
import signal
from runtime.host import startup
from runtime.host.coordination import StopAgreement

startup.install()
stop = StopAgreement(run_id="r", attempt=0)
stop.install()
signal.raise_signal(signal.SIGTERM)  # between the two: the agreement's, not the default
startup.end()
assert stop._signum == signal.SIGTERM, stop._signum
stop.restore()
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGTERM)
print("handed over")
"""


def test_the_train_loop_takes_signals_over_with_no_gap():
    """The agreement installs before start-up lets go, and later restores the original handlers."""
    proc = subprocess.run(
        [sys.executable, "-c", _HANDOVER], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "handed over" in proc.stdout, proc.stderr
