"""When each host-log line was written: the tee's sidecar `host-<i>.log.times`
(runtime/host/hostlog.py) and what `launch logs --since/--timestamps` reads from it
(launch/logs_options.py, launch/quiet.py). The CLI itself is tested in test_launch_cli_extras.py,
the k8s API's own times in test_k8s_logs_times.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import fsspec
import pytest

import runtime.host.hostlog as hostlog
from jobspec.errors import JaxjobError
from launch.logs_options import (
    _TimedLog,
    follow_run_folder,
    split_kubelet_time,
    stamp,
    timed_lines,
)
from launch.quiet import QuietStream, quiet_lines
from runfolder.layout import host_log, line_times_record, parse_host_log, parse_line_times
from runfolder.storage import list_parts

ROOT = Path(__file__).resolve().parents[1]
GRAIN = hostlog.TIMES_GRAIN_S
MS = 0.001  # records keep milliseconds: a time may read up to half of one early

# A host without jax: tees its output into argv[1] and writes lines straight to fds 1 and 2,
# noting in argv[2] when each write began and when the tee had it (seen in the log): a line's
# recorded time must lie between the two (plus the grain by which records are shared).
TEE_SCRIPT = textwrap.dedent(r"""
    import json, os, sys, time
    from runtime.host.hostlog import HostLogTee

    log, marks = sys.argv[1], {}

    def seen(tail):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with open(log, "rb") as f:
                    if f.read().endswith(tail):
                        return time.time()
            except FileNotFoundError:
                pass
            time.sleep(0.002)
        raise SystemExit(f"the tee never wrote {tail!r}")

    marks["start"] = time.time()
    HostLogTee(log).start()
    for name in ("A", "B"):
        t0 = time.time()
        os.write(1, f"line {name}\n".encode())
        marks[name] = (t0, seen(f"line {name}\n".encode()))
    os.write(1, b"part")  # a line in two writes, the second on the other fd
    marks["mid"] = seen(b"part")
    t0 = time.time()
    os.write(2, b"ial\n")
    marks["partial"] = (t0, seen(b"partial\n"))
    marks["last"] = time.time()
    os.write(1, b"no newline at exit")
    seen(b"no newline at exit")
    with open(sys.argv[2], "w") as f:
        json.dump(marks, f)
""")


def _read_times(path: Path) -> list[tuple[float, str]]:
    """(time, line) of a local host log, as launch logs reads them."""
    return _TimedLog.open(fsspec.filesystem("file"), str(path), 0, 0).read(final=True)


def test_the_tee_records_when_each_line_arrived(tmp_path):
    log = tmp_path / "run" / host_log(0, 0)
    marks_file = tmp_path / "marks.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", TEE_SCRIPT, str(log), str(marks_file)],
        cwd=ROOT, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    end = time.time()
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    marks = json.loads(marks_file.read_text())
    # The log's bytes are what the host wrote, nothing added.
    assert log.read_bytes() == b"line A\nline B\npartial\nno newline at exit"
    assert r.stdout == b"line A\nline B\npartno newline at exit" and r.stderr == b"ial\n"
    # The sidecar: the tee's start first, then counts and times that never go back; its last
    # record is the line that never got its newline (written at close).
    records = parse_line_times(Path(f"{log}.times").read_bytes())
    counts = [n for n, _ in records]
    times = [t for _, t in records]
    assert counts[0] == 0 and counts[-1] == 4, records
    assert counts == sorted(set(counts)) and times == sorted(times), records
    assert marks["start"] - MS <= times[0] <= marks["A"][0] + MS
    # Each line's time is within the window of its write (+ the shared-record grain).
    got = _read_times(log)
    assert [text for _, text in got] == ["line A", "line B", "partial", "no newline at exit"]
    windows = [marks["A"], marks["B"], marks["partial"], (marks["last"], end)]
    for (t, text), (lo, hi) in zip(got, windows, strict=True):
        assert lo - MS <= t <= hi + GRAIN + MS, (text, lo, t, hi)
    assert got[2][0] >= marks["mid"] - MS  # a line's time is when its newline came
    assert [t for t, _ in got] == sorted(t for t, _ in got)
    # What --timestamps prints of them.
    shown = timed_lines(
        str(tmp_path / "run"), "r", attempt=0, host=None, tail=None, since_s=None,
        timestamps=True,
    )  # fmt: skip
    assert shown == [f"{stamp(t)} [host 0] {text}" for t, text in got]


def test_the_line_clock_shares_records_within_the_grain_and_never_goes_back(monkeypatch):
    out: list[bytes] = []
    clock = hostlog._LineClock(out.append)
    now = [100.0]
    monkeypatch.setattr(hostlog.time, "time", lambda: now[0])
    clock.start()
    clock.accepted(b"a\n")  # a record of its own
    now[0] += GRAIN / 4
    clock.accepted(b"b\nc\n")  # within the grain: held
    now[0] += GRAIN / 4
    clock.accepted(b"d")  # no newline, still within the grain: nothing
    assert b"".join(out) == line_times_record(0, 100.0) + line_times_record(1, 100.0)
    now[0] = 99.0  # the clock was set back: times repeat the last one
    clock.accepted(b"e\n")
    now[0] = 100.0 + 2 * GRAIN
    clock.accepted(b"f")  # after the grain: the held record goes out, with its own time
    clock.finish(whole=True)  # and the last line, without its newline, gets one at close
    records = parse_line_times(b"".join(out))
    assert [n for n, _ in records] == [0, 1, 4, 5]
    assert records[2][1] == pytest.approx(100.0 + GRAIN / 2)
    assert records[3][1] == pytest.approx(100.0 + 2 * GRAIN)


def test_the_sidecars_sink_drops_and_counts_without_markers_or_warnings():
    """A sidecar that cannot be written is the log's outage (same folder, same disk): it keeps
    up to its bound, drops the rest silently, and writes no marker into the records."""
    written: list[bytes] = []
    failing = [True]

    def write(data: bytes) -> int:
        if failing[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(data)
        return len(data)

    sink = hostlog._Sink("line times x", write, 100, hostlog._quiet, markers=False)
    sink.put(b"".join(line_times_record(k, 1.0 + k) for k in range(1, 5)))  # 4 x 8 bytes
    for k in range(5, 40):
        sink.put(line_times_record(k, 1.0 + k))
    assert 0 < len(sink._buf) <= 100 and sink._lost_bytes > 0
    failing[0] = False  # the disk has room again: the backlog goes out at the next retry
    deadline = time.monotonic() + 30
    while sink._buf and time.monotonic() < deadline:
        time.sleep(0.05)
    sink.put(line_times_record(40, 41.0))
    sink.close(time.monotonic() + 10)
    data = b"".join(written)
    assert b"jaxjob" not in data and parse_line_times(data)[-1] == (40, 41.0)


@pytest.fixture
def memory_root():
    root = f"memory://t-{uuid.uuid4().hex[:12]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["memory", pytest.param("gs", marks=pytest.mark.gcs)])
def store_root(request):
    """An object store: fsspec's in-memory one, and gs:// on the GCS emulator."""
    if request.param == "gs":
        return request.getfixturevalue("gs_run_uri")
    return request.getfixturevalue("memory_root")


def test_on_an_object_store_the_sidecar_is_uploaded_in_parts(store_root, monkeypatch):
    """No fd games: the tee is not started, its pump's handing on of chunks is called here."""
    monkeypatch.setattr(hostlog, "PART_BYTES", 64)
    tee = hostlog.HostLogTee(hostlog.log_uri(f"{store_root}/run", 0, 0))
    windows, lines = [], [f"step {i:02d} loss 0.{i:02d}\n".encode() for i in range(30)]
    for i, line in enumerate(lines):
        t0 = time.time()
        tee._buffer_remote(line)
        windows.append((t0, time.time()))
        if i % 2:
            tee._flush_remote()  # every 5 s in a host; one part at most each time
    tee._buffer_remote(b"half a line")
    tee._clock.finish(whole=True)
    tee._flush_remote()
    assert len(list_parts(tee.fs, tee.path)) > 5
    assert len(list_parts(tee.fs, tee.times_path)) > 1  # the sidecar in parts too
    assert len(tee._times_upload.buf) < 64  # memory holds its current part only
    got = timed_lines(
        f"{store_root}/run", "r", attempt=None, host=None, tail=None, since_s=None,
        timestamps=False,
    )  # fmt: skip
    assert got == [f"[host 0] {ln.decode().rstrip()}" for ln in lines] + ["[host 0] half a line"]
    log = _TimedLog.open(tee.fs, tee.path, 0, 0)
    times = [t for t, _ in log.read(final=True)]
    for t, (lo, hi) in zip(times, windows, strict=False):
        assert lo - MS <= t <= hi + GRAIN + MS
    assert times == sorted(times)


def test_a_failing_upload_keeps_the_sidecar_bounded(memory_root, monkeypatch):
    monkeypatch.setattr(hostlog, "PART_BYTES", 64)
    monkeypatch.setattr(hostlog, "TIMES_DEFER_BYTES", 128)
    monkeypatch.setattr(hostlog, "TIMES_GRAIN_S", 0.0)  # a record per line
    tee = hostlog.HostLogTee(hostlog.log_uri(f"{memory_root}/run", 0, 0))

    def down(*_a, **_k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tee.fs, "pipe_file", down)
    for i in range(200):
        tee._buffer_remote(f"{i}\n".encode())
        tee._flush_remote()
    assert len(tee._times_upload.buf) <= 64 + 128 and tee._times_upload.dropped > 0


def test_sidecars_are_not_host_logs():
    root = "/r/logs/attempt-1"
    for p in (f"{root}/host-1.log.times", f"{root}/host-1.log.times.parts",
              f"{root}/host-1.log.times.parts/000000.times"):  # fmt: skip
        assert parse_host_log(p) is None
        assert parse_host_log(p.removesuffix(".parts")) is None
    assert parse_host_log(f"{root}/host-1.log") == (1, 1)


def _timed_log(folder: Path, host: int, lines: list[str], times: list[float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"host-{host}.log").write_text("".join(f"{ln}\n" for ln in lines))
    records = [line_times_record(k + 1, t) for k, t in enumerate(times)]
    (folder / f"host-{host}.log.times").write_bytes(b"".join(records))


def test_follow_reads_the_run_folder_as_it_grows(tmp_path):
    run = tmp_path / "run"
    now = time.time()
    _timed_log(run / "logs/attempt-0", 0, ["old", "recent"], [now - 3600, now - 10])
    done = [False]
    it = follow_run_folder(
        str(run), "r", host=None, tail=None, since_s=60, timestamps=True,
        ended=lambda: done[0], poll_s=0.01,
    )  # fmt: skip
    assert next(it) == f"{stamp(now - 10)} [host 0] recent"  # --since left out "old"
    # The host writes on (a line, then half of one), and a new attempt starts.
    with open(run / "logs/attempt-0/host-0.log", "a") as f:
        f.write("more\nhalf")
    with open(run / "logs/attempt-0/host-0.log.times", "ab") as f:
        f.write(line_times_record(3, now - 5))
    _timed_log(run / "logs/attempt-1", 1, ["restarted"], [now - 1])
    assert [next(it), next(it)] == [
        f"{stamp(now - 5)} [host 0] more",
        f"{stamp(now - 1)} [host 1] restarted",
    ]
    done[0] = True  # the run ended: the last line without its newline comes out too
    last = list(it)
    assert len(last) == 1 and last[0].endswith(" [host 0] half")
    # Without a record, a line has the log's modification time: never before it was written.
    mtime = fsspec.filesystem("file").modified(str(run / "logs/attempt-0/host-0.log")).timestamp()
    assert last[0] == f"{stamp(mtime)} [host 0] half"


def test_follow_of_logs_without_sidecars_is_one_sentence_before_any_line(tmp_path):
    folder = tmp_path / "run/logs/attempt-0"
    folder.mkdir(parents=True)
    (folder / "host-0.log").write_text("a\n")
    with pytest.raises(JaxjobError, match=r"^--since: run r's attempt 0 host logs"):
        follow_run_folder(
            str(tmp_path / "run"), "r", host=None, tail=None, since_s=5, timestamps=False,
            ended=lambda: True,
        )  # fmt: skip


def test_quiet_view_of_stamped_lines_gives_a_shared_line_the_earliest_time():
    t = "2026-12-07T23:01:0{}.000Z"
    lines = [
        f"{t.format(1)} [host 0] step 1",
        f"{t.format(5)} [host 0] WARNING: slow disk",
        f"{t.format(2)} [host 1] step 1",
        f"{t.format(3)} [host 1] WARNING: slow disk",
        f"{t.format(4)} [host 1] WARNING: host 1 only",
    ]
    assert quiet_lines(lines) == [
        f"{t.format(1)} [host 0] step 1",
        f"{t.format(3)} [2 hosts: 0,1] WARNING: slow disk",  # host 1 said it first
        f"{t.format(4)} [host 1] WARNING: host 1 only",
    ]
    view = QuietStream(hosts=2)
    out = []
    for line in lines:
        out += view.feed(line, 0.0)  # all within the window
    out += view.flush()
    assert out == quiet_lines(lines)


def test_kubelet_times_become_ours():
    assert split_kubelet_time("2026-12-07T23:01:02.345678901Z step 1 | loss 2.5") == (
        "2026-12-07T23:01:02.345Z",
        "step 1 | loss 2.5",
    )
    assert split_kubelet_time("2026-12-07T23:01:02Z ") == ("2026-12-07T23:01:02.000Z", "")
    assert split_kubelet_time("2026-12-08T01:01:02.5+02:00 x") == ("2026-12-07T23:01:02.500Z", "x")
    assert split_kubelet_time("no time here") == (None, "no time here")
    assert stamp(1796684462.345) == "2026-12-07T23:01:02.345Z"
