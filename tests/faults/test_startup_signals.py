"""SIGTERM during start-up ends a host with the restartable code 42 and one sentence, not 143.

Three moments before the train loop's own signal handling exists: the main thread running
Python (probing for the coordinator), the main thread blocked in C++ (jax.distributed waiting for
a peer that never comes), and `runtime local` importing/building/compiling.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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


def _term_after(proc: subprocess.Popen, seconds: float) -> tuple[int, str, float]:
    time.sleep(seconds)
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.monotonic() - sent


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
    """Process 0 of 2 hosts the coordinator and waits in C++ for process 1, which never starts."""
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    env = _worker_env(tmp_path, 0, f"127.0.0.1:{free_port()}")
    proc = _start(["worker", str(cfg), "--set", "runtime.boot_timeout_s=300"], env)
    rc, err, took = _term_after(proc, 12)
    _assert_restartable(rc, err)
    assert took < 20, f"took {took:.1f} s to stop"


def test_sigterm_while_probing_for_the_coordinator(tmp_path, prepared):
    """Process 1 of 2 retries a TCP connect to a coordinator nobody runs (Python code)."""
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    env = _worker_env(tmp_path, 1, f"127.0.0.1:{free_port()}")
    proc = _start(["worker", str(cfg), "--set", "runtime.boot_timeout_s=300"], env)
    rc, err, _ = _term_after(proc, 8)
    _assert_restartable(rc, err)


def test_sigterm_during_local_start_up(tmp_path, prepared):
    cfg = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path / "runs")))
    proc = _start(["local", str(cfg)], {})
    rc, err, _ = _term_after(proc, 2)
    _assert_restartable(rc, err)
    # Nothing was trained, so nothing claims to have been: no step rows.
    assert not (tmp_path / "runs/t/metrics/train.jsonl").exists()


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
        time.sleep(10)
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
            cwd=ROOT, capture_output=True, text=True, timeout=60,
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
