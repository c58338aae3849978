"""`launch submit --backend slurm` as a user runs it, against the real daemons (`slurm_cluster`):
a 2-host job trains to completion and `status`/`logs` report it; `cancel` checkpoints first.

The dev cluster is one node, so the spec packs both hosts on it (`slurm.hosts_per_node: 2`);
the script still derives coordinator, process ids and world size from SLURM. The trained and the
cancelled job are the session's (tests/slurm_cluster.py), which tests/test_slurm_cluster.py
reads too.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator

import pytest
from slurm_cluster import SlurmRun, job_file, launch

from runs import read_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture
def submitted(tmp_path) -> Iterator[Callable[[str], str]]:
    """Records a `launch submit --json` run id; at teardown its job is scancelled outright, so an
    assert that fails before a test's own cancel does not leave the job holding the node."""
    state, run_ids = tmp_path / "state", []

    def _record(stdout: str) -> str:
        run_ids.append(json.loads(stdout)["run_id"])
        return run_ids[-1]

    yield _record
    for run_id in run_ids:  # a job that has ended already is left as it is
        record = state / "jaxjob" / "runs" / run_id / "record.json"
        job_id = str(json.loads(record.read_text())["handle"]["job_id"])
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


def test_submit_status_logs_on_slurm(slurm_trained: SlurmRun):
    """The shared 6-step job (tests/slurm_cluster.py), submitted with `launch submit --json`."""
    state, run_id = slurm_trained.state, slurm_trained.run_id
    info = slurm_trained.info
    assert info["state"] == "succeeded", info
    logs = launch(state, "logs", run_id, "--all-hosts")
    assert logs.returncode == 0, logs.stderr
    assert "[host 0] step: 6 " in logs.stdout and "[host 1] step: 6 " in logs.stdout
    quiet = launch(state, "logs", run_id).stdout  # the default view: host 0's lines
    assert "[host 0] step: 6 " in quiet and "[host 1] step: " not in quiet
    final = json.loads((slurm_trained.run_dir / "summaries/final.json").read_text())
    assert final["status"] == "completed" and final["steps"] == 6
    listed = json.loads(launch(state, "list", "--json").stdout)
    assert [r["run_id"] for r in listed] == [run_id]
    # The human-readable forms of the same finished job (status was a KeyError on SLURM).
    human = launch(state, "status", run_id)
    assert human.returncode == 0 and "Traceback" not in human.stderr, human.stderr
    lines = {ln[:12].strip(): ln[12:] for ln in human.stdout.splitlines()}
    assert lines["run"] == f"{run_id}  (slurm)" and lines["state"].startswith("succeeded")
    assert lines["attempt"] == "0  (0 of 0 restarts)" and lines["progress"].startswith("step 6 / 6")
    row = launch(state, "list").stdout.splitlines()[1].split()
    assert row[:3] == [run_id, "slurm", "succeeded"]


def test_cancel_on_slurm_checkpoints_first(slurm_cancelled: SlurmRun):
    """The shared cancelled job (tests/slurm_cluster.py): `launch status` said it ran, `launch
    cancel` returned once SIGTERM was sent, and the hosts checkpointed before it ended."""
    running = slurm_cancelled.running.splitlines()
    assert running[1].startswith("state       running  running on "), running
    res = slurm_cancelled.cancel
    assert res.returncode == 0 and "cancel sent" in res.stdout, res.stderr
    info = slurm_cancelled.info
    assert info["state"] == "cancelled", info
    events = read_jsonl(slurm_cancelled.run_dir / "events.jsonl")
    assert events[-1]["event"] == "interrupted"
    index = json.loads((slurm_cancelled.run_dir / "checkpoints/index.json").read_text())
    final = json.loads((slurm_cancelled.run_dir / "summaries/final.json").read_text())
    assert index["latest"] == final["steps"]


def test_a_second_submit_of_a_running_run_is_refused(tmp_path, prepared, slurm_cluster, submitted):
    """A fixed run_id submitted while its job is queued or running: refused before sbatch, and
    the run's record and folder stay the running job's."""
    state, job = tmp_path / "state", job_file(tmp_path, prepared, "sl-twice", 100_000, "sl-twice")
    first = launch(state, "submit", str(job), "--backend", "slurm", "--json")
    assert first.returncode == 0, first.stderr
    run_id = submitted(first.stdout)
    job_id = json.loads(first.stdout)["handle"]["job_id"]
    record = state / "jaxjob" / "runs" / run_id / "record.json"
    before = record.read_text()
    again = launch(state, "submit", str(job), "--backend", "slurm", "--json")
    assert again.returncode == 2, again.stdout + again.stderr
    assert again.stderr.startswith(f"error: run {run_id} is already ")
    assert again.stderr.endswith(f"; launch cancel {run_id} first or use another run_id\n")
    assert record.read_text() == before  # what status reads is still the first job
    queued = subprocess.run(["squeue", "-h", "-n", "sl-twice", "-o", "%i"],
                            capture_output=True, text=True, timeout=60).stdout.split()  # fmt: skip
    assert queued in ([job_id], []), queued  # one job (ended already, at worst), not two
    assert launch(state, "cancel", run_id, timeout=30).returncode == 0


def test_status_reads_only_this_jobs_batch_lines(tmp_path, monkeypatch):
    """A resubmitted run's jobs append to one batch.log: the status of a job slurmctld forgot
    says its own last words (or none), never the earlier job's."""
    from launch.backend import Handle
    from launch.backends.slurm import status as slurm_status

    logs = tmp_path / "logs"
    logs.mkdir()
    earlier = "jaxjob: every host exited 0; the job succeeded\n"
    (logs / "batch.log").write_text(earlier)
    (tmp_path / "result").write_text("1 0\n")
    monkeypatch.setattr(slurm_status, "job_record", lambda handle: None)  # forgotten
    handle = Handle("slurm", {"job_id": "12", "workdir": str(tmp_path),
                              "batch_log_offset": len(earlier)})  # fmt: skip
    st = slurm_status.status(handle)
    assert (st["state"], st["detail"]) == ("failed", "exit code 1")
    with open(logs / "batch.log", "a") as f:
        f.write("jaxjob: host 1 exited 2 (not restartable)\n")
    detail = slurm_status.status(handle)["detail"]
    assert detail == "exit code 1; host 1 exited 2 (not restartable)"
