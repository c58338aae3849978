"""A SLURM run's state (from scontrol, or the batch shell's own record) and its host logs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launch.backend import Handle, tail_lines
from launch.backends.slurm.render import RunDir
from launch.backends.slurm.submit import (
    FAILED,
    PENDING,
    RUNNING,
    JobRecord,
    first_int,
    job_record,
    partition_info,
)

# Pending reasons under which slurmctld will never start the job as submitted (it accepts
# such jobs and leaves them pending unless EnforcePartLimits is set).
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                "InvalidAccount", "InvalidQOS"}  # fmt: skip
# Pending reasons that last until an administrator acts (nodes down or drained, partition down).
BLOCKED = {"ReqNodeNotAvail", "PartitionDown", "PartitionInactive", "NodeDown"}


def status(handle: Handle) -> dict[str, Any]:
    """{"state", "detail", ...}: scontrol's view while it knows the job, then the run files'."""
    rd = RunDir(Path(handle.data["workdir"]))
    job = job_record(handle)
    cancelled = rd.cancel_mark.exists()
    base = {"job_id": handle.data["job_id"], "workdir": str(rd.root), "logs": str(rd.logs),
            "max_restarts": handle.data.get("max_restarts")}  # fmt: skip
    offset = int(handle.data.get("batch_log_offset", 0))  # never an earlier job's last words
    if job is None:
        return {**base, **_from_result(rd, cancelled, handle.data["job_id"], offset)}
    info = {**base, "slurm_state": job.state, "reason": job.reason, "attempt": job.restarts,
            "restarts": job.restarts,
            "exit_code": job.exit_code}  # fmt: skip
    out = {**info, **_from_record(job, rd, cancelled, offset)}
    if out["state"] == "pending" and (found := pending_hint(job, handle.data.get("cluster"))):
        out["hint"], out["never_starts"] = found  # never_starts: `submit --wait` stops waiting
    return out


def pending_hint(job: JobRecord, cluster: str | None = None) -> tuple[str, bool] | None:
    """(why a pending job will not start by itself and what to change, whether it provably
    never will); None while it simply waits its turn (Resources, Priority, BeginTime, ...).

    PartitionNodeLimit/PartitionConfig are also reported while nodes are down or drained, so
    they prove "never" only when the partition's node count is below the job's."""
    reason = _reason(job)
    if reason in BLOCKED:
        return (
            f"SLURM reason {reason}: it cannot start until the partition {job.partition} or its "
            "nodes are back up; choose another partition (slurm.partition) or ask the admins"
        ), False
    if reason not in NEVER_STARTS:
        return None
    part = partition_info(job.partition, cluster) if job.partition else {}
    counts = [n for n in (first_int(part.get(k, "")) for k in ("TotalNodes", "MaxNodes")) if n]
    limit = min(counts) if counts else None
    where = f"the partition {job.partition}" if job.partition else "its partition"
    if job.num_nodes is not None and limit is not None and job.num_nodes > limit:
        return (
            f"SLURM reason {reason}: it can never start: {where} has {limit} node(s) for one "
            f"job and this job asks for {job.num_nodes}; reduce hosts (or raise "
            "slurm.hosts_per_node for a CPU job) or choose another partition (slurm.partition), "
            "then cancel and resubmit"
        ), True
    if reason in ("PartitionNodeLimit", "PartitionConfig"):  # not proven: nodes may be down
        return (
            f"SLURM reason {reason}: {where} cannot give this job its {job.num_nodes or '?'} "
            "node(s) now (too few nodes, or some down or drained); reduce hosts or choose "
            "another partition (slurm.partition), or wait for the nodes to return"
        ), False
    if reason == "PartitionTimeLimit":
        return (
            f"SLURM reason {reason}: it can never start: its time limit {job.time_limit} exceeds "
            f"the MaxTime {part.get('MaxTime', '?')} of {where}; lower slurm.time or choose "
            "another partition, then cancel and resubmit"
        ), True
    fix = {
        "BadConstraints": "no node has what slurm.constraint (or the GPUs) asks for; change it",
        "InvalidAccount": "slurm.account is not an account you may use; change it",
        "InvalidQOS": "slurm.qos is not a QOS you may use; change it",
    }[reason]
    return (
        f"SLURM reason {reason}: it can never start as submitted: {fix}, then cancel and resubmit"
    ), True


def _reason(job: JobRecord) -> str:
    return job.reason.split(",")[0].strip("()")


def _from_record(job: JobRecord, rd: RunDir, cancelled: bool, offset: int) -> dict[str, str]:
    """State and detail of a job slurmctld still knows."""
    last = _last_batch_line(rd, offset)
    if job.state in PENDING:
        why = f"requeued, attempt {job.restarts}" if job.restarts else "waiting"
        return {"state": "pending", "detail": f"{job.state.lower()} ({why}; reason {job.reason})"}
    if job.state in RUNNING:
        detail = f"{job.state.lower()} on {job.nodes}, attempt {job.restarts}"
        if cancelled:
            detail += "; cancel requested, hosts are checkpointing"
        return {"state": "running", "detail": detail}
    if job.state == "COMPLETED":
        return {"state": "succeeded", "detail": last or "every host finished"}
    code = f"exit code {job.exit_code}" + (f", signal {job.signal}" if job.signal else "")
    if job.state == "CANCELLED" or cancelled:
        return {"state": "cancelled", "detail": f"cancelled ({code}); {last}".rstrip("; ")}
    if job.state in FAILED:
        return {"state": "failed", "detail": f"{job.state.lower()} ({code}); {last}".rstrip("; ")}
    return {"state": "unknown", "detail": f"SLURM state {job.state}"}


def _last_batch_line(rd: RunDir, offset: int = 0) -> str:
    """The batch shell's last `jaxjob:` line past `offset` (where this submission's lines begin
    in batch.log, which every job of the run appends to): why the job ended as it did."""
    try:
        with (rd.logs / "batch.log").open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next(
        (ln.removeprefix("jaxjob: ") for ln in reversed(lines) if ln.startswith("jaxjob: ")), ""
    )


def _from_result(rd: RunDir, cancelled: bool, job_id: str, offset: int) -> dict[str, Any]:
    """State after slurmctld forgot the job: the batch shell's own record of how it ended."""
    try:
        code, attempt = (int(x) for x in rd.result.read_text().split()[:2])
    except (OSError, ValueError):
        return {"state": "unknown", "detail": f"SLURM no longer knows job {job_id} and it left no "
                f"result in {rd.root}; see {rd.logs / 'batch.log'}"}  # fmt: skip
    last = _last_batch_line(rd, offset)
    info = {"exit_code": code, "attempt": attempt, "restarts": attempt}
    if code == 0:
        return {**info, "state": "succeeded", "detail": last or "every host finished"}
    state = "cancelled" if cancelled else "failed"
    return {**info, "state": state, "detail": f"exit code {code}; {last}".rstrip("; ")}


class _LineReader:
    """Complete lines appended to a file since the last read (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read_lines(self, *, final: bool = True) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [ln.decode(errors="replace").rstrip("\r") for ln in lines]


def _hosts(handle: Handle, rd: RunDir, host: int | None) -> list[int]:
    """The hosts whose logs to read: one, all the handle names, or those with a log file."""
    if host is not None:
        return [host]
    if "hosts" in handle.data:
        return list(range(int(handle.data["hosts"])))
    found = (p.stem.removeprefix("host-") for p in rd.logs.glob("host-*.log"))
    return sorted(int(n) for n in found if n.isdigit())


def logs(
    handle: Handle, *, host: int | None, follow: bool, tail: int | None, poll_s: float
) -> Iterator[str]:
    """Each host's log lines, prefixed `[host N] ` (no trailing newline). Without follow, host
    by host; with follow, as they are written, until the job has ended."""
    rd = RunDir(Path(handle.data["workdir"]))
    readers = {h: _LineReader(rd.host_log(h)) for h in _hosts(handle, rd, host)}
    for h, r in readers.items():
        lines = r.read_lines(final=not follow)
        for line in tail_lines(lines, tail):
            yield f"[host {h}] {line}"
    while follow:
        st = status(handle)
        # A job that can never start writes no more lines: stop following, as for an end.
        done = st["state"] not in ("pending", "running") or bool(st.get("never_starts"))
        got = False
        for h, r in readers.items():
            for line in r.read_lines(final=done):
                got = True
                yield f"[host {h}] {line}"
        if done:
            return
        if not got:
            time.sleep(poll_s)
