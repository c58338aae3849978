"""The slurm backend against real daemons (the `slurm_cluster` fixture): a 2-host CPU job trains
to completion, and `cancel` makes the hosts checkpoint before the job ends.

Both hosts run as two tasks on one node (`SlurmBackend(hosts_per_node=2)`, CPU only): the script
derives the coordinator, process ids and world size from SLURM exactly as on a multi-node job.
The trained and the cancelled job are the session's (tests/slurm_cluster.py, submitted with
`launch` as tests/test_launch_slurm.py reads them), read here through the backend; the job with
bad input is submitted here, through `SlurmBackend.submit`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import yaml
from slurm_cluster import SlurmRun

from jobspec.job_spec import JobSpec
from launch.backend import Handle, Submission
from launch.backends.slurm import SlurmBackend
from launch.backends.slurm.render import render_script

from runs import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

TERMINAL = ("succeeded", "failed", "cancelled", "unknown")


def _submission(
    tmp_path: Path, manifest: str, run_id: str, max_restarts: int, **over
) -> Submission:
    cfg = tiny_config(manifest, str(tmp_path / "runs"), run_id, mesh={"data": 2}, **over)
    doc = {
        "name": "slurm-test",
        "run": cfg,
        "accelerator": "cpu",
        "hosts": 2,
        "max_restarts": max_restarts,
        "slurm": {"time": "00:10:00", "cpus_per_task": 1, "signal_grace_s": 30},
    }
    spec = JobSpec.model_validate(doc)
    return Submission(
        spec, run_id, tomli_w.dumps(cfg), yaml.safe_dump(doc), cfg["run"]["output_uri"], tmp_path
    )


@pytest.fixture
def backend(slurm_cluster) -> SlurmBackend:
    if slurm_cluster.cpus < 2:
        pytest.skip(f"the SLURM node has {slurm_cluster.cpus} CPU(s); two hosts need 2")
    # The tests' own interpreter, so the job runs the jaxjob under test whatever PATH says.
    return SlurmBackend(
        hosts_per_node=2, runtime_command=(sys.executable, "-m", "runtime"), poll_s=0.5
    )


@pytest.fixture
def submit(backend) -> Iterator[Callable[[Submission, Path], Handle]]:
    """backend.submit, and at teardown a cancel of whatever the test's jobs still run: an
    assert that fails before a test's own cancel must not leave its job holding the node."""
    handles: list[Handle] = []

    def _submit(sub: Submission, rundir: Path) -> Handle:
        handle = backend.submit(sub, rundir=rundir)
        handles.append(handle)
        return handle

    yield _submit
    for handle in handles:  # a job that has ended already is left as it is
        backend.cancel(handle, grace_s=0)


def _wait(
    backend: SlurmBackend, handle: Handle, states: tuple[str, ...], timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = backend.status(handle)
        if st["state"] in states or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def _explain(backend: SlurmBackend, handle: Handle) -> str:
    batch = Path(handle.data["workdir"], "logs", "batch.log")
    tail = "\n".join(list(backend.logs(handle, tail=15)))
    return f"{backend.status(handle)}\n{batch.read_text() if batch.exists() else ''}\n{tail}"


def test_two_hosts_train_to_completion(backend, slurm_trained: SlurmRun):
    """The session's trained job (tests/slurm_cluster.py: `launch submit`, 6 steps), read
    through the backend."""
    handle = Handle("slurm", slurm_trained.handle)
    assert handle.data["job_id"].isdigit()
    rundir = Path(handle.data["workdir"])
    assert {"job.sbatch", "cfg.toml", "job.yaml"} <= {p.name for p in rundir.iterdir()}

    st = backend.status(handle)
    assert st["state"] == "succeeded", _explain(backend, handle)

    lines = list(backend.logs(handle))
    for host in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[host {host}] ")]
        assert any(f"host {host} of 2 (contract" in ln for ln in mine), lines
    assert all(ln.startswith(("[host 0] ", "[host 1] ")) for ln in lines)
    assert len(list(backend.logs(handle, host=1, tail=3))) == 3
    followed = list(backend.logs(handle, host=0, follow=True))  # the job has ended: returns
    assert followed == [ln for ln in lines if ln.startswith("[host 0] ")]

    run_dir = slurm_trained.run_dir
    final = json.loads((run_dir / "summaries" / "final.json").read_text())
    assert final["status"] == "completed"
    runtime = json.loads((run_dir / "diagnostics" / "runtime.json").read_text())
    boot = runtime["boot"]
    assert boot["mode"] == "contract" and boot["process_count"] == 2, boot
    port = 61440 + int(handle.data["job_id"]) % 4096  # the script's coordinator: first host
    assert boot["coordinator"].endswith(f":{port}"), boot


def test_cancel_checkpoints_then_ends_cancelled(backend, slurm_cancelled: SlurmRun):
    """The session's cancelled job (tests/slurm_cluster.py): restarts were allowed and the hosts
    exit 42 (restartable) on the cancel's SIGTERM, yet the job is not requeued."""
    handle = Handle("slurm", slurm_cancelled.handle)
    st = backend.status(handle)
    assert st["state"] == "cancelled", _explain(backend, handle)
    assert st.get("attempt", 0) == 0, st  # not requeued

    events = [e["event"] for e in read_jsonl(slurm_cancelled.run_dir / "events.jsonl")]
    assert "interrupted" in events, events
    exits = Path(handle.data["workdir"]) / "exit" / "attempt-0"
    codes = sorted(p.read_text().strip() for p in exits.iterdir())
    assert codes == ["42", "42"], _explain(backend, handle)


def test_bad_input_fails_at_once_without_requeue(backend, submit, prepared, tmp_path):
    # Exit 2 (bad input) is not restartable, even with restarts allowed.
    sub = _submission(tmp_path, str(tmp_path / "missing.json"), "slurm-bad", max_restarts=2)
    handle = submit(sub, tmp_path / "rundir")
    st = _wait(backend, handle, TERMINAL, timeout=120)
    assert st["state"] == "failed" and st["exit_code"] == 2, _explain(backend, handle)
    assert st["attempt"] == 0 and "exited 2" in st["detail"], st


def test_sbatch_reads_quoted_directives_as_written(slurm_cluster, prepared, tmp_path):
    # sbatch's own directive parser (not a shell) must see the value the job spec gave.
    odd = 'it\'s a "part" $(id) ; #x'
    sub = _submission(tmp_path, prepared, "slurm-quote", max_restarts=0)
    sub = Submission(
        sub.spec.model_copy(update={"slurm": sub.spec.slurm.model_copy(update={"partition": odd})}),
        sub.run_id, sub.run_toml, sub.spec_yaml, sub.output_uri, sub.workdir,
    )  # fmt: skip
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(sub, tmp_path / "rundir"))
    proc = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
    assert proc.returncode != 0 and f"invalid partition specified: {odd}" in proc.stderr, (
        proc.stderr
    )
