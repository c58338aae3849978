"""The run registry: what `launch` submitted from this machine, so status/logs/cancel/list work.

Layout under `$XDG_STATE_HOME/jaxjob/` (default `~/.local/state/jaxjob/`; the folders and how
they are written: state.py):

    runs/<run_id>/record.json   the RunRecord (written last: a run without one was never submitted)
    runs/<run_id>/cfg.toml      the run config the hosts read
    runs/<run_id>/job.yaml      the job spec as the user wrote it
    runs/<run_id>/.submit.lock  held by the one `launch submit` of the run under way (state.py)
    runs/<run_id>/...           whatever the backend keeps there (local: logs/, supervisor.json)
"""

from __future__ import annotations

import difflib
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobspec.errors import JaxjobError
from launch.backend import Handle
from launch.backends import BACKENDS, backend_class
from launch.runid import is_run_id
from launch.state import RunFolders, read_json, write_json_atomic

RECORD_FILE = "record.json"


class BrokenRecordError(JaxjobError):
    """A record.json that cannot be read or does not describe a run."""

    def __init__(self, path: Path, why: str) -> None:
        self.path, self.why = path, why
        super().__init__(
            f"broken record: {path}: {why}; fix it or remove {path.parent} (the run's "
            "artifacts are elsewhere and stay)"
        )


@dataclass
class RunRecord:
    run_id: str
    backend: str
    handle: dict[str, Any]  # Handle.data: JobSet name + namespace, SLURM job id, local pid + logs
    output_uri: str  # the run's artifacts are under <output_uri>/<run_id>
    submitted: str  # ISO 8601, UTC
    job_path: str
    backend_options: dict[str, Any] = field(default_factory=dict)  # e.g. k8s context, namespace
    overrides: dict[str, Any] = field(default_factory=dict)  # launch --set/--env

    @property
    def run_uri(self) -> str:
        return f"{self.output_uri.rstrip('/')}/{self.run_id}"

    def to_handle(self) -> Handle:
        return Handle(self.backend, dict(self.handle))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def _why_broken(data: Any, run_id: str) -> str | None:
    """What is wrong with a record.json's content (None: nothing), so one bad record is one
    sentence rather than a KeyError wherever a field is first used."""
    if not isinstance(data, dict):
        return f"a record is a JSON object, not {type(data).__name__}"
    fields = RunRecord.__dataclass_fields__
    missing = [k for k in fields if k not in data and k not in ("backend_options", "overrides")]
    if missing:
        return f"it lacks {', '.join(missing)}"
    for k in ("run_id", "backend", "output_uri", "submitted", "job_path"):
        if not isinstance(data[k], str):
            return f"{k} is {data[k]!r}, not a string"
    for k in ("handle", "backend_options", "overrides"):
        if not isinstance(data.get(k, {}), dict):
            return f"{k} is {data[k]!r}, not a mapping"
    if data["run_id"] != run_id:
        return f"it names run {data['run_id']!r} but lies in the folder of {run_id!r}"
    if data["backend"] not in BACKENDS:
        return f"unknown backend {data['backend']!r}"
    try:
        keys = backend_class(data["backend"]).handle_keys
    except JaxjobError:  # its module is missing here: listed still, `launch status` says why
        return None
    lacks = [k for k in keys if k not in data["handle"]]
    if lacks:
        return f"its {data['backend']} handle lacks {', '.join(lacks)}"
    return None


def read_record(path: Path) -> RunRecord | None:
    """The RunRecord at `path`, None when there is none, BrokenRecordError when it is bad."""
    try:
        data = read_json(path)
    except UnicodeDecodeError:
        raise BrokenRecordError(path, "it is not UTF-8 text") from None
    except ValueError as e:
        raise BrokenRecordError(path, f"it cannot be read as JSON ({e})") from None
    except OSError as e:
        raise BrokenRecordError(path, f"it cannot be read ({e.strerror or e})") from None
    if data is None:
        return None
    why = _why_broken(data, path.parent.name)
    if why:
        raise BrokenRecordError(path, why)
    return RunRecord.from_dict(data)


class Registry(RunFolders):
    """The run folders and their records."""

    def record(self, rec: RunRecord) -> None:
        write_json_atomic(self.run_dir(rec.run_id) / RECORD_FILE, asdict(rec))

    def get(self, run_id: str) -> RunRecord | None:
        """The record of `run_id`; None when there is none; BrokenRecordError when it is bad."""
        return read_record(self.run_dir(run_id) / RECORD_FILE)

    def exists(self, run_id: str) -> bool:
        return (self.run_dir(run_id) / RECORD_FILE).is_file()

    def remove(self, rec: RunRecord) -> bool:
        """Remove the run's folder here (its record, its copies of cfg.toml and job.yaml, and
        what the backend kept there), never its artifacts; False when the record is no longer
        `rec` (submitted again since), which is then kept. Under the run's submit lock, so a
        submit of the same run id under way is never half removed."""
        with self.submit_lock(rec.run_id):
            now = self.get(rec.run_id)
            if now is None or now.submitted != rec.submitted:
                return False
            shutil.rmtree(self.run_dir(rec.run_id))
        return True

    def lookup(self, run_id: str) -> RunRecord:
        """The record of `run_id`, or an error naming the closest run ids this machine knows."""
        rec = self.get(run_id) if is_run_id(run_id) else None
        if rec is not None:
            return rec
        known = [r.run_id for r in self.list()]
        close = difflib.get_close_matches(run_id, known, n=3, cutoff=0.5)
        # A job name is a prefix of its run ids: `launch status smoke` should find smoke-x1y2z3.
        close += [k for k in known if k.startswith(f"{run_id}-") and k not in close][:3]
        if close:
            hint = f"; did you mean {', '.join(close)}?"
        elif known:
            hint = "; `launch list` shows the runs submitted from this machine"
        else:
            hint = f"; no run has been submitted from this machine yet (registry: {self.root})"
        raise JaxjobError(f"unknown run id {run_id!r}{hint}")

    def list(self) -> list[RunRecord]:
        """Every recorded run, newest first (broken records left out: see scan)."""
        return self.scan()[0]

    def scan(self) -> tuple[list[RunRecord], list[BrokenRecordError]]:
        """Every readable record, newest first, and one error per broken one: a bad record
        must not hide the others."""
        out, broken = [], []
        for path in sorted(self.runs_dir.glob(f"*/{RECORD_FILE}")):
            try:
                rec = read_record(path)
            except BrokenRecordError as e:
                broken.append(e)
                continue
            if rec is not None:
                out.append(rec)
        # Same-format UTC timestamps sort as strings; the run id breaks ties deterministically.
        out.sort(key=lambda r: (r.submitted, r.run_id), reverse=True)
        return out, broken
