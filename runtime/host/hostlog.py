"""Each host tees its stdout/stderr to `<run>/logs/attempt-<n>/host-<i>.log` through fsspec.

Pods and their logs vanish on a JobSet restart or TTL; the run's own storage keeps them, so
`launch logs` works afterwards. The tee works at the file-descriptor level, so output of C++
libraries (XLA, gloo) is kept too. Locally the log is appended as it comes; on object stores
(no append) the whole object is rewritten every few seconds and at exit.

A host never blocks on its own log. Fds 1 and 2 become pipes, and one pump thread per pipe only
reads and hands each chunk to *sinks* (the original stdout/stderr and the log file), each
written by a thread of its own. A sink whose destination fails (ENOSPC, EIO, a vanished reader:
EPIPE) or stalls (a terminal nobody reads) keeps up to a bound of unwritten bytes, retries, and
drops what does not fit, counting it; so the pipes always drain and a `print` never waits on a
disk. The first failure of an outage is said once on the original stderr ("warning: cannot
write host log ...: No space left on device; dropping log lines until it can be written"), the
recovery once with what was lost, and the log itself gets a marker line where lines are missing.

Beside each log, a sidecar `host-<i>.log.times` records when its lines arrived, for `launch logs
--since/--timestamps` (launch/logs_options.py): text records `<newlines in the log> <unix
time>` (runfolder.layout.line_times_record), taken as the log accepts each chunk, so they count
exactly the log's bytes (marker lines included) and a line's time is that of the first record
whose count exceeds its index. The log's bytes are not changed. Chunks that arrive within
TIMES_GRAIN_S of the last record share one record (a burst of output costs one line, not one
per write; a line's time is then at most that much late); a line still without its newline at
close gets a record of its own. The sidecar is written the same never-blocking way, by a sink
of its own (locally) or uploaded in parts by the same flusher (object stores, before the log, so
a reader never finds a new log without its sidecar); what does not fit while it cannot be
written is dropped and counted, silently (it shares the log's folder and disk, whose outage the
log's warning says), and the lines meanwhile show the next recorded time. The first record,
`0 <time>`, is when the tee started.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jobspec.run_config import is_remote
from runfolder.layout import LINE_TIMES, host_log, line_times_record
from runfolder.storage import PART_BYTES, join, part_path, url_to_fs

FLUSH_EVERY_S = 5.0
# Bytes a sink holds while its destination fails or stalls; output beyond that is dropped (and
# counted) rather than kept in memory without bound or allowed to block the pumps.
LOG_DEFER_BYTES = 1 << 20
TERMINAL_DEFER_BYTES = 1 << 20
TIMES_DEFER_BYTES = 256 << 10  # the line-times sidecar's bound (a record is about 20 bytes)
TIMES_GRAIN_S = 0.01  # chunks closer than this to the last record share one record
RETRY_S = (0.2, 1.0, 2.0, 5.0)  # waits between retries of a failing destination
CLOSE_TIMEOUT_S = 5.0  # longest close() waits for sinks to drain (a stuck disk must not hang exit)
UPLOAD_CLOSE_TIMEOUT_S = 60.0  # the last upload of a normal exit (not a hard exit) may take longer
_active: list[HostLogTee] = []


def hard_exit(code: int) -> None:
    """os._exit for paths that must not wait for Python's shutdown (a lost host, a cluster that
    never formed): drain the tee first (bounded in time), so the last message reaches the
    terminal and the log even when the main thread is stuck."""
    for tee in list(_active):
        tee.close(timeout=CLOSE_TIMEOUT_S)
    os._exit(code)


def fatal(message: str, code: int) -> None:
    """`error: message` on stderr, then hard_exit(code): the way a watcher thread ends the
    process. Straight to fd 2, not through sys.stderr: a main thread stuck inside a write to it
    would hold its lock. The tee's pump always drains fd 2, so this write does not block."""
    try:
        os.write(2, f"error: {message}\n".encode())
    except OSError:
        pass
    hard_exit(code)


def log_uri(run_root: str, attempt: int, process_index: int) -> str:
    return join(run_root, host_log(attempt, process_index))


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


class _Sink:
    """Bytes bound for one destination, written by a daemon thread of its own.

    `write(data)` writes a prefix of `data` and returns its length, or raises OSError. While it
    fails, up to `limit` bytes wait and are retried; chunks that do not fit are dropped whole and
    counted, and a marker line takes their place once writing resumes. `warn` gets one sentence
    when an outage starts and one when it ends; it must not block. `markers=False`: no marker
    line (a file of records, not of output). `accepted(data)` is told every byte queued, in the
    order written, under the sink's lock (the log's line clock).
    """

    def __init__(
        self,
        what: str,
        write: Callable[[bytes], int],
        limit: int,
        warn: Callable[[str], None],
        *,
        markers: bool = True,
        accepted: Callable[[bytes], None] | None = None,
    ) -> None:
        self.what = what
        self._write = write
        self._limit = limit
        self._warn = warn
        self._markers = markers
        self._accepted = accepted
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._closing = False
        self._ends_line = True  # whether the last byte accepted was a newline (for the marker)
        self._gap_bytes = self._gap_lines = 0  # dropped since the last accepted chunk
        self._gap_reason = ""
        self._lost_bytes = self._lost_lines = 0  # dropped during the current outage
        self._error: str | None = None  # why the destination fails, while it does
        self._outage = False  # from the first failure or drop until the backlog is written
        self._failures = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"hostlog-{what}")
        self._thread.start()

    def put(self, chunk: bytes) -> None:
        """Queue `chunk`; never blocks on the destination."""
        stalled = False
        with self._cond:
            # Once dropping, drop until the backlog is written: one gap (one marker) per outage.
            if len(self._buf) + len(chunk) > self._limit or (self._gap_bytes and self._buf):
                lines = chunk.count(b"\n")
                if not self._gap_bytes:
                    self._gap_reason = self._error or "it was not taking output"
                # A destination that blocks rather than fails (a terminal nobody reads, a hung
                # mount) starts its outage here; one that fails started it in _failed.
                stalled = not self._outage
                self._outage = True
                self._gap_bytes += len(chunk)
                self._gap_lines += lines
                self._lost_bytes += len(chunk)
                self._lost_lines += lines
            else:
                marker = self._marker() if self._gap_bytes else b""
                added = marker + chunk if self._markers else chunk
                self._buf += added
                if self._accepted is not None:
                    self._accepted(added)
                self._ends_line = chunk.endswith(b"\n")
                self._cond.notify()
        if stalled:  # outside the lock: warn puts into another sink, whose put may warn back
            self._warn(
                f"warning: {self.what} is not taking output; dropping log lines until it does"
            )

    def _marker(self) -> bytes:
        lead = "" if self._ends_line else "\n"
        text = (
            f"{lead}[jaxjob: {self._gap_lines} lines ({self._gap_bytes} bytes) of output were "
            f"dropped here: {self.what} could not be written ({self._gap_reason})]\n"
        )
        self._gap_bytes = self._gap_lines = 0
        return text.encode()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._buf and not self._closing:
                    self._cond.wait()
                if not self._buf:
                    return  # closing and drained
                data = bytes(self._buf)
                closing = self._closing
            try:
                n = self._write(data)
            except OSError as e:
                self._failed(e)
                if closing:
                    return  # no retries while the process ends: what is left is dropped
                with self._cond:
                    self._cond.wait(RETRY_S[min(self._failures - 1, len(RETRY_S) - 1)])
                continue
            with self._cond:
                del self._buf[:n]
                recovered = self._outage and not self._buf
            if recovered:
                self._recovered()

    def _failed(self, e: OSError) -> None:
        self._failures += 1
        if self._error is None:
            self._error = _reason(e)
        with self._cond:
            started, self._outage = not self._outage, True
        if started:
            self._warn(
                f"warning: cannot write {self.what}: {self._error}; dropping log lines until "
                "it can be written"
            )

    def _recovered(self) -> None:
        with self._cond:
            lost_b, lost_l = self._lost_bytes, self._lost_lines
            self._lost_bytes = self._lost_lines = 0
            self._error, self._failures, self._outage = None, 0, False
        self._warn(
            f"{self.what} can be written again; {lost_l} lines ({lost_b} bytes) were dropped "
            "while it could not"
        )

    def close(self, deadline: float) -> None:
        """Write what is queued (one try each if the destination still fails), then stop;
        returns by `deadline` (time.monotonic()) even if the destination blocks."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))


def _write_fd(fd: int) -> Callable[[bytes], int]:
    return lambda data: os.write(fd, data)


def _quiet(_line: str) -> None:
    """The sidecar's outages are not said: the log beside it, on the same disk, says them."""


class _LineClock:
    """When the log's lines arrived: told every byte the log accepts (`accepted`, in the log's
    order), it hands `<lines> <time>` records to `emit` (the sidecar's sink or upload).

    A chunk with newlines gets a record, unless the last record is under TIMES_GRAIN_S old: then
    the record is held and moved on with each such chunk (the lines keep their own time to
    within the grain), and handed on with the next chunk after the grain (with or without a
    newline), at `settle()` (each upload) or at `finish()`. Times never go back (a clock set
    back by NTP repeats the last time).
    """

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._lines = 0
        self._open = False  # the log's last byte is not a newline: a line is under way
        self._last = 0.0  # the latest time recorded
        self._grain = float("-inf")  # when the last record handed on was taken
        self._held: tuple[int, float] | None = None

    def _now(self) -> float:
        self._last = max(time.time(), self._last)
        return self._last

    def accepted(self, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            self._open = not data.endswith(b"\n")
            n = data.count(b"\n")
            now = self._now()
            late = now - self._grain >= TIMES_GRAIN_S
            out = self._take_held() if late else b""
            if n:
                self._lines += n
                if late:
                    out += line_times_record(self._lines, now)
                    self._grain = now
                else:
                    self._held = (self._lines, now)
            if out:
                self._emit(out)

    def _take_held(self) -> bytes:
        held, self._held = self._held, None
        return b"" if held is None else line_times_record(*held)

    def start(self) -> None:
        """The first record, `0 <time>`: when the tee started (and the sidecar exists from then)."""
        with self._lock:
            self._emit(line_times_record(0, self._now()))

    def settle(self) -> None:
        """Hand on a held record (before an upload: its lines get their own time, not a later one)."""
        with self._lock:
            if out := self._take_held():
                self._emit(out)

    def finish(self, whole: bool) -> None:
        """At close: the held record, and when `whole` (every pump has ended, so nothing more comes)
        one for a last line that never got its newline."""
        with self._lock:
            out = self._take_held()
            if whole and self._open:
                self._lines += 1
                self._open = False
                out += line_times_record(self._lines, self._now())
            if out:
                self._emit(out)


class _Upload:
    """A growing file on an object store (no append), uploaded as parts (runfolder.storage parted
    objects, which readers read back in order): the current part is rewritten while under
    PART_BYTES, then the next one starts and its finished bytes leave memory, so an upload costs
    at most one part however long the run. While uploads fail, what exceeds `limit` beyond the
    current part is dropped and counted. Only the tee's flusher thread uploads."""

    def __init__(self, fs: Any, path: str, limit: int) -> None:
        self.fs, self.path, self.limit = fs, path, limit
        self.buf = bytearray()  # the current part's bytes, and what follows it
        self.lock = threading.Lock()  # guards buf and dropped
        self.uploaded = -1  # length of buf the last successful upload held (-1: none yet)
        self.part = 0
        self.dropped = 0  # bytes not kept since the last successful upload

    def add(self, data: bytes, accepted: Callable[[bytes], None] | None = None) -> bool | None:
        """Keep `data` for the next upload (telling `accepted`, in order, under the lock): None;
        else it is dropped and counted: whether it is the first drop since the last upload."""
        with self.lock:
            if len(self.buf) + len(data) <= PART_BYTES + self.limit:
                self.buf.extend(data)
                if accepted is not None:
                    accepted(data)
                return None
            first = not self.dropped
            self.dropped += len(data)
            return first

    def upload(self) -> int | None:
        """Upload what is new as the tail part: the bytes dropped since the last upload once it
        succeeded; None when there was nothing new or it failed (the bytes stay buffered: the
        next upload tries them again)."""
        with self.lock:
            data = bytes(self.buf[:PART_BYTES])  # the current part's bytes only
            dropped, self.dropped = self.dropped, 0
        if len(data) == self.uploaded and not dropped:
            return None  # nothing new since the last upload
        try:
            self.fs.pipe_file(part_path(self.path, self.part), data)
        except Exception:  # a log upload must never take the training run down with it
            with self.lock:
                self.dropped += dropped
            return None
        self.uploaded = len(data)
        if len(data) >= PART_BYTES:
            with self.lock:
                del self.buf[: len(data)]
            self.part += 1
            self.uploaded = 0
        return dropped


class HostLogTee:
    """Duplicates fds 1 and 2 into a log file while they still reach the original outputs; the
    sidecar `<log>.times` records when the log's lines arrived (see the module doc)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.path = url_to_fs(uri)
        self.remote = is_remote(uri)
        self.times_path = self.path + LINE_TIMES
        self._clock = _LineClock(self._put_times)
        # On an object store: the log's and the sidecar's uploads (see _flush_remote).
        self._log_upload = _Upload(self.fs, self.path, LOG_DEFER_BYTES)
        self._times_upload = _Upload(self.fs, self.times_path, TIMES_DEFER_BYTES)
        self._threads: list[threading.Thread] = []
        self._fd: int | None = None  # the local log file, opened by its sink's thread
        self._times_fd: int | None = None  # the local sidecar, opened by its sink's thread
        self._originals: dict[int, int] = {}
        self._terminal: dict[int, _Sink] = {}
        self._log: _Sink | None = None
        self._times: _Sink | None = None
        self._flush_now = threading.Event()
        self._closing = threading.Event()
        self._flusher: threading.Thread | None = None
        self._closed = False

    def start(self) -> HostLogTee:
        if self.remote:
            self.fs.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        for fd in (1, 2):
            self._originals[fd] = os.dup(fd)
        # A failing terminal is said in the log; a failing log on the original stderr.
        for fd, name in ((1, "stdout"), (2, "stderr")):
            self._terminal[fd] = _Sink(
                f"the original {name}", _write_fd(self._originals[fd]),
                TERMINAL_DEFER_BYTES, self._note_in_log,
            )  # fmt: skip
        if self.remote:
            self._flusher = threading.Thread(
                target=self._flush_loop, daemon=True, name="hostlog-upload"
            )
            self._flusher.start()
        else:
            self._times = _Sink(
                f"line times {self.times_path}", self._write_times, TIMES_DEFER_BYTES, _quiet,
                markers=False,
            )  # fmt: skip
            self._log = _Sink(
                f"host log {self.path}", self._write_local, LOG_DEFER_BYTES,
                self._note_on_stderr, accepted=self._clock.accepted,
            )  # fmt: skip
        self._clock.start()
        for fd in (1, 2):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(target=self._pump, args=(r, fd), daemon=True, name=f"tee-{fd}")
            t.start()
            self._threads.append(t)
        atexit.register(self.close)
        _active.append(self)
        return self

    def _note_on_stderr(self, line: str) -> None:
        self._terminal[2].put(f"{line}\n".encode())

    def _note_in_log(self, line: str) -> None:
        if self._log is not None:
            self._log.put(f"{line}\n".encode())
        else:
            self._buffer_remote(f"{line}\n".encode())

    def _put_times(self, records: bytes) -> None:
        if self._times is not None:
            self._times.put(records)
        else:
            self._times_upload.add(records)  # dropped and counted when it does not fit

    def _write_local(self, data: bytes) -> int:
        # Opened lazily and retried like a write: a log directory that cannot be created yet
        # (a full disk) is the same outage as a write that fails.
        if self._fd is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return os.write(self._fd, data)

    def _write_times(self, data: bytes) -> int:
        if self._times_fd is None:
            os.makedirs(os.path.dirname(self.times_path) or ".", exist_ok=True)
            self._times_fd = os.open(self.times_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return os.write(self._times_fd, data)

    def _pump(self, r: int, fd: int) -> None:
        """Read one pipe until EOF; hands each chunk on and never waits on a destination."""
        terminal = self._terminal[fd]
        while True:
            try:
                chunk = os.read(r, 65536)
            except OSError:
                break
            if not chunk:
                break
            terminal.put(chunk)
            if self._log is not None:
                self._log.put(chunk)
            else:
                self._buffer_remote(chunk)
        os.close(r)

    def _buffer_remote(self, chunk: bytes) -> None:
        """Keep output for the next upload, bounded like a local log's deferral: while uploads
        fail, what exceeds LOG_DEFER_BYTES is dropped and counted, and said once on stderr."""
        if self._log_upload.add(chunk, self._clock.accepted):
            self._note_on_stderr(
                f"warning: cannot upload host log {self.uri}; dropping log lines until it can be "
                "uploaded"
            )

    def _flush_loop(self) -> None:
        """Uploads happen here, never in a pump: a slow or failing bucket must not block output."""
        while not self._closing.is_set():
            self._flush_now.wait(FLUSH_EVERY_S)
            self._flush_now.clear()
            if self._closing.is_set():
                break
            self._flush_remote()
        self._flush_remote()  # the rest of the log, at close

    def _flush_remote(self) -> None:
        """Upload what is new of the sidecar, then of the log, each as its tail part
        (`<log>.times.parts/000000.times`, `<log>.parts/000000.log`, …; runfolder.storage parted
        objects, which `launch logs` reads back in order). The sidecar goes first: a reader may
        find records of lines not uploaded yet (they wait for them), never a log without its
        sidecar. Only the flusher thread uploads."""
        self._clock.settle()
        self._times_upload.upload()  # its drops: those lines show the next recorded time
        dropped = self._log_upload.upload()
        if dropped:  # the gap is said in the log itself, once it can be written again
            self._note_in_log(f"[jaxjob: {dropped} bytes of output were dropped here]")

    def close(self, timeout: float | None = None) -> None:
        """Put the original fds back, drain the pipes, write the rest of the log; returns within
        about `timeout` seconds (CLOSE_TIMEOUT_S by default) even if a destination is stuck."""
        if self._closed or not self._originals:
            return
        self._closed = True
        deadline = time.monotonic() + (CLOSE_TIMEOUT_S if timeout is None else timeout)
        if self in _active:
            _active.remove(self)
        # Flushed from a helper thread: a main thread stuck inside a write to sys.stdout holds
        # its lock, and hard_exit (from the watchdog) must not wait for it forever.
        flusher = threading.Thread(target=_flush_std_streams, daemon=True)
        flusher.start()
        flusher.join(min(1.0, max(0.0, deadline - time.monotonic())))
        for fd, original in self._originals.items():
            os.dup2(original, fd)  # closes the pipe's write end: its pump sees EOF and ends
        for t in self._threads:
            # A child process that inherited the pipe keeps it open: do not wait for it forever.
            t.join(max(0.0, min(2.0, deadline - time.monotonic())))
        self._clock.finish(whole=not any(t.is_alive() for t in self._threads))
        if self._log is not None:
            self._log.close(deadline)
        if self._times is not None:
            self._times.close(deadline)
        if self._flusher is not None:
            self._closing.set()
            self._flush_now.set()
            wait = UPLOAD_CLOSE_TIMEOUT_S if timeout is None else deadline - time.monotonic()
            self._flusher.join(max(0.0, wait))
        for sink in self._terminal.values():
            sink.close(deadline)
        if self._fd is not None and (self._log is None or not self._log._thread.is_alive()):
            os.close(self._fd)
            self._fd = None
        if self._times_fd is not None and self._times is not None:
            if not self._times._thread.is_alive():
                os.close(self._times_fd)
                self._times_fd = None


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
