"""Each host tees its stdout/stderr to `<run>/logs/attempt-<n>/host-<i>.log` through fsspec.

Pods and their logs vanish on a JobSet restart or TTL; the run's own storage keeps them, so
`launch logs` works afterwards. The tee works at the file-descriptor level, so output of C++
libraries (XLA, gloo) is kept too. Locally the log is appended as it comes; on object stores
(no append) the whole object is rewritten every few seconds and at exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from jobspec.storage import PART_BYTES, is_remote, join, part_path, url_to_fs

FLUSH_EVERY_S = 5.0
_active: list[HostLogTee] = []


def hard_exit(code: int) -> None:
    """os._exit for paths that must not wait for Python's shutdown (a lost host, a cluster that
    never formed): drain the tee first, so the last message reaches the terminal and the log."""
    for tee in list(_active):
        tee.close()
    os._exit(code)


def log_uri(run_root: str, attempt: int, process_index: int) -> str:
    return join(run_root, f"logs/attempt-{attempt}/host-{process_index}.log")


class HostLogTee:
    """Duplicates fds 1 and 2 into a log file while they still reach the original outputs."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.path = url_to_fs(uri)
        self.remote = is_remote(uri)
        self._buf = bytearray()
        self._lock = threading.Lock()  # guards _buf, _local and _last_flush
        self._upload_lock = threading.Lock()  # one upload at a time, each of a newer snapshot
        self._uploaded = -1  # length of _buf the last successful upload held (-1: none yet)
        self._threads: list[threading.Thread] = []
        self._last_flush = time.monotonic()
        self._local = None
        self._originals: dict[int, int] = {}
        self._closed = False

    def start(self) -> HostLogTee:
        self.fs.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if not self.remote:
            self._local = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open for the run
        for fd in (1, 2):
            original = os.dup(fd)
            self._originals[fd] = original
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(
                target=self._pump, args=(r, original), daemon=True, name=f"tee-{fd}"
            )
            t.start()
            self._threads.append(t)
        atexit.register(self.close)
        _active.append(self)
        return self

    def _pump(self, r: int, original: int) -> None:
        while True:
            try:
                chunk = os.read(r, 65536)
            except OSError:
                return
            if not chunk:
                return
            os.write(original, chunk)
            due = False
            with self._lock:
                if self._local is not None:
                    self._local.write(chunk)
                else:
                    self._buf.extend(chunk)
                    now = time.monotonic()
                    if now - self._last_flush > FLUSH_EVERY_S:
                        self._last_flush = now  # this pump uploads; the other one need not
                        due = True
            if due:  # outside the lock: the other pump keeps copying output meanwhile
                self._flush_remote()

    _part = 0  # the log part being written on an object store (see _flush_remote)

    def _flush_remote(self) -> None:
        """Upload what is new as the log's tail part, `<log>.parts/000000.log`, … (jobspec.storage
        parted objects, which `launch logs` reads back in order): the part is rewritten while
        under PART_BYTES, then the next one starts and the finished bytes leave memory, so an
        upload costs at most one part however long the run. The snapshot is taken under the
        upload lock, so a later upload never holds less than an earlier one."""
        with self._upload_lock:
            with self._lock:
                data = bytes(self._buf)  # the current part's bytes only
            if len(data) == self._uploaded:
                return  # nothing new since the last upload
            try:
                self.fs.pipe_file(part_path(self.path, self._part), data)
            except Exception:  # a log upload must never take the training run down with it
                return  # the bytes stay buffered: the next flush uploads them
            self._uploaded = len(data)
            if len(data) >= PART_BYTES:
                with self._lock:
                    del self._buf[: len(data)]
                self._part += 1
                self._uploaded = 0

    def close(self) -> None:
        """Put the original fds back, drain the pipes, write the rest of the log."""
        if self._closed or not self._originals:
            return
        self._closed = True
        if self in _active:
            _active.remove(self)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, original in self._originals.items():
            os.dup2(original, fd)  # closes the pipe's write end: its pump sees EOF and ends
        for t in self._threads:
            t.join(timeout=2.0)
        with self._lock:
            local, self._local = self._local, None
        if local is not None:
            local.close()
        elif self.remote:
            self._flush_remote()
