"""`launch logs --since D --timestamps --attempt N`.

--attempt N reads attempt N's host logs from the run folder (`<run>/logs/attempt-N/host-<i>.log`,
runtime/host/hostlog.py), on every backend whose run storage this machine can read.

--since and --timestamps read when each line was written from the sidecar every host log has
beside it, `host-<i>.log.times` (hostlog.py: records `<newlines in the log> <unix time>`; a
line's time is that of the first record whose count exceeds its index; runfolder.layout
`parse_line_times`). Lines whose record was lost (a full disk) take the next record's time, and
lines after the last record (not written yet, or a host killed) the log's modification time:
never earlier than they were written. Records keep milliseconds. --timestamps puts the
time first, `2026-12-07T23:01:02.345Z [host 0] ...`, RFC 3339 in UTC with milliseconds, as
`kubectl logs --timestamps`; --since D keeps the lines written at or after now - D.

Without --follow both read the run folder (every attempt in order, or --attempt N), on every
backend: its host logs are the ones with times (the local and SLURM backends' own copies of a
host's output, and a live pod's, have none). --tail K keeps the last K lines of each host after
--since. With --follow:

- k8s, while the run has pods: the API's own `timestamps=true` and `sinceSeconds` on each pod's
  log stream, the kubelet's times (RFC 3339 with nanoseconds) shown in ours; without pods (ended,
  or between restarts) the run folder, as without --follow.
- local and SLURM: the run folder is followed (polled: 0.5 s on a local disk, 2 s on an object
  store, where a log is uploaded every 5 s) with its recorded times, every attempt's logs and a
  new attempt's as it starts, until the backend says the run ended (a last line without its
  newline then shows too).

The run folder's logs begin when each host's tee starts: what a host printed before that (its
very first lines; the local supervisor's header) is only in the backend's own copy, which plain
`launch logs` shows.

A host log written before line times were recorded has no sidecar: one sentence naming the run
and attempt, exit 2. The quiet view (launch/quiet.py) groups stamped lines as plain ones; a line
shown once for several hosts carries the earliest of their times.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobspec.errors import JaxjobError

if TYPE_CHECKING:
    import fsspec

    from launch.registry import RunRecord

LOCAL_POLL_S = 0.5  # how often --follow reads a run folder on this machine's disks
REMOTE_POLL_S = 2.0  # on an object store (each read costs requests; hosts upload every 5 s)


def attempts(run_uri: str) -> list[int]:
    """The attempts with a host-log folder in the run folder, in order."""
    from runfolder.layout import LOGS, parse_host_log
    from runfolder.storage import join, url_to_fs

    fs, path = url_to_fs(join(run_uri, LOGS))
    if not fs.exists(path):
        return []
    found = (parse_host_log(p) for p in fs.ls(path, detail=False))
    return sorted(f[0] for f in found if f is not None and f[1] is None)


def _host_logs(
    fs: fsspec.AbstractFileSystem, folder: str, host: int | None
) -> list[tuple[int, str]]:
    """(host, path) of every host log in an attempt's folder (sidecars and parts folders are
    not host logs), in host order."""
    from runfolder.layout import parse_host_log
    from runfolder.storage import PARTS_SUFFIX

    # On object stores a host log is parts, `host-<i>.log.parts/000000.log`, …: read in order.
    return sorted(
        {
            (found[1], log)
            for p in fs.ls(folder, detail=False)
            if (found := parse_host_log(log := p.rstrip("/").removesuffix(PARTS_SUFFIX)))
            and found[1] is not None
            and (host is None or found[1] == host)
        }
    )


def _no_such_attempt(run_uri: str, run_id: str, attempt: int) -> list[int]:
    have = attempts(run_uri)
    if attempt not in have:
        said = f"it has attempts {', '.join(map(str, have))}" if have else "it has no host logs yet"
        raise JaxjobError(f"--attempt {attempt}: run {run_id} has no such attempt; {said}")
    return have


def attempt_lines(
    run_uri: str, run_id: str, attempt: int, *, host: int | None, tail: int | None
) -> Iterator[str]:
    """Attempt `attempt`'s host log lines from the run folder, host by host, each prefixed
    `[host N] ` (as every backend's logs); `tail`: the last K lines of each host."""
    from runfolder.layout import LOGS
    from runfolder.storage import join, read_parted, url_to_fs

    _no_such_attempt(run_uri, run_id, attempt)
    fs, folder = url_to_fs(join(run_uri, LOGS, f"attempt-{attempt}"))
    for h, p in _host_logs(fs, folder, host):
        lines = read_parted(fs, p).decode(errors="replace").splitlines()
        if tail is not None:
            lines = lines[len(lines) - tail :] if tail else []
        for line in lines:
            yield f"[host {h}] {line}"


# ---- times -------------------------------------------------------------------------------------


def stamp(unix_time: float) -> str:
    """`2026-12-07T23:01:02.345Z`: RFC 3339 in UTC, milliseconds (what --timestamps prints)."""
    ms = round(unix_time * 1000)
    whole = dt.datetime.fromtimestamp(ms // 1000, dt.UTC)
    return f"{whole:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


# The kubelet's `timestamps=true` prefix: RFC 3339 with up to nanoseconds (Go's RFC3339Nano,
# which drops trailing zeros of the fraction), then one space.
_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d) ?")


def split_kubelet_time(line: str) -> tuple[str | None, str]:
    """(our stamp, the rest) of a line the API server sent with timestamps=true: the kubelet's
    `2026-12-07T23:01:02.345678901Z text` is (`2026-12-07T23:01:02.345Z`, `text`); a line
    without that prefix is (None, line)."""
    m = _RFC3339.match(line)
    if m is None:
        return None, line
    try:
        when = dt.datetime.fromisoformat(m[1] + ("+00:00" if m[3] == "Z" else m[3]))
    except ValueError:
        return None, line
    frac = (m[2] or "")[:3].ljust(3, "0")  # truncated to milliseconds, as ours
    return f"{when.astimezone(dt.UTC):%Y-%m-%dT%H:%M:%S}.{frac}Z", line[m.end() :]


def _option(since_s: float | None, timestamps: bool) -> str:
    if since_s is not None and timestamps:
        return "--since/--timestamps"
    return "--since" if since_s is not None else "--timestamps"


def _no_times(option: str, run_id: str, attempt: int, host: int) -> JaxjobError:
    return JaxjobError(
        f"{option}: run {run_id}'s attempt {attempt} host logs were written before jaxjob "
        f"recorded when each line was written (host-{host}.log has no host-{host}.log.times "
        f"beside it), so they cannot be shown by time; leave out {option} to see them (--tail K "
        "for the last lines), or pick a later attempt with --attempt N"
    )


class _Growing:
    """A file that grows by appends, read piece by piece: a plain file on this machine's disks,
    else (object stores) its parts (runfolder.storage; a part is rewritten only longer)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        from fsspec.implementations.local import LocalFileSystem

        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)
        self.offset = 0  # bytes read of the plain file, or of part `part`
        self.part = 0
        self.last_part: str | None = None  # the newest part seen (for its modification time)

    def exists(self) -> bool:
        from runfolder.storage import parted_exists

        return bool(parted_exists(self.fs, self.path))

    def read(self) -> bytes:
        """The bytes added since the last read (b"" when none, or while the file is absent)."""
        from runfolder.storage import list_parts

        if self.local and self.fs.isfile(self.path):
            with self.fs.open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            self.offset += len(data)
            return data
        out = []
        for i, p in list_parts(self.fs, self.path):
            if i < self.part:
                continue
            if i > self.part:
                self.part, self.offset = i, 0
            whole = bytes(self.fs.cat_file(p))  # at most PART_BYTES
            out.append(whole[self.offset :])
            self.offset = max(self.offset, len(whole))
            self.last_part = p
        return b"".join(out)

    def modified(self) -> float | None:
        """When the file was last written (unix time), None if that cannot be read."""
        where = self.path if self.local and self.fs.isfile(self.path) else self.last_part
        if where is None:
            return None
        try:
            when = self.fs.modified(where)
        except Exception:  # noqa: BLE001 - only a fallback time; the line still shows
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        return when.timestamp()


@dataclass
class _TimedLog:
    """One host log of one attempt and its sidecar, read as they grow: each complete line (and
    at the end the last one without its newline) with its time."""

    attempt: int
    host: int
    log: _Growing
    times: _Growing
    counts: list[int] = field(default_factory=list)  # the records, in order
    stamps: list[float] = field(default_factory=list)
    lines: int = 0  # complete lines handed out so far
    rest: bytes = b""  # the log's last line, its newline not read yet
    times_rest: bytes = b""  # the sidecar's last record, cut short

    @classmethod
    def open(cls, fs: fsspec.AbstractFileSystem, path: str, attempt: int, host: int) -> _TimedLog:
        from runfolder.layout import LINE_TIMES

        return cls(attempt, host, _Growing(fs, path), _Growing(fs, path + LINE_TIMES))

    def read(self, *, final: bool) -> list[tuple[float, str]]:
        """(time, line) of the lines completed since the last read; `final`: the last line
        too, newline or not. Lines split as today's readers split them (str.splitlines, so a
        carriage return starts a line too); the parts of one log line share its time."""
        from runfolder.layout import parse_line_times

        records = self.times_rest + self.times.read()
        whole, _, self.times_rest = records.rpartition(b"\n")
        for n, t in parse_line_times(whole + b"\n" if whole else b""):
            if not self.counts or n > self.counts[-1]:
                self.counts.append(n)
                self.stamps.append(max(t, self.stamps[-1]) if self.stamps else t)
        *complete, self.rest = (self.rest + self.log.read()).split(b"\n")
        if final and self.rest:
            complete.append(self.rest)
            self.rest = b""
        out: list[tuple[float, str]] = []
        fallback: float | None = None
        for raw in complete:
            k = bisect_right(self.counts, self.lines)  # the first record whose count exceeds k
            if k < len(self.counts):
                t = self.stamps[k]
            else:  # no record yet: when the log was last written (never earlier than the line)
                if fallback is None:
                    fallback = max(self.log.modified() or time.time(), *self.stamps[-1:])
                t = fallback
            self.lines += 1
            for text in raw.decode(errors="replace").splitlines() or [""]:
                out.append((t, text))
        return out


def _line(t: float, host: int, text: str, timestamps: bool) -> str:
    return f"{stamp(t)} [host {host}] {text}" if timestamps else f"[host {host}] {text}"


def _open_logs(
    fs: fsspec.AbstractFileSystem,
    run_uri: str,
    attempt: int,
    host: int | None,
    *,
    check: Callable[[_TimedLog], None] | None,
) -> list[_TimedLog]:
    from runfolder.layout import LOGS
    from runfolder.storage import join, url_to_fs

    _, folder = url_to_fs(join(run_uri, LOGS, f"attempt-{attempt}"))
    out = [_TimedLog.open(fs, p, attempt, h) for h, p in _host_logs(fs, folder, host)]
    for log in out if check is not None else []:
        check(log)
    return out


def _per_host_tail(
    lines: list[tuple[int, float, str]], tail: int | None
) -> list[tuple[int, float, str]]:
    """Like `kubectl logs --tail`: the last K lines of each host, in the order read."""
    if tail is None:
        return lines
    from launch.backend import tail_lines

    per_host: dict[int, list[int]] = {}
    for k, (h, _, _) in enumerate(lines):
        per_host.setdefault(h, []).append(k)
    keep = {k for ks in per_host.values() for k in tail_lines(ks, tail)}
    return [x for k, x in enumerate(lines) if k in keep]


def timed_lines(
    run_uri: str,
    run_id: str,
    *,
    attempt: int | None,
    host: int | None,
    tail: int | None,
    since_s: float | None,
    timestamps: bool,
) -> list[str]:
    """The run folder's host log lines (attempt `attempt`, else every attempt in order; host
    by host within an attempt), each `[host N] ` and with --timestamps its time first; only
    those written in the last `since_s` seconds; then the last `tail` of each host."""
    from runfolder.layout import LOGS
    from runfolder.storage import join, url_to_fs

    option = _option(since_s, timestamps)
    cutoff = None if since_s is None else time.time() - since_s
    if attempt is not None:
        chosen = [attempt]
        _no_such_attempt(run_uri, run_id, attempt)
    else:
        chosen = attempts(run_uri)
        if not chosen:
            raise JaxjobError(
                f"{option}: run {run_id} has no host logs in {join(run_uri, LOGS)} yet; its "
                "hosts write them once they start (--follow waits for them)"
            )
    fs, _ = url_to_fs(run_uri)

    def check(log: _TimedLog) -> None:
        if not log.times.exists():
            raise _no_times(option, run_id, log.attempt, log.host)

    logs = [log for a in chosen for log in _open_logs(fs, run_uri, a, host, check=check)]
    found = [
        (log.host, t, text)
        for log in logs
        for t, text in log.read(final=True)
        if cutoff is None or t >= cutoff
    ]
    return [_line(t, h, text, timestamps) for h, t, text in _per_host_tail(found, tail)]


def follow_run_folder(
    run_uri: str,
    run_id: str,
    *,
    host: int | None,
    tail: int | None,
    since_s: float | None,
    timestamps: bool,
    ended: Callable[[], bool],
    poll_s: float | None = None,
) -> Iterator[str]:
    """What the run folder holds now (as `timed_lines`, every attempt; read here, so a log
    without its sidecar is said before any line), then, as the returned iterator is read, the
    lines the run's hosts add (a new attempt's too), read every `poll_s` seconds until
    `ended()` (asked before each read, so no line is lost). A line is handed out once its
    newline is there; at the end, the last line without one too."""
    from fsspec.implementations.local import LocalFileSystem

    from runfolder.storage import url_to_fs

    option = _option(since_s, timestamps)
    cutoff = None if since_s is None else time.time() - since_s
    fs, _ = url_to_fs(run_uri)
    if poll_s is None:
        poll_s = LOCAL_POLL_S if isinstance(fs, LocalFileSystem) else REMOTE_POLL_S
    readers: dict[tuple[int, int], _TimedLog] = {}

    def scan(first: bool) -> list[_TimedLog]:
        for a in attempts(run_uri):
            for log in _open_logs(fs, run_uri, a, host, check=None):
                if (a, log.host) in readers:
                    continue
                # A log there when following starts must have its sidecar; one that appears
                # later is new (on object stores its sidecar is even uploaded first).
                if first and not log.times.exists():
                    raise _no_times(option, run_id, log.attempt, log.host)
                readers[(a, log.host)] = log
        return list(readers.values())

    backlog = [
        (log.host, t, text)
        for log in scan(first=True)
        for t, text in log.read(final=False)
        if cutoff is None or t >= cutoff
    ]
    shown = [_line(t, h, text, timestamps) for h, t, text in _per_host_tail(backlog, tail)]

    def follow() -> Iterator[str]:
        yield from shown
        while True:
            done = ended()
            got = False
            for log in scan(first=False):
                for t, text in log.read(final=done):
                    got = True
                    yield _line(t, log.host, text, timestamps)
            if done:
                return
            if not got:
                time.sleep(poll_s)

    return follow()


def timed_logs(
    rec: RunRecord,
    *,
    host: int | None,
    follow: bool,
    tail: int | None,
    attempt: int | None,
    since_s: float | None,
    timestamps: bool,
) -> list[str] | Iterator[str]:
    """`launch logs` with --since and/or --timestamps (see the module doc): the lines to show,
    each `[host N] text` or with --timestamps `<time> [host N] text`. Errors (no sidecar, no
    such attempt, an unreadable run folder) come before any line."""
    if not follow:
        return timed_lines(
            rec.run_uri, rec.run_id, attempt=attempt, host=host, tail=tail, since_s=since_s,
            timestamps=timestamps,
        )  # fmt: skip
    from launch.backend import TERMINAL
    from launch.backends import get_backend

    backend: Any = get_backend(rec.backend, rec.backend_options)
    handle = rec.to_handle()
    live = getattr(backend, "timed_logs", None)  # a backend with line times of its own (k8s)
    if live is not None:
        return live(handle, host=host, tail=tail, since_s=since_s, timestamps=timestamps)

    def ended() -> bool:
        st = backend.status(handle)
        # A job that can never start writes no more lines: stop following, as for an end.
        return st.get("state") in TERMINAL or bool(st.get("never_starts"))

    return follow_run_folder(
        rec.run_uri, rec.run_id, host=host, tail=tail, since_s=since_s, timestamps=timestamps,
        ended=ended,
    )  # fmt: skip
