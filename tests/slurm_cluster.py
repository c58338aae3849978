"""pytest plugin: a real SLURM cluster for the session, for the suites that submit jobs.

Registered in tests/conftest.py through `pytest_plugins`. The `slurm_cluster` fixture uses the
cluster `sinfo` already answers for (SLURM_CONF in the environment, as .ci/run sets it);
otherwise it starts the one-node dev cluster (scripts/slurm-dev-cluster.sh: munge, slurmctld,
slurmd on this machine), owned by this process: it is stopped at the end of the session, or by
the script's watcher when this process ends any other way. It skips, saying why, where SLURM is not installed or cannot be started.

Two 2-host jobs, submitted with `launch` as a user does, are shared by the SLURM suites (a job's
hosts cost more than everything the tests then read): `slurm_trained` trains to its end, and
`slurm_cancelled` is cancelled by `launch cancel` after a few steps (tests/test_launch_slurm.py
reads them through `launch`, tests/test_slurm_cluster.py through the backend).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from runs import tiny_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm-dev-cluster.sh"
INSTALL = "apt-get install -y slurm-wlm munge"


@dataclass(frozen=True)
class SlurmCluster:
    started: bool  # this session started the dev cluster (and stops it)
    conf: str | None  # SLURM_CONF the clients use; None: their default
    cpus: int  # CPUs of the first node, so a test can size its job


def _answers(env: dict[str, str] | None = None) -> bool:
    try:
        proc = subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True)
    return int((out.stdout.split() or ["0"])[0].rstrip("+"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if shutil.which("sbatch") is None:
        pytest.skip(f"SLURM is not installed ({INSTALL})")
    if _answers():
        yield SlurmCluster(False, os.environ.get("SLURM_CONF"), _node_cpus())
        return
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip(f"no SLURM cluster answers and the daemons are not installed ({INSTALL})")
    if os.geteuid() != 0:
        pytest.skip("no SLURM cluster answers, and starting the dev cluster needs root")
    conf = str(Path(os.environ.get("JAXJOB_SLURM_DIR", "/tmp/jaxjob-slurm")) / "slurm.conf")
    # --owner: the daemons end with this process, even when the suite is killed (SIGTERM,
    # Ctrl-C, SIGKILL), so none serves jobs after the tests.
    proc = subprocess.run(
        ["bash", str(SCRIPT), "start", "--owner", str(os.getpid())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode != 0:
        # A start that failed partway may have left munged or a daemon running: stop them.
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)
        pytest.fail(f"scripts/slurm-dev-cluster.sh start failed:\n{proc.stderr}", pytrace=False)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", conf)  # sbatch/scontrol here and in subprocesses find it
            cpus = _node_cpus()
            yield SlurmCluster(True, conf, cpus)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


# ---- jobs the SLURM suites share ----------------------------------------------------------------


def launch(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `launch` CLI in a subprocess, its registry under `state`, as a user runs it."""
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def job_file(
    tmp: Path, prepared: str, name: str, steps: int, run_id: str | None = None,
    max_restarts: int = 0,
) -> Path:  # fmt: skip
    """A 2-host CPU job packed on the dev cluster's one node (`slurm.hosts_per_node: 2`)."""
    # The decay horizon of tests/test_launch_local.py's ONE_SCHEDULE: the schedule is compiled
    # into the train step, so the suite's 2-host runs of any length share one program.
    run = tiny_config(prepared, str(tmp / "runs"), "ignored", mesh={"data": 2},
                      training={"target_tokens": 16 * 8 * steps, "log_every": 1},
                      optimizer={"schedule": {"decay_steps": 100}})  # fmt: skip
    spec = {"name": name, "run": run, "accelerator": "cpu", "hosts": 2,
            "max_restarts": max_restarts,
            "slurm": {"hosts_per_node": 2, "time": "00:15:00", "signal_grace_s": 60}}  # fmt: skip
    if run_id is not None:  # fixed: every submit of it is the same run
        spec["run_id"] = run_id
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def wait_state(state: Path, run_id: str, want: set[str], timeout: float = 300) -> dict:
    """`launch status --json` once the run's backend says it is in one of `want`. The wait asks
    the backend in this process (squeue/scontrol): a `launch status` process a second would cost
    more CPU than the job."""
    from launch.backends import get_backend
    from launch.registry import Registry

    rec = Registry(state / "jaxjob").lookup(run_id)
    backend = get_backend(rec.backend, rec.backend_options)
    deadline = time.monotonic() + timeout
    while (now := backend.status(rec.to_handle())["state"]) not in want:
        assert time.monotonic() < deadline, f"{run_id} still {now}"
        time.sleep(0.5)
    res = launch(state, "status", run_id, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["state"] in want, info
    return info


@dataclass(frozen=True)
class SlurmRun:
    """A job submitted with `launch submit --backend slurm --json`, and what the tests read."""

    tmp: Path  # job.yaml, runs/ (the run's artifacts) and state/ (the launch registry)
    state: Path
    run_id: str
    handle: dict  # the record's handle data: job_id, workdir, ...
    info: dict  # `launch status --json` once it ended
    running: str = ""  # `launch status` while it ran (slurm_cancelled)
    cancel: subprocess.CompletedProcess | None = None  # `launch cancel` (slurm_cancelled)

    @property
    def run_dir(self) -> Path:
        return self.tmp / "runs" / self.run_id


def _scancel(state: Path) -> None:
    """Whatever job of this registry still runs: cancelled outright, so a failed assert or a
    timeout does not leave it holding the node."""
    for record in (state / "jaxjob" / "runs").glob("*/record.json"):
        job_id = str(json.loads(record.read_text())["handle"]["job_id"])
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


def _submit(state: Path, job: Path) -> tuple[str, dict]:
    sub = launch(state, "submit", str(job), "--backend", "slurm", "--json")
    assert sub.returncode == 0, sub.stderr
    out = json.loads(sub.stdout)
    return out["run_id"], out["handle"]


@pytest.fixture(scope="session")
def slurm_trained(slurm_cluster, prepared, tmp_path_factory) -> Iterator[SlurmRun]:
    """A 6-step 2-host job trained to its end (whatever its state: the tests assert it)."""
    tmp = tmp_path_factory.mktemp("slurm-trained")
    state = tmp / "state"
    try:
        run_id, handle = _submit(state, job_file(tmp, prepared, "sl-ok", 6))
        info = wait_state(state, run_id, {"succeeded", "failed", "cancelled"})
        yield SlurmRun(tmp, state, run_id, handle, info)
    finally:
        _scancel(state)


@pytest.fixture(scope="session")
def slurm_cancelled(slurm_cluster, prepared, tmp_path_factory) -> Iterator[SlurmRun]:
    """A 2-host job with restarts allowed, cancelled by `launch cancel` (which returns once
    SIGTERM is sent) after 3 steps, then waited for until it ended."""
    from launch.backend import Handle
    from launch.backends.slurm import SlurmBackend

    tmp = tmp_path_factory.mktemp("slurm-cancelled")
    state = tmp / "state"
    try:
        job = job_file(tmp, prepared, "sl-cancel", 100_000, max_restarts=2)
        run_id, handle = _submit(state, job)
        backend = SlurmBackend()
        metrics = tmp / "runs" / run_id / "metrics" / "train.jsonl"
        deadline = time.monotonic() + 600  # bounds a hang only: the loop waits for the rows
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            now = backend.status(Handle("slurm", handle))["state"]
            assert now in ("pending", "running"), launch(state, "status", run_id).stdout
            assert time.monotonic() < deadline, launch(state, "status", run_id).stdout
            time.sleep(0.5)
        running = launch(state, "status", run_id).stdout
        cancel = launch(state, "cancel", run_id, timeout=30)
        info = wait_state(state, run_id, {"cancelled", "failed", "succeeded"})
        yield SlurmRun(tmp, state, run_id, handle, info, running, cancel)
    finally:
        _scancel(state)
