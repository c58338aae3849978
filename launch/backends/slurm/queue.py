"""The user's jaxjob jobs that slurmctld still knows (`launch list/cancel/clean --backend slurm`).

Every job the backend submits carries `--comment=jaxjob:<run id>` (render.py); squeue lists the
user's jobs with it, and the batch script's path (`<rundir>/job.sbatch`) gives the run folder
that status, logs and cancel read. Jobs slurmctld has forgotten (after MinJobAge) are not listed
here: accounting (`sacct`) is often off, so it is not asked.
"""

from __future__ import annotations

import getpass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launch.backend import ClusterRun, Handle
from launch.backends.slurm.render import JOB_COMMENT_PREFIX
from launch.backends.slurm.submit import run_command, slurm_cmd

# job id | state | submit time | comment | command (the batch script's path)
_FORMAT = "%i|%T|%V|%k|%o"


def cluster_runs(status_of: Any) -> list[ClusterRun]:
    """The user's jobs whose comment marks them as jaxjob's, newest first; `status_of(handle)`
    gives each its state as `launch status` reads it."""
    user = getpass.getuser()
    out = run_command(slurm_cmd("squeue", "--noheader", f"--user={user}", f"--format={_FORMAT}"))
    runs = []
    for line in out.stdout.splitlines():
        fields = line.split("|")
        if len(fields) < 5 or not fields[3].startswith(JOB_COMMENT_PREFIX):
            continue
        job_id, slurm_state, submitted, comment = fields[:4]
        run_id = comment.removeprefix(JOB_COMMENT_PREFIX)
        script = Path("|".join(fields[4:]))  # a path may hold the separator
        data: dict[str, Any] = {"job_id": job_id, "workdir": str(script.parent), "run_id": run_id}
        data.update(_from_job_yaml(script.parent))
        st = status_of(Handle("slurm", data))
        stamp = _utc(submitted)
        runs.append(
            ClusterRun(
                run_id,
                st.get("state", "unknown"),
                st.get("detail", slurm_state.lower()),
                stamp,
                Handle("slurm", data),
                f"slurm job {job_id}",
            )
        )
    runs.sort(key=lambda r: (r.submitted, r.run_id), reverse=True)
    return runs


def _utc(local: str) -> str:
    """squeue's submit time (this host's local time, no zone) in UTC, as the registry keeps
    times; "" when it is not a time (e.g. N/A)."""
    try:
        at = datetime.fromisoformat(local)
    except ValueError:
        return ""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # a naive time is read as local


def _from_job_yaml(rundir: Path) -> dict[str, Any]:
    """What a registry handle also keeps (hosts, the cancel grace, max_restarts), from the
    job.yaml submit wrote beside the script; nothing when it cannot be read."""
    import yaml

    from jobspec.job_spec import JobSpec

    try:
        spec = JobSpec.model_validate(yaml.safe_load((rundir / "job.yaml").read_text()))
    except Exception:  # noqa: BLE001 - the job still lists; cancel then uses its default grace
        return {}
    return {"hosts": spec.host_processes("slurm"), "grace_s": spec.slurm.signal_grace_s,
            "max_restarts": spec.max_restarts}  # fmt: skip


__all__ = ["cluster_runs"]
