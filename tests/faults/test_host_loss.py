"""A stalled host is the one blamed, and a run whose local supervisor died stays under control.

The faults are real: a host process is SIGSTOPped (it keeps its sockets, so no peer sees a
reset, exactly like a frozen machine), and the supervisor is SIGKILLed. The first test runs the
real runtime, the second a bare two-process cluster (boot only); the others run stand-in hosts (a
few lines of Python, no jax) under the real supervisor, so that the states they need (a peer
aborted by a signal while the stalled host is stopped, hosts that ignore SIGTERM, a host with a
child of its own) are certain and quick.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from multihost import Hosts
from test_launch_local import (
    kill_leftovers,
    launch,
    status,
    submit,
    supervisor_state,
    wait_for,
    write_job,
)

from jobspec.exit_codes import EXIT_HOST_LOST
from launch.registry import Registry, RunRecord
from launch.state import utc_now

from runs import ROOT, read_jsonl

TERMINAL = ("succeeded", "failed", "cancelled")
# The trained job decays over 20 steps however long it could train: the suite's two-host train
# step program, compiled once per session (XLA's persistent cache), not once more for 5,000.
SCHEDULE = {"schedule": {"decay_steps": 20}}

# The process states come from /proc, and hosts learn of their supervisor's death from Linux.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")


@pytest.fixture
def state(tmp_path):
    s = tmp_path / "state"
    yield s
    kill_leftovers(s)


def _proc_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (T: stopped, Z: zombie); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _gone(pid: int) -> bool:
    return _proc_state(pid) in (None, "Z")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_a_stopped_host_is_named_and_the_attempt_ends_43(tmp_path, prepared, state):
    """Host 1 is SIGSTOPped mid-training: host 0's watchdog ends it with 43 (not a JAX abort),
    and the supervisor's sentence, its attempt record and the run's events name host 1."""
    job = write_job(
        tmp_path, prepared, "stall", steps=5000, training={"log_every": 1}, optimizer=SCHEDULE,
        runtime={"host_loss_timeout_s": 5, "boot_timeout_s": 60},
    )  # fmt: skip
    spec = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump({**spec, "max_restarts": 0}))
    run_id = submit(job, state)
    run_uri = Path(status(run_id, state)["run_uri"])
    train = run_uri / "metrics" / "train.jsonl"
    wait_for(lambda: train.exists() and len(read_jsonl(train)) >= 2, 300, "step 2")
    stalled = supervisor_state(state, run_id)["hosts"][1]["pid"]
    os.kill(stalled, signal.SIGSTOP)
    try:
        final = wait_for(
            lambda: (s := supervisor_state(state, run_id))["state"] in TERMINAL and s,
            300,
            "the attempt to end",
        )
    finally:
        _kill(stalled)
    assert final["state"] == "failed", final
    assert final["detail"].startswith("host 1 stopped responding"), final["detail"]
    assert f"exit {EXIT_HOST_LOST}" in final["detail"], final["detail"]
    attempt = final["attempts"][0]
    # The healthy host ended by its own watchdog with 43, before JAX could abort it.
    assert attempt["returncodes"][0] == EXIT_HOST_LOST, attempt
    assert attempt["failure"]["host"] == 1 and attempt["failure"]["exit_code"] == EXIT_HOST_LOST
    # The run's own record says which host was lost, for `launch status` and anyone reading it.
    failures = [e for e in read_jsonl(run_uri / "events.jsonl") if e["event"] == "failure"]
    assert len(failures) == 1, failures
    assert failures[0]["host"] == 1 and failures[0]["exit_code"] == EXIT_HOST_LOST
    assert "host 1 stopped responding" in failures[0]["error"]
    human = launch("status", run_id, state=state).stdout
    assert "failed  host 1 stopped responding" in human, human
    assert "last event  failure" in human, human


# A cluster of two that only boots (runtime.host.boot) and waits: no watchdog, so what ends the
# survivor of a stopped peer is JAX's own heartbeat timeout.
BOOT_AND_WAIT = """
import sys, time
from runtime.host import boot
boot.boot(timeout_s=60, heartbeat_timeout_s=int(sys.argv[1]))
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_jax_gives_a_stopped_host_up_no_sooner_than_boots_heartbeat_timeout():
    """JAX aborts no survivor sooner than boot's heartbeat_timeout_s after a peer stops, so the
    watchdog (its timeout is below that) always speaks first. Host 1 stops just after joining,
    just after its first heartbeat, and JAX gives it up one JAX timeout after that heartbeat:
    about `beat` s when JAX's timeout was heartbeat_timeout_s itself (half that in another
    phase), about twice `beat` now."""
    # Measured under load: aborted 2 x beat (+0.5 s) after the stop; the bound, 1.5 x beat,
    # leaves beat / 2 (5 s) for the lag between host 1's heartbeat and the test's SIGSTOP.
    beat = 10
    with Hosts([sys.executable, "-c", BOOT_AND_WAIT, str(beat)], 2, 1) as hosts:
        for i in (0, 1):
            hosts.wait_for_output(i, "READY", timeout=120)
        hosts.signal(1, signal.SIGSTOP)
        stopped = time.monotonic()
        (survivor,) = hosts.wait(timeout=4 * beat + 60, only=[0])
    took = survivor.elapsed - (stopped - hosts.started)
    print(f"host 0 was aborted {took:.1f} s after host 1 stopped")
    assert survivor.returncode == -signal.SIGABRT, survivor.output[-3000:]
    assert took > 1.5 * beat, f"JAX gave the stopped host up after {took:.1f} s"


# ---- stand-in hosts under the real supervisor ---------------------------------------------------


def stand_in_run(tmp: Path, script: str, *, max_restarts: int = 0, cancel_grace: int = 5) -> Path:
    """A registry with one local run (record.json, plan.json) whose hosts run `script`; the
    run's artifacts would be under tmp/out/<run_id>."""
    run_id = "standin-a1b2c3"
    registry = Registry(tmp / "state" / "jaxjob")
    run_dir = registry.run_dir(run_id)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    env = {"JAXJOB_RUN_ID": run_id, "JAXJOB_OUTPUT_URI": str(tmp / "out")}
    plan = {
        "run_id": run_id, "cwd": str(tmp), "processes": 2, "max_restarts": max_restarts,
        "grace_s": {"cancel": cancel_grace, "failure": 60},
        "hosts": [{"index": i, "command": cmd, "env": {**env, "JAXJOB_PROCESS_ID": str(i)},
                   "env_from_shell": []} for i in range(2)],
    }  # fmt: skip
    (run_dir / "plan.json").write_text(json.dumps(plan))
    return run_dir


def record(run_dir: Path, pid: int) -> str:
    """Make the run known to `launch` as a submit would (the supervisor's pid in its handle)."""
    run_id = run_dir.name
    handle = {"pid": pid, "run_dir": str(run_dir), "log_dir": str(run_dir / "logs")}
    rec = RunRecord(run_id, "local", handle, str(run_dir.parents[3] / "out"), utc_now(), "job")
    Registry(run_dir.parents[1]).record(rec)
    return run_id


def start_supervisor(run_dir: Path) -> subprocess.Popen:
    # As submit starts it: its own session, so it leads the process group of its hosts.
    return subprocess.Popen(
        [sys.executable, "-m", "launch.backends.local", "supervise", str(run_dir)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


# Host 1 writes its pid and stops itself (SIGSTOP); host 0 waits until it is stopped and then
# dies by SIGABRT, as JAX aborts a healthy peer when its coordination service gives up first.
STOP_AND_ABORT = """
    import os, pathlib, signal, time
    me = os.environ["JAXJOB_PROCESS_ID"]
    if me == "1":
        pathlib.Path("host-1.pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    while not os.path.exists("host-1.pid"):
        time.sleep(0.05)
    peer = int(pathlib.Path("host-1.pid").read_text())
    while pathlib.Path(f"/proc/{peer}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.05)
    os.abort()
"""


def test_a_stopped_host_is_named_when_a_peer_was_aborted_first(tmp_path):
    run_dir = stand_in_run(tmp_path, STOP_AND_ABORT)
    sup = start_supervisor(run_dir)
    try:
        assert sup.wait(timeout=120) == 1
    finally:
        _kill(sup.pid)
        if (tmp_path / "host-1.pid").exists():
            _kill(int((tmp_path / "host-1.pid").read_text()))
    st = json.loads((run_dir / "supervisor.json").read_text())
    assert st["state"] == "failed", st
    detail = st["detail"]
    assert detail.startswith("host 1 stopped responding"), detail
    assert "is stopped" in detail and f"exit {EXIT_HOST_LOST}" in detail, detail
    assert "host 0 killed by SIGABRT" in detail, detail  # what was seen first is kept
    attempt = st["attempts"][0]
    assert attempt["returncodes"][0] == -signal.SIGABRT, attempt
    assert attempt["failure"]["host"] == 1 and attempt["failure"]["exit_code"] == EXIT_HOST_LOST
    events = read_jsonl(tmp_path / "out" / run_dir.name / "events.jsonl")
    assert [(e["event"], e["host"], e["exit_code"]) for e in events] == [
        ("failure", 1, EXIT_HOST_LOST)
    ]


# Both hosts ignore SIGTERM (as a host stuck in a collective or a hung file system does) and
# write their pid; host 0 also starts a child of its own, which the run's cancel must end too.
STUCK_HOSTS = """
    import os, pathlib, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me = os.environ["JAXJOB_PROCESS_ID"]
    if me == "0":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pathlib.Path("child.pid").write_text(str(child.pid))
    pathlib.Path(f"host-{me}.pid").write_text(str(os.getpid()))
    time.sleep(600)
"""


def test_after_the_supervisor_is_killed_status_says_running_and_cancel_ends_every_host(tmp_path):
    run_dir = stand_in_run(tmp_path, STUCK_HOSTS, cancel_grace=3)
    state = tmp_path / "state"
    sup = start_supervisor(run_dir)
    pids: list[int] = []
    try:
        run_id = record(run_dir, sup.pid)
        names = ("host-0.pid", "host-1.pid", "child.pid")
        wait_for(lambda: all((tmp_path / n).exists() for n in names), 120, "the hosts to start")
        pids = [int((tmp_path / n).read_text()) for n in names]
        sup.kill()
        sup.wait(timeout=60)
        assert not any(_gone(p) for p in pids)
        st = status(run_id, state)
        assert st["state"] == "running", st
        assert f"the supervisor (pid {sup.pid}) is gone" in st["detail"], st["detail"]
        assert f"{pids[0]}" in st["detail"] and f"launch cancel {run_id}" in st["detail"]
        r = launch("cancel", run_id, "--wait", state=state, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "has already ended" not in r.stdout
        wait_for(lambda: all(_gone(p) for p in pids), 120, "every host process to end")
        st = status(run_id, state)
        assert st["state"] == "cancelled", st
    finally:
        _kill(sup.pid)
        for p in pids:
            _kill(p)


# Hosts that stop on SIGTERM (the runtime's hosts checkpoint and exit 42): they must not keep
# running once their supervisor is gone.
TERM_STOPS_HOSTS = """
    import os, pathlib, time
    pathlib.Path(f"host-{os.environ['JAXJOB_PROCESS_ID']}.pid").write_text(str(os.getpid()))
    time.sleep(600)
"""


def test_hosts_do_not_outlive_a_killed_supervisor(tmp_path):
    run_dir = stand_in_run(tmp_path, TERM_STOPS_HOSTS)
    sup = start_supervisor(run_dir)
    pids: list[int] = []
    try:
        names = ("host-0.pid", "host-1.pid")
        wait_for(lambda: all((tmp_path / n).exists() for n in names), 120, "the hosts to start")
        pids = [int((tmp_path / n).read_text()) for n in names]
        sup.kill()
        sup.wait(timeout=60)
        wait_for(lambda: all(_gone(p) for p in pids), 120, "the hosts to stop by themselves")
    finally:
        _kill(sup.pid)
        for p in pids:
            _kill(p)
