"""The artifact store: the only code that writes run artifacts, locally or on gs://.

Every file is complete or absent. Locally a file is written to `<name>.tmp-<pid>` beside it and
renamed into place; on gs:// a single-object upload is already atomic. Host-global files are
written by the writer host only (the check lives here, not at call sites); per-host files go
under `hosts/<process_index>/` and any host may write them.

JSONL files are appended: locally in place; on gs:// (no append) as bounded parts
`<name>.parts/000000.jsonl`, … (runfolder.storage), so an append costs at most one part's upload
however long the run. Storage faults (ENOSPC, EIO, gs:// 5xx, timeouts) are retried
(runfolder.storage.with_retries: every try has a deadline, so a server that stops answering is a
failed try) and then end the job restartable (StorageFaultError, exit 45); a missing bucket or
permission stays StorageError (exit 2).

A torn last JSONL line (a crash mid-append) is dropped with a warning by readers and cut off the
file by the writer before it appends again; a bad line anywhere else is corruption.

Everything written is strict JSON: a NaN or infinite float (a diverged step's loss) is written
`null`, never a bare NaN/Infinity that other JSON readers refuse.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from jobspec.errors import StorageError
from jobspec.run_config import is_remote
from runfolder.layout import host_dir
from runfolder.storage import (
    DEFAULT_RETRY,
    PART_BYTES,
    RetryPolicy,
    join,
    list_parts,
    part_path,
    parts_dir,
    read_parted,
    read_parted_tail,
    url_to_fs,
    with_retries,
)

T = TypeVar("T")


class NotWriterError(RuntimeError):
    """A non-writer host tried to write a host-global artifact: a bug in the caller, not bad input."""


class ArtifactStore:
    """Files under one run directory, `<output_uri>/<run_id>`, addressed by relative paths."""

    def __init__(
        self,
        root_uri: str,
        *,
        process_index: int = 0,
        writer_index: int = 0,
        retry: RetryPolicy = DEFAULT_RETRY,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.remote = is_remote(root_uri)
        self.fs, self._root = url_to_fs(root_uri)
        # Locally the resolved absolute path is the URI; on gs:// keep the scheme callers gave.
        self.root_uri = root_uri.rstrip("/") if self.remote else self._root.rstrip("/")
        self.process_index = process_index
        self.writer_index = writer_index
        self.retry = retry
        self.part_bytes = part_bytes
        # gs:// JSONL appends: the tail part of each file this process appends to.
        self._tails: dict[str, _Tail] = {}

    @property
    def is_writer(self) -> bool:
        return self.process_index == self.writer_index

    def uri(self, rel: str = "") -> str:
        return join(self.root_uri, rel)

    def _path(self, rel: str) -> str:
        return join(self._root, rel)

    def host_rel(self, rel: str) -> str:
        return join(host_dir(self.process_index), rel)

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

    def write_own_bytes(self, rel: str, data: bytes) -> None:
        """A file only this process writes, at a path that names its host (a profile trace under
        profile/host-<i>/): not host-global, so any process may."""
        self._put(rel, data)

    def append_jsonl(self, rel: str, rows: list[dict]) -> None:
        """Add whole rows to a JSONL file; rows already there (a resumed run's) are kept."""
        self._require_writer(rel)
        if not rows:
            return
        lines = b"".join(_dump_jsonl_row(self.uri(rel), r) for r in rows)
        if self.remote:
            self._append_parts(rel, lines)
        else:
            self._append_local(rel, lines)

    def truncate_jsonl_after(self, rel: str, key: str, value: int | float) -> int:
        """Drop rows whose `key` is greater than `value` (rows logged after the checkpoint a run
        resumes from would otherwise appear twice), and a torn last line; returns how many rows
        were dropped."""
        self._require_writer(rel)
        return self._filter_jsonl(rel, lambda r: not (key in r and r[key] > value))

    def _filter_jsonl(self, rel: str, keep: Callable[[dict], bool]) -> int:
        if not self.exists(rel):
            return 0
        self._tails.pop(rel, None)
        segments = self._segments(rel)
        dropped = 0
        # From the last segment back: a crash part-way leaves later rows dropped and earlier ones
        # kept, never a duplicate or a reordering, and the next resume finishes the job.
        for i in reversed(range(len(segments))):
            path, rows, torn = segments[i]
            kept = [r for r in rows if keep(r)]
            dropped += len(rows) - len(kept)
            if len(kept) == len(rows) and not torn:
                continue
            if torn:
                self._warn_torn(rel, repaired=True)
            data = b"".join(_dump_jsonl_row(self.uri(rel), r) for r in kept)
            if kept or not self.remote:
                self._put_path(path, data, rel)
            else:
                self._io(lambda p=path: self.fs.rm_file(p), f"delete {self.uri(rel)} part")
        return dropped

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Remove a host-global file (or directory with recursive=True); absent is fine."""
        self._require_writer(rel)
        path = self._path(rel)
        self._fresh()
        if self._io(lambda: self.fs.exists(path), f"check {self.uri(rel)}"):
            self._io(lambda: self.fs.rm(path, recursive=recursive), f"delete {self.uri(rel)}")

    def _io(self, fn: Callable[[], T], what: str) -> T:
        """A storage call, retried on faults (StorageFaultError once spent); other OSErrors are
        the user's storage (StorageError)."""
        try:
            return with_retries(fn, what, self.retry)
        except OSError as e:
            raise StorageError(
                f"cannot {what}: {_reason(e)}; check that run.output_uri is writable"
            ) from e

    def _put(self, rel: str, data: bytes) -> None:
        self._put_path(self._path(rel), data, rel)

    def _put_path(self, path: str, data: bytes, rel: str) -> None:
        if self.remote:
            self._io(lambda: self.fs.pipe_file(path, data), f"write {self.uri(rel)}")
        else:
            self._io(lambda: _atomic_write_local(path, data), f"write {self.uri(rel)}")

    def _append_parts(self, rel: str, lines: bytes) -> None:
        """gs://: rewrite the tail part with the new lines while it stays under part_bytes,
        else start the next part; the state moves on only once the upload succeeded."""
        path = self._path(rel)
        tail = self._tails.get(rel)
        if tail is None:
            tail = self._tails[rel] = self._load_tail(rel)
        index, data = tail.index, tail.data + lines
        if tail.data and len(data) > self.part_bytes:
            index, data = index + 1, lines
        self._put_path(part_path(path, index), data, rel)
        self._tails[rel] = _Tail(index, data)

    def _load_tail(self, rel: str) -> _Tail:
        path = self._path(rel)
        self._fresh()
        parts = self._io(lambda: list_parts(self.fs, path), f"list {self.uri(rel)}")
        if not parts:
            return _Tail(0, b"")
        index, last = parts[-1]
        data = self._io(lambda: bytes(self.fs.cat_file(last)), f"read {self.uri(rel)}")
        rows, torn = _parse_jsonl(self.uri(rel), data, final=True)
        if torn:  # never append after half a line: it would join the next row
            self._warn_torn(rel, repaired=True)
            data = b"".join(_dump_jsonl_row(self.uri(rel), r) for r in rows)
        return _Tail(index, data)

    def _append_local(self, rel: str, data: bytes) -> None:
        # One write() of whole lines, then fsync; a short write is cut back so no half line stays.
        path = self._path(rel)

        def append() -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.fstat(fd).st_size
                if start and _cut_torn_tail(fd, start):
                    self._warn_torn(rel, repaired=True)
                    start = os.fstat(fd).st_size
                try:
                    view = memoryview(data)
                    while view:  # a short write means the disk is (nearly) full: the next
                        view = view[os.write(fd, view) :]  # write() raises the real ENOSPC
                    os.fsync(fd)
                except BaseException:
                    os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)

        self._io(append, f"append to {self.uri(rel)}")

    def _warn_torn(self, rel: str, *, repaired: bool) -> None:
        what = "cut it off the file" if repaired else "ignoring it"
        print(
            f"warning: the last line of {self.uri(rel)} was torn (a write cut short by a crash); "
            f"{what}",
            file=sys.stderr,
            flush=True,
        )

    def _segments(self, rel: str) -> list[tuple[str, list[dict], bool]]:
        """(path, rows, torn last line) of a JSONL file's plain object and each part, in order."""
        path = self._path(rel)
        self._fresh()
        plain = self._io(lambda: self.fs.isfile(path), f"check {self.uri(rel)}")
        paths = [path] if plain else []
        if self.remote:
            parts = self._io(lambda: list_parts(self.fs, path), f"list {self.uri(rel)}")
            paths += [p for _, p in parts]
        out = []
        for k, p in enumerate(paths):
            data = self._io(lambda p=p: bytes(self.fs.cat_file(p)), f"read {self.uri(rel)}")
            rows, torn = _parse_jsonl(self.uri(rel), data, final=k == len(paths) - 1)
            out.append((p, rows, torn))
        return out

    # ---- reads (any host) --------------------------------------------------------------------

    def _fresh(self) -> None:
        # gcsfs caches listings per instance, and Orbax/other hosts write through other clients:
        # drop the cache so every read sees the bucket as it is now.
        if self.remote:
            self.fs.invalidate_cache()

    def exists(self, rel: str = "") -> bool:
        """Whether `rel` exists (for a JSONL file on gs://, as a plain object or as parts)."""
        self._fresh()
        path = self._path(rel)
        if self._io(lambda: self.fs.exists(path), f"check {self.uri(rel)}"):
            return True
        if self.remote and rel.endswith(".jsonl"):
            return self._io(lambda: self.fs.exists(parts_dir(path)), f"check {self.uri(rel)}")
        return False

    def isdir(self, rel: str) -> bool:
        self._fresh()
        path = self._path(rel)
        return bool(self._io(lambda: self.fs.isdir(path), f"check {self.uri(rel)}"))

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names directly under `rel`; an absent directory lists as empty."""
        self._fresh()
        path = self._path(rel)
        try:
            entries = with_retries(
                lambda: self.fs.ls(path, detail=False), f"list {self.uri(rel)}", self.retry
            )
        except FileNotFoundError:
            return []
        base = self._path(rel).rstrip("/")
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        names.discard(posixpath.basename(base))  # some backends list a directory's own marker
        return sorted(n for n in names if n)

    def read_bytes(self, rel: str) -> bytes:
        self._fresh()
        return self._read(self._path(rel), rel, lambda p: bytes(self.fs.cat_file(p)))

    def _read(self, path: str, rel: str, fn: Callable[[str], bytes]) -> bytes:
        try:
            return with_retries(lambda: fn(path), f"read {self.uri(rel)}", self.retry)
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

    def read_jsonl(self, rel: str, *, warn_torn: bool = True) -> list[dict]:
        """Every row of a JSONL file (on gs://, its plain object and parts in order). A torn last
        line is left out, with a warning unless not `warn_torn` (a reader of a live run: the
        line may be an append still being written); the writer cuts it off before appending."""
        self._fresh()
        if self.remote:
            data = self._read(self._path(rel), rel, lambda p: read_parted(self.fs, p))
        else:
            data = self.read_bytes(rel)
        rows, torn = _parse_jsonl(self.uri(rel), data, final=True)
        if torn and warn_torn:
            self._warn_torn(rel, repaired=False)
        return rows

    def read_jsonl_tail(self, rel: str, nbytes: int = 64 * 1024) -> list[dict]:
        """The whole rows in about the last `nbytes` of a JSONL file, oldest first (none if it is
        absent): the cut first line of the tail and a torn last line are left out."""
        self._fresh()
        data = self._read(self._path(rel), rel, lambda p: read_parted_tail(self.fs, p, nbytes))
        rows = []
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def last_jsonl_row(self, rel: str) -> dict | None:
        """The last whole row of a JSONL file, reading only its end (None if it has none)."""
        rows = self.read_jsonl_tail(rel)
        return rows[-1] if rows else None

    def probe(self) -> None:
        """One listing of the run directory, unretried: whether its storage answers at all (a
        missing directory is an answer too). For a watcher with a deadline (runfolder.storage.answers)."""
        self._fresh()
        try:
            self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            pass

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

        def write_probe() -> None:
            if self.remote:
                self.fs.pipe_file(probe, b"probe")
            else:
                _atomic_write_local(probe, b"probe")
            self.fs.rm_file(probe)

        try:
            with_retries(write_probe, f"write a probe file under {self.root_uri}", self.retry)
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


@dataclass(frozen=True)
class _Tail:
    index: int  # the part number
    data: bytes  # what that part holds now


def _parse_jsonl(uri: str, data: bytes, *, final: bool) -> tuple[list[dict], bool]:
    """(rows, whether a torn last line was left out). A bad last line of the file's final
    segment is a write a crash cut short; a bad line anywhere else is corruption."""
    lines = data.split(b"\n")
    rows: list[dict] = []
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if final and i == last:
                return rows, True
            raise StorageError(
                f"{uri} line {i + 1} is not valid JSON ({e}) and is not the last line, so it is "
                "corruption rather than a torn write; restore the file or remove that line"
            ) from e
    return rows, False


def _cut_torn_tail(fd: int, size: int) -> bool:
    """Truncate a local file after its last newline when it does not end in one (a torn
    append); True if it did. Reads backwards in small blocks: appends stay cheap."""
    if os.pread(fd, 1, size - 1) == b"\n":
        return False
    end = size
    while end > 0:
        start = max(0, end - 65536)
        block = os.pread(fd, end - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            os.ftruncate(fd, start + nl + 1)
            return True
        end = start
    os.ftruncate(fd, 0)
    return True


def finite_json(obj: Any) -> Any:
    """`obj` with every NaN or infinite float (numpy's too) replaced by None, so it serialises
    as strict JSON: a diverged step's loss is written `null`, never a bare NaN/Infinity."""
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def _dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (allow_nan=False); non-finite floats become null. The common case (every
    float finite) is serialised once, without walking the object."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(finite_json(obj), allow_nan=False, **kw)


def _dump_json(uri: str, obj: Any) -> bytes:
    try:
        return (_dumps(obj, indent=2) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"cannot serialise {uri} as JSON: {e}") from e


def _dump_jsonl_row(uri: str, row: dict) -> bytes:
    try:
        return (_dumps(row, separators=(",", ":")) + "\n").encode()
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
