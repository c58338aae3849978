"""Where `launch` keeps its files on this machine, and how it writes them.

Under `$XDG_STATE_HOME/jaxjob/` (default `~/.local/state/jaxjob/`), `runs/<run_id>/` is a run's
own folder: what its hosts read (cfg.toml, job.yaml) and what its backend keeps there. Every JSON
file is written to a temporary name and renamed, so a reader sees all of it or none. The run
registry (registry.py) adds the records; backends need only the folders.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from launch.backend import Submission


def state_root() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "jaxjob"


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic on POSIX: readers never see a half-written file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> Any | None:
    """The file's JSON, or None when it does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class RunFolders:
    """The runs' own folders under the state root (`root`: another root, for tests)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else state_root()

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def prepare_run_dir(self, sub: Submission) -> Path:
        """The run's own folder with what the hosts read; backends may use it as their workdir."""
        d = self.run_dir(sub.run_id)
        write_text_atomic(d / "cfg.toml", sub.run_toml)
        write_text_atomic(d / "job.yaml", sub.spec_yaml)  # validated, no comments
        return d
