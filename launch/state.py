"""Where `launch` keeps its files on this machine, and how it writes them.

Under `$XDG_STATE_HOME/jaxjob/` (default `~/.local/state/jaxjob/`), `runs/<run_id>/` is a run's
own folder: what its hosts read (cfg.toml, job.yaml) and what its backend keeps there. Every JSON
file is written to a temporary name and renamed, so a reader sees all of it or none. The run
registry (registry.py) adds the records; backends need only the folders. `.submit.lock` in a run's
folder is held (flock) while one `launch submit` checks that the run is not running and starts it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch.backend import Submission

SUBMIT_LOCK = ".submit.lock"


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

    @contextmanager
    def submit_lock(self, run_id: str) -> Iterator[None]:
        """Held by one submit of `run_id` at a time, from its check that the run is not running
        until its record is written, so two submits cannot both pass the check. Blocks while
        another holds it (a submit takes seconds at most)."""
        path = self.run_dir(run_id) / SUBMIT_LOCK
        while True:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A failed first submit removes the run's folder, lock and all, while a second one
            # waits on that file: the second then locks afresh what is there now.
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)  # closing the last descriptor releases the lock
