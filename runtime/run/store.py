"""The artifact store: the only code that writes run artifacts, locally or on gs://.

Every file is complete or absent. Locally a file is written to `<name>.tmp-<pid>` beside it and
renamed into place; on gs:// a single-object upload is already atomic. Host-global files are
written by the writer host only (the check lives here, not at call sites); per-host files go
under `hosts/<process_index>/` and any host may write them.
"""

from __future__ import annotations

import json
import os
import posixpath
from typing import Any

from jobspec.errors import StorageError
from jobspec.storage import is_remote, join, url_to_fs


class NotWriterError(RuntimeError):
    """A non-writer host tried to write a host-global artifact: a bug in the caller, not bad input."""


class ArtifactStore:
    """Files under one run directory, `<output_uri>/<run_id>`, addressed by relative paths."""

    def __init__(self, root_uri: str, *, process_index: int = 0, writer_index: int = 0) -> None:
        self.remote = is_remote(root_uri)
        self.fs, self._root = url_to_fs(root_uri)
        # Locally the resolved absolute path is the URI; on gs:// keep the scheme callers gave.
        self.root_uri = root_uri.rstrip("/") if self.remote else self._root.rstrip("/")
        self.process_index = process_index
        self.writer_index = writer_index
        # Rows of each JSONL file this process has read or written, so gs:// appends (which must
        # rewrite the object) do not re-read it every time.
        self._jsonl_rows: dict[str, list[dict]] = {}

    @property
    def is_writer(self) -> bool:
        return self.process_index == self.writer_index

    def uri(self, rel: str = "") -> str:
        return join(self.root_uri, rel)

    def _path(self, rel: str) -> str:
        return join(self._root, rel)

    def host_rel(self, rel: str) -> str:
        return join(f"hosts/{self.process_index}", rel)

    # ---- writes ------------------------------------------------------------------------------

    def _require_writer(self, rel: str) -> None:
        if not self.is_writer:
            raise NotWriterError(
                f"process {self.process_index} tried to write host-global artifact {self.uri(rel)}, "
                f"but only the writer (process {self.writer_index}) may; use write_host_* for "
                "per-host files"
            )

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._require_writer(rel)
        self._put(rel, data)

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, _dump_json(self.uri(rel), obj))

    def write_host_text(self, rel: str, text: str) -> None:
        self._put(self.host_rel(rel), text.encode())

    def write_host_json(self, rel: str, obj: Any) -> None:
        hrel = self.host_rel(rel)
        self._put(hrel, _dump_json(self.uri(hrel), obj))

    def append_jsonl(self, rel: str, rows: list[dict]) -> None:
        """Add whole rows to a JSONL file; rows already there (a resumed run's) are kept."""
        self._require_writer(rel)
        if not rows:
            return
        lines = b"".join(_dump_jsonl_row(self.uri(rel), r) for r in rows)
        existing = self._cached_rows(rel)
        if self.remote:
            # No append on object stores: rewrite the whole object from the rows held in memory.
            self._put(rel, b"".join(_dump_jsonl_row(self.uri(rel), r) for r in existing) + lines)
        else:
            self._append_local(rel, lines)
        existing.extend(json.loads(line) for line in lines.splitlines())

    def truncate_jsonl_after(self, rel: str, key: str, value: int | float) -> int:
        """Drop rows whose `key` is greater than `value` (rows logged after the checkpoint a run
        resumes from would otherwise appear twice); returns how many rows were dropped."""
        self._require_writer(rel)
        if not self.exists(rel):
            return 0
        rows = self._cached_rows(rel)
        kept = [r for r in rows if not (key in r and r[key] > value)]
        dropped = len(rows) - len(kept)
        if dropped:
            self._put(rel, b"".join(_dump_jsonl_row(self.uri(rel), r) for r in kept))
            self._jsonl_rows[rel] = kept
        return dropped

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Remove a host-global file (or directory with recursive=True); absent is fine."""
        self._require_writer(rel)
        path = self._path(rel)
        self._fresh()
        if self.fs.exists(path):
            self.fs.rm(path, recursive=recursive)

    def _cached_rows(self, rel: str) -> list[dict]:
        if rel not in self._jsonl_rows:
            self._jsonl_rows[rel] = self.read_jsonl(rel) if self.exists(rel) else []
        return self._jsonl_rows[rel]

    def _put(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        try:
            if self.remote:
                self.fs.pipe_file(path, data)
            else:
                _atomic_write_local(path, data)
        except OSError as e:
            raise StorageError(
                f"cannot write {self.uri(rel)}: {_reason(e)}; check that run.output_uri is writable"
            ) from e

    def _append_local(self, rel: str, data: bytes) -> None:
        # One write() of whole lines, then fsync; a short write is cut back so no half line stays.
        path = self._path(rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.fstat(fd).st_size
                try:
                    if os.write(fd, data) != len(data):
                        raise OSError(f"short write to {path}")
                    os.fsync(fd)
                except BaseException:
                    os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)
        except OSError as e:
            raise StorageError(
                f"cannot append to {self.uri(rel)}: {_reason(e)}; check that run.output_uri is writable"
            ) from e

    # ---- reads (any host) --------------------------------------------------------------------

    def _fresh(self) -> None:
        # gcsfs caches listings per instance, and Orbax/other hosts write through other clients:
        # drop the cache so every read sees the bucket as it is now.
        if self.remote:
            self.fs.invalidate_cache()

    def exists(self, rel: str = "") -> bool:
        self._fresh()
        return bool(self.fs.exists(self._path(rel)))

    def isdir(self, rel: str) -> bool:
        self._fresh()
        return bool(self.fs.isdir(self._path(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names directly under `rel`; an absent directory lists as empty."""
        self._fresh()
        try:
            entries = self.fs.ls(self._path(rel), detail=False)
        except FileNotFoundError:
            return []
        base = self._path(rel).rstrip("/")
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        names.discard(posixpath.basename(base))  # some backends list a directory's own marker
        return sorted(n for n in names if n)

    def read_bytes(self, rel: str) -> bytes:
        self._fresh()
        try:
            return bytes(self.fs.cat_file(self._path(rel)))
        except FileNotFoundError as e:
            raise StorageError(f"{self.uri(rel)} does not exist; check the run directory") from e
        except IsADirectoryError as e:
            raise StorageError(f"{self.uri(rel)} is a directory, not a file") from e
        except OSError as e:
            raise StorageError(f"cannot read {self.uri(rel)}: {_reason(e)}") from e

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def read_json(self, rel: str) -> Any:
        try:
            return json.loads(self.read_bytes(rel))
        except json.JSONDecodeError as e:
            raise StorageError(f"{self.uri(rel)} is not valid JSON ({e}); it may be corrupt") from e

    def read_jsonl(self, rel: str) -> list[dict]:
        text = self.read_text(rel)
        rows: list[dict] = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise StorageError(f"{self.uri(rel)} line {n} is not valid JSON ({e})") from e
        return rows

    # ---- start-up check ----------------------------------------------------------------------

    def check_writable(self) -> None:
        """Create the run directory and write and delete a probe; fail early with one sentence."""
        if not self.remote:
            try:
                os.makedirs(self._root, exist_ok=True)
            except OSError as e:
                raise StorageError(
                    f"cannot create output directory {self.root_uri}: {_reason(e)}; "
                    "choose a writable run.output_uri"
                ) from e
        probe = self._path(f".write-probe-{self.process_index}-{os.getpid()}")
        try:
            if self.remote:
                self.fs.pipe_file(probe, b"probe")
            else:
                _atomic_write_local(probe, b"probe")
            self.fs.rm_file(probe)
        except FileNotFoundError as e:
            if self.remote:
                # An upload answers 404 only when the bucket itself is missing.
                bucket = self._root.split("/", 1)[0]
                raise StorageError(
                    f"gs bucket '{bucket}' does not exist; create it or fix run.output_uri"
                ) from e
            raise StorageError(f"output directory {self.root_uri} vanished while probing it") from e
        except OSError as e:
            raise StorageError(
                f"output directory {self.root_uri} is not writable ({_reason(e)}); "
                "fix its permissions or choose another run.output_uri"
            ) from e


def _dump_json(uri: str, obj: Any) -> bytes:
    try:
        return (json.dumps(obj, indent=2) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"cannot serialise {uri} as JSON: {e}") from e


def _dump_jsonl_row(uri: str, row: dict) -> bytes:
    try:
        return (json.dumps(row, separators=(",", ":")) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"cannot serialise a row of {uri} as JSON: {e}") from e


def _atomic_write_local(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__
