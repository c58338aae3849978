"""A host never blocks on its own log, and a host that stops advancing ends the job.

The faults are real: the host log lives on a tmpfs filled to the last byte (every write fails
with ENOSPC), the terminal is a pipe whose reader closed (EPIPE) or never reads, and the frozen
host is the writer host whose `metrics/train.jsonl` is swapped, mid-run, for a FIFO nobody
reads: its next append blocks in open(2) for ever, exactly as a write to a hung NFS or FUSE
mount does, while its process, its heartbeat thread and JAX's heartbeat stay alive. Swapping
with a hard link first keeps every row written so far, so the restarted run can be checked for
lost or doubled rows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from faults.conftest import fill
from multihost import run_hosts
from test_launch_local import (
    kill_leftovers,
    launch,
    status,
    submit,
    supervisor_state,
    wait_for,
    write_job,
)

from runtime.host.coordination import _View, stalled_hosts
from runtime.host.hostlog import LOG_DEFER_BYTES

from runs import ROOT, read_jsonl, tiny_config, write_config

WARNING = "dropping log lines until it can be written"
# Both trained jobs here decay over 20 steps, whatever they train: one two-host train step
# program, compiled once per session (XLA's persistent cache) instead of once per length.
SCHEDULE = {"schedule": {"decay_steps": 20}}
TERMINAL = ("succeeded", "failed", "cancelled")

# A host program without jax: tees its output to argv[1] and prints argv[2] bytes of numbered
# lines to stdout and stderr; with argv[3] (a filler file), frees the disk and prints a line
# until one reaches the log again.
TEE_SCRIPT = textwrap.dedent(r"""
    import os, sys, time
    from runtime.host.hostlog import HostLogTee
    log, size = sys.argv[1], int(sys.argv[2])
    sys.stdout.reconfigure(line_buffering=True)  # whole lines per write: the log interleaves lines
    HostLogTee(log).start()
    line = "x" * 90
    for i in range(size // 100):
        sys.stdout.write(f"out {i:06d} {line}\n")  # one write per line, newline included
        if i % 50 == 0:
            sys.stderr.write(f"err {i:06d}\n")
    sys.stdout.flush()
    if len(sys.argv) > 3:
        os.remove(sys.argv[3])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the backlog is written and lines get in again
            print("after the disk was freed")
            with open(log, "rb") as f:
                if b"after the disk was freed" in f.read():
                    break
            time.sleep(0.2)
    print("the end", flush=True)
""")


@pytest.fixture
def state(tmp_path):
    s = tmp_path / "state"
    yield s
    kill_leftovers(s)


def _tee(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", TEE_SCRIPT, *args], cwd=ROOT, env=env, **popen)


def test_full_log_disk_defers_drops_and_recovers(small_fs, tmp_path):
    # Freeing the disk gives back its whole size: twice the most the log sink holds back, so the
    # backlog, the marker and the lines after it fit. A disk of exactly LOG_DEFER_BYTES could
    # fill up again with the backlog and start a second outage (seen once in CI).
    disk = small_fs(f"{2 * LOG_DEFER_BYTES >> 10}k")
    fill(disk)
    log = os.path.join(disk, "host-0.log")
    t0 = time.monotonic()
    proc = _tee(log, str(3 << 20), os.path.join(disk, ".filler"), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert time.monotonic() - t0 < 60
    # The terminal copy kept flowing: every line, in order.
    lines = out.decode().splitlines()
    outs = [ln for ln in lines if ln.startswith("out ")]
    assert [int(ln.split()[1]) for ln in outs] == list(range((3 << 20) // 100))
    assert lines[-2:] == ["after the disk was freed", "the end"], lines[-3:]
    # Said once on the original stderr, with the path and the reason; and once on recovery.
    warns = [ln for ln in err.decode().splitlines() if WARNING in ln]
    assert warns == [f"warning: cannot write host log {log}: No space left on device; {WARNING}"], (
        err.decode()[-2000:]
    )
    recovered = [ln for ln in err.decode().splitlines() if "can be written again" in ln]
    assert len(recovered) == 1 and "lines (" in recovered[0], err.decode()[-2000:]
    dropped_lines = int(recovered[0].split("; ")[1].split(" lines")[0])
    assert dropped_lines > 0
    # The log holds what was deferred, a marker where lines are missing, and what came after.
    text = Path(log).read_text()
    assert "\nout 000000 " in text or text.startswith("out 000000 ")
    assert text.count("[jaxjob: ") == 1, "one outage, one gap"
    assert f"[jaxjob: {dropped_lines} lines (" in text
    assert "dropped here: host log" in text and "No space left on device" in text
    assert "\nthe end\n" in text


def test_vanished_or_stalled_terminal_never_blocks(tmp_path):
    # The reader went away: writes to the original stdout fail with EPIPE.
    quiet = {"stderr": subprocess.DEVNULL}
    gone = _tee(str(tmp_path / "gone.log"), str(2 << 20), stdout=subprocess.PIPE, **quiet)
    gone.stdout.close()
    assert gone.wait(timeout=60) == 0
    log = (tmp_path / "gone.log").read_text()
    assert len(re.findall(r"^out \d{6} x+$", log, re.M)) == (2 << 20) // 100
    assert "\nthe end\n" in log
    assert "warning: cannot write the original stdout: Broken pipe" in log
    # A reader that never reads (a stopped terminal): the host still finishes, and its log is whole.
    t0 = time.monotonic()
    stalled = _tee(str(tmp_path / "stalled.log"), str(4 << 20), stdout=subprocess.PIPE, **quiet)
    try:
        assert stalled.wait(timeout=60) == 0
    finally:
        stalled.stdout.close()
    assert time.monotonic() - t0 < 60
    log = (tmp_path / "stalled.log").read_text()
    assert len(re.findall(r"^out \d{6} x+$", log, re.M)) == (4 << 20) // 100
    assert "warning: the original stdout is not taking output; dropping log lines" in log
    assert "\nthe end\n" in log


@pytest.mark.slow
def test_one_hosts_full_log_disk_does_not_stop_training(small_fs, tmp_path, prepared):
    """Before the fix the tee thread died on ENOSPC and the job froze once the pipe filled."""
    steps = 4

    def run(name: str, full_log: bool) -> list[float]:
        over = {"mesh": {"data": 2}, "training": {"target_tokens": 16 * 8 * steps},
                "optimizer": SCHEDULE,
                "runtime": {"host_loss_timeout_s": 20, "boot_timeout_s": 60}}  # fmt: skip
        cfg = write_config(tmp_path / f"{name}.toml",
                           tiny_config(prepared, str(tmp_path / "runs"), run_id=name, **over))  # fmt: skip
        logs = tmp_path / "runs" / name / "logs" / "attempt-0"
        if full_log:  # host 1's log file lives on a disk with no byte left
            disk = small_fs("1m")
            fill(disk)
            logs.mkdir(parents=True)
            os.symlink(os.path.join(disk, "host-1.log"), logs / "host-1.log")
        results = run_hosts(["worker", str(cfg)], 2, 1, env={"JAXJOB_RUN_ID": name}, timeout=300)
        for r in results:
            assert r.returncode == 0, f"host {r.process_id}: {r.returncode}\n{r.output[-3000:]}"
            assert f"step: {steps} " in r.stdout, r.stdout[-2000:]
        warns = [ln for ln in results[1].stderr.splitlines() if WARNING in ln]
        if full_log:
            assert warns == [
                f"warning: cannot write host log {logs / 'host-1.log'}: No space left on "
                f"device; {WARNING}"
            ]
            assert f"step: {steps} " in (logs / "host-0.log").read_text()
        else:
            assert warns == []
        rows = read_jsonl(tmp_path / "runs" / name / "metrics/train.jsonl")
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        return [r["loss"] for r in rows]

    assert run("full", True) == run("clean", False)


@pytest.mark.slow
def test_frozen_writer_ends_the_attempt_with_43_and_the_job_restarts(tmp_path, prepared, state):
    timeout_s, steps = 5, 10
    job = write_job(
        tmp_path, prepared, "frozen", steps=steps, checkpoint={"every": 2, "keep": 2},
        optimizer=SCHEDULE, runtime={"host_loss_timeout_s": timeout_s, "boot_timeout_s": 60},
    )  # fmt: skip
    spec = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump({**spec, "max_restarts": 1}))
    run_id = submit(job, state)
    run_uri = Path(status(run_id, state)["run_uri"])
    metrics = run_uri / "metrics"
    wait_for(
        lambda: (
            (metrics / "train.jsonl").exists() and len(read_jsonl(metrics / "train.jsonl")) >= 3
        ),
        180,
        "step 3",
    )
    # Freeze the writer: its next append opens a FIFO nobody reads and blocks in open(2).
    os.link(metrics / "train.jsonl", metrics / "rows")
    os.mkfifo(metrics / "fifo")
    os.replace(metrics / "fifo", metrics / "train.jsonl")
    frozen_at = time.monotonic()
    # The attempt ends on its own (today it hung with `launch status` saying running).
    wait_for(lambda: (supervisor_state(state, run_id) or {}).get("attempts"), 60, "attempt 0 end")
    took = time.monotonic() - frozen_at
    os.replace(metrics / "rows", metrics / "train.jsonl")  # the disk "comes back" for attempt 1
    first = supervisor_state(state, run_id)["attempts"][0]
    assert first["outcome"] == "restart" and "exit 43" in first["detail"], first
    # Every host exits 43 by its own watchdog, except that a host may first be aborted by JAX
    # (a signal death, restartable too) when the stalled host was host 0, whose exit takes the
    # coordination service with it.
    codes = first["returncodes"]
    assert 43 in codes and all(c == 43 or c < 0 for c in codes), first
    assert took < timeout_s + 20, f"the attempt needed {took:.0f} s to end"
    logs = state / "jaxjob" / "runs" / run_id / "logs" / "attempt-0"
    writer = int((logs / "host-0.log").read_text().split("writer is host ")[1].split()[0])
    other = 1 - writer
    assert (
        f"error: this host (host {writer} of 2) stopped advancing: no progress past step"
        in (logs / f"host-{writer}.log").read_text()
    )
    if codes[other] == 43:
        assert (
            f"error: host {writer} of 2 stopped advancing: no progress past step"
            in (logs / f"host-{other}.log").read_text()
        )

    # The supervisor's own file, not `launch status` (a process per look) until the run ends.
    wait_for(
        lambda: supervisor_state(state, run_id)["state"] in TERMINAL,
        240,
        "the restarted run to end",
    )
    final = status(run_id, state)
    assert final["state"] == "succeeded", final
    assert final["backend_status"]["restarts"] == 1
    human = launch("status", run_id, state=state).stdout
    assert "succeeded" in human and "running" not in human, human
    # Nothing committed was lost or doubled: every step's row once, in order.
    assert [r["step"] for r in read_jsonl(metrics / "train.jsonl")] == list(range(1, steps + 1))
    kinds = [e["event"] for e in read_jsonl(run_uri / "events.jsonl")]
    assert kinds.count("resume") == 1 and kinds[-1] == "finish", kinds


def _view(phase: str, step: int, seq: int = 0, idle_s: float = 0.0) -> _View:
    return _View(phase=phase, step=step, seq=seq, moves=1, moved_at=100.0 - idle_s)


def test_stall_rule_names_the_host_everybody_waits_for():
    now, t = 100.0, 5.0
    # Host 1 is stuck between steps; host 0 passed that point and waits in the next collective.
    assert stalled_hosts(
        {0: _view("step", 8, idle_s=9), 1: _view("step", 7, idle_s=9)}, now, t
    ) == [1]
    # Not yet past the timeout, or still moving (its device finishing queued steps).
    assert (
        stalled_hosts({0: _view("step", 8, idle_s=9), 1: _view("step", 7, idle_s=4)}, now, t) == []
    )
    # The host behind is compiling its first step, evaluating or saving: slow, not stalled.
    for slow in ("start", "eval", "checkpoint", "finish", "failing"):
        views = {0: _view("step", 8, idle_s=60), 1: _view(slow, 7, idle_s=60)}
        assert stalled_hosts(views, now, t) == [], slow
    # Same step, later program point: host 0 waits in the save host 1 never reached.
    views = {0: _view("checkpoint", 8, seq=1, idle_s=9), 1: _view("step", 8, seq=0, idle_s=9)}
    assert stalled_hosts(views, now, t) == [1]
    # Every host stuck at the same point: all of them are named.
    views = {0: _view("step", 8, idle_s=9), 1: _view("step", 8, idle_s=9)}
    assert stalled_hosts(views, now, t) == [0, 1]
