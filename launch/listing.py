"""The runs `launch list`, `launch cancel --all` and `launch clean` act on, and their filters.

The rows come from this machine's registry (every run submitted from here, with its state as
its backend says) and, for `--backend k8s|slurm`, from the cluster itself: the JobSets jaxjob
made in the namespace, or the user's jaxjob jobs in squeue, including those submitted from
another machine (a cluster run the registry also knows is shown once, as the registry's).
Filters are applied before any backend is asked, where they can be (name, age, backend), so a
narrow list stays fast.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobspec.errors import JaxjobError
from launch.backend import TERMINAL, ClusterRun, Handle, has_ended
from launch.backends import backend_class, get_backend
from launch.registry import BrokenRecordError, Registry, RunRecord

#: `--status` values: a state, or a group of them.
STATE_GROUPS: dict[str, frozenset[str]] = {
    "pending": frozenset({"pending"}),
    "running": frozenset({"running"}),
    "succeeded": frozenset({"succeeded"}),
    "failed": frozenset({"failed"}),
    "cancelled": frozenset({"cancelled"}),
    "unknown": frozenset({"unknown"}),
    "active": frozenset({"pending", "running"}),
    "ended": frozenset(TERMINAL),
}


def parse_states(values: Iterable[str], option: str = "--status") -> frozenset[str] | None:
    """The states `--status` names (repeatable, comma-separated); None when none was given."""
    names = [v.strip().lower() for value in values for v in value.split(",") if v.strip()]
    if not names:
        return None
    bad = [n for n in names if n not in STATE_GROUPS]
    if bad:
        raise JaxjobError(
            f"{option} {bad[0]!r} is not a state; use one or more of "
            f"{', '.join(STATE_GROUPS)} (e.g. {option} running,pending)"
        )
    return frozenset().union(*(STATE_GROUPS[n] for n in names))


def submitted_epoch(stamp: str) -> float | None:
    """Seconds since the epoch of an ISO 8601 UTC stamp (None: empty or unreadable)."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class RunFilter:
    """What a row must be to be kept; None: anything."""

    states: frozenset[str] | None = None
    name: str | None = None  # a glob over the run id (a job's runs: `smoke-*`)
    newer_than_s: float | None = None  # submitted within the last this many seconds
    older_than_s: float | None = None  # submitted longer ago than this
    backend: str | None = None

    def keeps_record(self, run_id: str, backend: str, submitted: str, now: float) -> bool:
        """The checks that need no backend (the state is checked once it is known)."""
        if self.backend is not None and backend != self.backend:
            return False
        if self.name is not None and not fnmatch.fnmatchcase(run_id, self.name):
            return False
        if self.newer_than_s is None and self.older_than_s is None:
            return True
        at = submitted_epoch(submitted)
        if at is None:  # no time to judge by: kept only when no age was asked for
            return False
        if self.newer_than_s is not None and now - at > self.newer_than_s:
            return False
        return self.older_than_s is None or now - at >= self.older_than_s

    def keeps_state(self, state: str) -> bool:
        return self.states is None or state in self.states


@dataclass
class RunRow:
    """One run as the bulk commands see it."""

    run_id: str
    backend: str
    submitted: str
    handle: Handle
    record: RunRecord | None  # None: found on the cluster, not submitted from this machine
    status: dict[str, Any]  # as the backend's status() says (at least state and detail)
    where: str = "here"  # "here" (this machine's registry), else where the cluster keeps it

    @property
    def state(self) -> str:
        return str(self.status.get("state", "unknown"))

    @property
    def ended(self) -> bool:
        return has_ended(self.status)

    def to_json(self) -> dict[str, Any]:
        out = {"run_id": self.run_id, "backend": self.backend, "state": self.state,
               "detail": self.status.get("detail", ""), "submitted": self.submitted,
               "submitted_here": self.record is not None, "where": self.where}  # fmt: skip
        if self.record is not None:
            out.update(run_uri=self.record.run_uri, job_path=self.record.job_path)
        return out


HEADER = f"{'RUN':<40} {'BACKEND':<6} {'STATE':<10} {'SUBMITTED (UTC)':<19}  WHERE"


def row_line(r: RunRow) -> str:
    """One run as `launch list` prints it, under HEADER."""
    when = r.submitted[:19].replace("T", " ") if r.submitted else "?"
    return f"{r.run_id:<40} {r.backend:<6} {r.state:<10} {when:<19}  {r.where}"


class _Statuses:
    """Each run's status from its backend. A backend (with its options) that cannot be used or
    reached is not asked again for the other runs: one unreachable cluster costs one timeout,
    not one a run."""

    def __init__(self) -> None:
        self._down: dict[str, str] = {}

    def of(self, rec: RunRecord) -> dict[str, Any]:
        from launch.backends.slurm.submit import SlurmError

        key = f"{rec.backend} {sorted(rec.backend_options.items())}"
        if key in self._down:
            return {"state": "unknown", "detail": self._down[key]}
        try:
            impl = get_backend(rec.backend, rec.backend_options)
        except JaxjobError as e:  # its client library is missing here
            self._down[key] = str(e)
            return {"state": "unknown", "detail": str(e)}
        try:
            return impl.status(rec.to_handle())
        except JaxjobError as e:
            # The cluster itself failing (SLURM's commands; an API server not reached, which
            # has no HTTP status), not this run's own objects.
            if isinstance(e, SlurmError) or getattr(e, "status", 0) is None:
                self._down[key] = str(e)
            return {"state": "unknown", "detail": str(e)}


def collect(
    registry: Registry,
    filt: RunFilter,
    *,
    options: dict[str, Any] | None = None,
    all_namespaces: bool = False,
    now: float | None = None,
) -> tuple[list[RunRow], list[BrokenRecordError]]:
    """The rows `filt` keeps, newest first, and the registry's broken records. With
    `filt.backend` a backend with a cluster, that cluster's own runs are asked for too
    (`options`: its --context/--namespace)."""
    now = time.time() if now is None else now
    records, broken = registry.scan()
    statuses = _Statuses()
    rows: list[RunRow] = []
    for rec in records:
        if not filt.keeps_record(rec.run_id, rec.backend, rec.submitted, now):
            continue
        rows.append(
            RunRow(rec.run_id, rec.backend, rec.submitted, rec.to_handle(), rec, statuses.of(rec))
        )
    if filt.backend is not None and filt.backend != "local":
        rows += _cluster_rows(filt, records, options or {}, all_namespaces, now)
    rows = [r for r in rows if filt.keeps_state(r.state)]
    rows.sort(key=lambda r: (submitted_epoch(r.submitted) or 0.0, r.run_id), reverse=True)
    return rows, broken


def _cluster_rows(
    filt: RunFilter,
    records: list[RunRecord],
    options: dict[str, Any],
    all_namespaces: bool,
    now: float,
) -> list[RunRow]:
    """The cluster's own runs that no registry record here already names."""
    assert filt.backend is not None
    impl = get_backend(filt.backend, options)
    if not hasattr(impl, "cluster_runs"):
        return []
    found: list[ClusterRun] = impl.cluster_runs(all_namespaces=all_namespaces)
    known = {_identity(rec.backend, rec.handle) for rec in records}
    rows = []
    for run in found:
        if _identity(filt.backend, run.handle.data) in known:
            continue
        if not filt.keeps_record(run.run_id, filt.backend, run.submitted, now):
            continue
        status = {"state": run.state, "detail": run.detail}
        rows.append(
            RunRow(run.run_id, filt.backend, run.submitted, run.handle, None, status, run.where)
        )
    return rows


def _identity(backend: str, data: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a handle one submission on its cluster (the backend's `identity_keys`: a
    JobSet's namespace, name and uid; a SLURM job id)."""
    keys = getattr(backend_class(backend), "identity_keys", None) or tuple(sorted(data))
    return (backend, *(data.get(k) for k in keys))
