"""Every SLURM command the backend runs: sbatch to submit, scontrol to look, scancel to cancel.

Nothing here reads SLURM accounting (`sacct`), which is often off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError, JaxjobError
from jobspec.job_spec import SecretRef
from launch.backend import Handle, RenderedFile, Submission
from launch.backends import source_pythonpath
from launch.backends.slurm.render import RunDir

# In the detached escalation's command line (`python -m launch.backends.slurm escalate ...`).
ESCALATE_MODULE = "launch.backends.slurm"

PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
           "SUSPENDED", "STOPPED"}  # fmt: skip
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"}
FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SlurmError(JaxjobError):
    """A SLURM command failed or the cluster cannot be reached."""


def run_command(
    cmd: list[str], *, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess:
    """Run a SLURM command; a missing command, no answer or a failure is one SlurmError."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(
            f"{cmd[0]} is not installed here; run launch on a host of the SLURM cluster "
            "(or start the dev cluster: scripts/slurm-dev-cluster.sh start)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{' '.join(cmd)} did not answer in {timeout:.0f} s; is slurmctld up?"
        ) from None
    if check and proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(cmd)} failed: {why[-1] if why else f'exit {proc.returncode}'}")
    return proc


def slurm_cmd(name: str, *args: str, cluster: str | None = None) -> list[str]:
    """A SLURM command line, with `--clusters` on a multi-cluster site."""
    return [name, *([f"--clusters={cluster}"] if cluster else []), *args]


@dataclass(frozen=True)
class JobRecord:
    """What `scontrol show job` says; accounting (sacct) is not needed."""

    state: str  # e.g. RUNNING, COMPLETED, FAILED (without flags such as +)
    reason: str
    exit_code: int
    signal: int
    restarts: int
    nodes: str
    partition: str = ""
    num_nodes: int | None = None  # nodes the job asks for (NumNodes, "3" or "3-3")
    time_limit: str = ""  # e.g. 00:15:00, UNLIMITED


def parse_scontrol(text: str) -> JobRecord:
    """The job record in `scontrol show job -o` output (the first value of each key wins)."""
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(?:^|\s)([A-Za-z:/_]+)=(\S*)", text):
        fields.setdefault(key, value)
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobRecord(
        state=fields.get("JobState", "UNKNOWN").split("+")[0],
        reason=fields.get("Reason", ""),
        exit_code=int(code or 0),
        signal=int(sig or 0),
        restarts=int(fields.get("Restarts", "0") or 0),
        nodes=fields.get("NodeList", ""),
        partition=fields.get("Partition", ""),
        num_nodes=first_int(fields.get("NumNodes", "")),
        time_limit=fields.get("TimeLimit", ""),
    )


def first_int(text: str) -> int | None:
    m = re.match(r"\d+", text)
    return int(m.group()) if m else None


def partition_info(name: str, cluster: str | None = None) -> dict[str, str]:
    """`scontrol show partition NAME -o` as a dict (TotalNodes, MaxNodes, MaxTime, ...); empty
    when the partition cannot be read (the caller then gives a hint without its figures)."""
    proc = run_command(slurm_cmd("scontrol", "show", "partition", "-o", name, cluster=cluster),
                check=False)  # fmt: skip
    if proc.returncode != 0:
        return {}
    return dict(re.findall(r"(?:^|\s)([A-Za-z/_]+)=(\S*)", proc.stdout))


def job_record(handle: Handle) -> JobRecord | None:
    """The job as slurmctld knows it, or None once it forgot (MinJobAge after the end)."""
    cmd = slurm_cmd("scontrol", "show", "job", "-o", str(handle.data["job_id"]),
                    cluster=handle.data.get("cluster"))  # fmt: skip
    proc = run_command(cmd, check=False)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
    return parse_scontrol(proc.stdout)


def _check_secrets(sub: Submission) -> None:
    missing = [
        n for n, v in sub.spec.env.items() if isinstance(v, SecretRef) and n not in os.environ
    ]
    if missing:
        raise ConfigError(
            f"env: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} secret "
            "references; on SLURM they come from this shell's environment, so export them first"
        )


def _write_rundir(rd: RunDir, files: list[RenderedFile]) -> None:
    rd.logs.mkdir(parents=True, exist_ok=True)  # slurmd does not create the output directory
    # A resubmission into the same directory starts clean: no old cancel, result or codes.
    rd.cancel_mark.unlink(missing_ok=True)
    rd.result.unlink(missing_ok=True)
    shutil.rmtree(rd.exits, ignore_errors=True)
    for f in files:
        (rd.root / f.name).write_text(f.content)


def submit(sub: Submission, rd: RunDir, files: list[RenderedFile]) -> Handle:
    """Write the rendered `files` into `rd` and sbatch its script."""
    _check_secrets(sub)
    _write_rundir(rd, files)
    batch_log = rd.logs / "batch.log"  # a resubmitted run's jobs append to one batch.log
    offset = batch_log.stat().st_size if batch_log.exists() else 0
    out = run_command(slurm_cmd("sbatch", "--parsable", str(rd.script))).stdout.strip()
    job_id, _, cluster = out.splitlines()[-1].partition(";")  # "id" or "id;cluster"
    data: dict[str, Any] = {
        "job_id": job_id,
        "workdir": str(rd.root),
        "output_uri": sub.output_uri,
        "run_id": sub.run_id,
        "hosts": sub.spec.host_processes("slurm"),
        "grace_s": sub.spec.slurm.signal_grace_s,
        "max_restarts": sub.spec.max_restarts,
        "batch_log_offset": offset,
    }
    if cluster:
        data["cluster"] = cluster
    return Handle("slurm", data)


def cancel(handle: Handle, *, grace_s: float | None, wait: bool, poll_s: float) -> None:
    """SIGTERM to every host (the runtime checkpoints and exits 42; the batch shell, seeing
    the cancel mark, does not requeue); after `grace_s` (default slurm.signal_grace_s)
    whatever still runs is cancelled outright. Returns once SIGTERM is sent, leaving that
    escalation to a detached process; `wait=True` escalates here and returns once the job
    has ended."""
    rd = RunDir(Path(handle.data["workdir"]))
    job_id, cluster = str(handle.data["job_id"]), handle.data.get("cluster")
    job = job_record(handle)
    if job is None or job.state not in PENDING | RUNNING:
        return  # already over: its outcome stays what it was
    rd.cancel_mark.write_text(f"{time.time():.0f}\n")
    if job.state in PENDING:
        run_command(slurm_cmd("scancel", job_id, cluster=cluster))
        return
    # --signal without --batch/--full signals the job steps only: the hosts, not the shell.
    run_command(slurm_cmd("scancel", "--signal=TERM", job_id, cluster=cluster), check=False)
    grace = float(grace_s if grace_s is not None else handle.data.get("grace_s", 120))
    if wait or grace <= 0:
        escalate(handle, grace, poll_s=poll_s)
        return
    _start_escalation(handle, grace)


def _start_escalation(handle: Handle, grace: float) -> None:
    """Detached (a new session, no terminal): it outlives `launch cancel` and its Ctrl-C."""
    subprocess.Popen(
        [sys.executable, "-m", ESCALATE_MODULE, "escalate", json.dumps(handle.data), str(grace)],
        env={**os.environ, "PYTHONPATH": source_pythonpath(os.environ.get("PYTHONPATH"))},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def escalate(handle: Handle, grace_s: float, *, poll_s: float) -> None:
    """Wait up to `grace_s` for the job to end after its SIGTERM, then scancel it outright."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        job = job_record(handle)
        if job is None or job.state not in PENDING | RUNNING:
            return
        time.sleep(poll_s)
    cmd = slurm_cmd("scancel", str(handle.data["job_id"]), cluster=handle.data.get("cluster"))
    run_command(cmd, check=False)
