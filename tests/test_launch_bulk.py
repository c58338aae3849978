"""`launch list` with filters, `launch cancel --all|--name|--status` and `launch clean`, through
the CLI, on local runs made by hand: registry records and supervisor state files, and for a
running run a stand-in supervisor process (its command line names the supervisor module, as
status checks; on SIGTERM it records the run as cancelled, as the real one does once its hosts
have checkpointed). The real local cancel path is tests/test_launch_local.py's; the k8s and
SLURM listings are tests/test_launch_bulk_k8s.py's and tests/test_launch_slurm.py's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from test_launch_local import launch

from launch.backends.local.supervisor import STATE_FILE, State
from launch.registry import Registry, RunRecord

FAKE_SUPERVISOR = """
import json, signal, sys, time
state = sys.argv[1]
def stop(*_):
    st = json.load(open(state))
    st.update(state="cancelled", detail="cancelled by SIGTERM")
    json.dump(st, open(state + ".tmp", "w"))
    import os; os.replace(state + ".tmp", state)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[2], "w").close()  # the handler is in place
while True:
    time.sleep(60)
"""


def _stamp(ago: timedelta) -> str:
    return (datetime.now(UTC) - ago).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Runs:
    """Local runs in a registry under `state`, each with an artifacts folder that must stay."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.registry = Registry(state / "jaxjob")
        self.procs: list[subprocess.Popen] = []

    def add(self, run_id: str, state: str, ago: timedelta = timedelta(minutes=5)) -> Path:
        run_dir = self.registry.run_dir(run_id)
        run_dir.mkdir(parents=True)
        out = self.state / "out"
        (out / run_id).mkdir(parents=True)
        (out / run_id / "manifest.json").write_text("{}")
        sid = f"local-{run_id}"
        pid = None
        if state == "running":
            ready = run_dir / "ready"
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    FAKE_SUPERVISOR,
                    str(run_dir / STATE_FILE),
                    str(ready),
                    "launch.backends.local",
                ]
            )
            self.procs.append(proc)
            pid = proc.pid
        st = State(run_id=run_id, pid=pid, max_restarts=0, submission_id=sid, state=state,
                   detail=f"{state} by hand")  # fmt: skip
        (run_dir / STATE_FILE).write_text(json.dumps(asdict(st)))
        self.registry.record(
            RunRecord(run_id=run_id, backend="local",
                      handle={"run_dir": str(run_dir), "submission_id": sid, "pid": pid},
                      output_uri=str(out), submitted=_stamp(ago), job_path="/nonexistent.yaml")
        )  # fmt: skip
        if state == "running":
            _wait_for(lambda: ready.exists(), "the stand-in supervisor to start")
        return out / run_id

    def state_of(self, run_id: str) -> str:
        return json.loads((self.registry.run_dir(run_id) / STATE_FILE).read_text())["state"]

    def launch(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        if stdin is None:
            return launch(*args, state=self.state)
        import os

        from test_launch_local import ROOT

        env = {**os.environ, "XDG_STATE_HOME": str(self.state)}
        return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                              input=stdin, capture_output=True, text=True, timeout=300)  # fmt: skip


def _wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def runs(tmp_path):
    r = Runs(tmp_path)
    yield r
    for p in r.procs:
        p.kill()
        p.wait()


def _ids(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    assert lines[0].split() == ["RUN", "BACKEND", "STATE", "SUBMITTED", "(UTC)", "WHERE"], lines
    return [ln.split()[0] for ln in lines[1:]]


def test_list_filters_by_state_name_and_age(runs):
    runs.add("sweep-a1", "succeeded", timedelta(hours=3))
    runs.add("sweep-b2", "failed", timedelta(minutes=30))
    runs.add("solo-c3", "running", timedelta(minutes=1))
    every = runs.launch("list")
    assert every.returncode == 0, every.stderr
    assert _ids(every.stdout) == ["solo-c3", "sweep-b2", "sweep-a1"]  # newest first
    row = every.stdout.splitlines()[1].split()
    assert row[1:3] == ["local", "running"] and row[-1] == "here"
    assert _ids(runs.launch("list", "--status", "ended").stdout) == ["sweep-b2", "sweep-a1"]
    assert _ids(runs.launch("list", "--status", "failed,running").stdout) == ["solo-c3", "sweep-b2"]
    assert _ids(runs.launch("list", "--status", "active").stdout) == ["solo-c3"]
    assert _ids(runs.launch("list", "--name", "sweep-*").stdout) == ["sweep-b2", "sweep-a1"]
    assert _ids(runs.launch("list", "--since", "1h").stdout) == ["solo-c3", "sweep-b2"]
    assert _ids(runs.launch("list", "--backend", "local", "--name", "*a1").stdout) == ["sweep-a1"]
    none = runs.launch("list", "--status", "cancelled")
    assert none.returncode == 0 and none.stdout.strip() == "no runs match"
    rows = json.loads(runs.launch("list", "--json", "--name", "sweep-b2").stdout)
    assert [(r["run_id"], r["state"], r["submitted_here"], r["where"]) for r in rows] == [
        ("sweep-b2", "failed", True, "here")
    ]
    assert rows[0]["run_uri"] == str(runs.state / "out" / "sweep-b2")


@pytest.mark.parametrize(
    "args, message",
    [
        (("list", "--status", "done"), "--status 'done' is not a state; use one or more of"),
        (("list", "--since", "soon"), "--since 'soon' is not a duration"),
        (("list", "--namespace", "ml"), "--namespace applies only with --backend k8s"),
        (("cancel",), "give the run to cancel (launch cancel RUN), or --all"),
        (("cancel", "some-run", "--all"), "give RUN or a selection"),
        (("cancel", "--all", "--status", "failed"), "only pending or running runs can be"),
        (("clean", "--status", "running"), "clean removes ended runs only"),
        (("clean", "--older-than", "x"), "--older-than 'x' is not a duration"),
    ],
)
def test_bad_selections_are_one_sentence(runs, args, message):
    r = runs.launch(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_cancel_all_asks_first_and_cancels_only_active_runs(runs):
    runs.add("job-a1", "running")
    runs.add("job-b2", "running")
    runs.add("other-c3", "running")
    done = runs.add("job-d4", "succeeded")
    # No answer (stdin closed): nothing is cancelled, exit 1.
    r = runs.launch("cancel", "--all", "--name", "job-*", stdin="")
    assert r.returncode == 1, r.stderr
    assert _ids(r.stdout) == ["job-b2", "job-a1"] or _ids(r.stdout) == ["job-a1", "job-b2"]
    assert "Cancel these 2 run(s)? [y/N]" in r.stderr and "nothing cancelled" in r.stderr
    assert all(p.poll() is None for p in runs.procs)
    # "n" is no either.
    assert runs.launch("cancel", "--all", "--name", "job-*", stdin="n\n").returncode == 1
    # A yes: both job-* runs, not the other one, not the ended one.
    r = runs.launch("cancel", "--all", "--name", "job-*", "--wait", stdin="y\n")
    assert r.returncode == 0, r.stderr
    assert sorted(ln for ln in r.stdout.splitlines() if ln.startswith("cancel sent")) == [
        "cancel sent to job-a1: its hosts checkpoint and stop",
        "cancel sent to job-b2: its hosts checkpoint and stop",
    ]
    assert [runs.state_of(i) for i in ("job-a1", "job-b2", "other-c3", "job-d4")] == [
        "cancelled", "cancelled", "running", "succeeded"
    ]  # fmt: skip
    assert done.is_dir()
    # --yes asks nothing; --all alone takes every active run left.
    r = runs.launch("cancel", "--all", "--yes", "--wait")
    assert r.returncode == 0 and "[y/N]" not in r.stderr, r.stderr
    assert runs.state_of("other-c3") == "cancelled"
    r = runs.launch("cancel", "--all", "--yes")
    assert r.stdout.strip() == "no pending or running runs match; nothing to cancel"


def test_clean_removes_ended_records_and_never_artifacts(runs):
    kept = runs.add("live-a1", "running")
    old = runs.add("old-b2", "failed", timedelta(days=3))
    new = runs.add("new-c3", "succeeded", timedelta(minutes=10))
    # Asked and refused: nothing goes.
    r = runs.launch("clean", stdin="")
    assert r.returncode == 1 and "nothing removed" in r.stderr
    assert _ids(r.stdout) == ["new-c3", "old-b2"]
    # Older than a day: only old-b2's record; its artifacts stay.
    r = runs.launch("clean", "--older-than", "1d", "--yes")
    assert r.returncode == 0, r.stderr
    assert f"removed old-b2's record ({runs.registry.run_dir('old-b2')})" in r.stdout
    assert r.stderr.strip() == (
        "removed 1 record(s) from this machine; the runs' artifacts stay in their storage"
    )
    assert not runs.registry.run_dir("old-b2").exists() and (old / "manifest.json").is_file()
    assert _ids(runs.launch("list").stdout) == ["live-a1", "new-c3"]
    # Everything ended: new-c3; the running run is never cleaned.
    r = runs.launch("clean", "--yes")
    assert r.returncode == 0, r.stderr
    assert _ids(runs.launch("list").stdout) == ["live-a1"]
    assert (new / "manifest.json").is_file() and (kept / "manifest.json").is_file()
    assert runs.launch("clean", "--yes").stdout.strip() == "no ended runs match; nothing to clean"
    assert runs.launch("status", "new-c3").returncode == 2  # its record is gone
