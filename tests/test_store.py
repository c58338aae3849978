"""The artifact store: round-trips, atomicity, the writer rule and the start-up check."""

from __future__ import annotations

import os
import sys

import pytest

from jobspec.errors import StorageError
from runfolder.store import ArtifactStore, NotWriterError


def files_under(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in files]
    return sorted(out)


def test_json_text_bytes_round_trip(run_uri: str) -> None:
    store = ArtifactStore(run_uri)
    store.check_writable()
    store.write_json("manifest.json", {"run": "r1", "n": [1, 2.5, None]})
    store.write_text("config/source.toml", "x = 1\n")
    store.write_bytes("samples/raw.bin", b"\x00\x01")
    assert store.read_json("manifest.json") == {"run": "r1", "n": [1, 2.5, None]}
    assert store.read_text("config/source.toml") == "x = 1\n"
    assert store.read_bytes("samples/raw.bin") == b"\x00\x01"
    assert store.exists("config/source.toml") and not store.exists("nope.json")
    assert store.listdir() == ["config", "manifest.json", "samples"]
    assert store.listdir("missing") == []
    assert store.uri("config/source.toml") == f"{run_uri}/config/source.toml"
    # Overwrite replaces the whole file.
    store.write_json("manifest.json", {"run": "r2"})
    assert store.read_json("manifest.json") == {"run": "r2"}
    with pytest.raises(StorageError, match="does not exist"):
        store.read_json("nope.json")


def test_jsonl_append_survives_a_new_store_and_truncates(run_uri: str) -> None:
    store = ArtifactStore(run_uri)
    store.append_jsonl("metrics/train.jsonl", [{"step": 1, "loss": 3.0}])
    store.append_jsonl("metrics/train.jsonl", [{"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.0}])
    assert [r["step"] for r in store.read_jsonl("metrics/train.jsonl")] == [1, 2, 3]

    # A resumed run (a new process, so a new store) keeps the old rows and adds to them.
    resumed = ArtifactStore(run_uri)
    assert resumed.truncate_jsonl_after("metrics/train.jsonl", "step", 2) == 1
    resumed.append_jsonl("metrics/train.jsonl", [{"step": 3, "loss": 1.9}])
    rows = ArtifactStore(run_uri).read_jsonl("metrics/train.jsonl")
    assert rows == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 1.9}]
    assert resumed.truncate_jsonl_after("metrics/absent.jsonl", "step", 0) == 0


def test_no_temporary_files_are_left(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    store.check_writable()
    store.write_json("a.json", {"x": 1})
    store.write_json("a.json", {"x": 2})
    store.append_jsonl("events.jsonl", [{"event": "start"}])
    store.truncate_jsonl_after("events.jsonl", "step", 0)
    store.write_host_text("log.txt", "hi")
    assert files_under(str(tmp_path / "run")) == ["a.json", "events.jsonl", "hosts/0/log.txt"]


def test_failed_local_write_keeps_the_old_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ArtifactStore(str(tmp_path / "run"))
    store.write_json("summaries/final.json", {"loss": 1.0})

    def crash(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    # The new bytes reach the temporary file, then the commit step fails.
    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(StorageError, match="No space left on device"):
        store.write_json("summaries/final.json", {"loss": 0.5, "pad": "x" * 100_000})
    with pytest.raises(StorageError):
        store.append_jsonl("events.jsonl", [{"event": "x"}])
    monkeypatch.undo()
    assert store.read_json("summaries/final.json") == {"loss": 1.0}
    assert store.read_text("events.jsonl") == ""  # the failed append was cut back
    assert files_under(str(tmp_path / "run")) == ["events.jsonl", "summaries/final.json"]


@pytest.mark.gcs
def test_failed_gs_write_keeps_the_old_object(gs_run_uri: str, monkeypatch) -> None:
    store = ArtifactStore(gs_run_uri)
    store.write_json("summaries/final.json", {"loss": 1.0})

    def crash(*_args, **_kwargs):
        raise OSError("connection reset")

    monkeypatch.setattr(store.fs, "pipe_file", crash)
    with pytest.raises(StorageError, match="connection reset"):
        store.write_json("summaries/final.json", {"loss": 0.5})
    monkeypatch.undo()
    assert store.read_json("summaries/final.json") == {"loss": 1.0}


def test_non_writer_fails_loudly_but_host_files_work(run_uri: str) -> None:
    writer = ArtifactStore(run_uri, process_index=0, writer_index=0)
    other = ArtifactStore(run_uri, process_index=1, writer_index=0)
    assert writer.is_writer and not other.is_writer
    writer.write_json("manifest.json", {"ok": True})
    for call in (
        lambda: other.write_json("manifest.json", {}),
        lambda: other.write_text("a.txt", ""),
        lambda: other.write_bytes("a.bin", b""),
        lambda: other.append_jsonl("events.jsonl", [{"e": 1}]),
        lambda: other.truncate_jsonl_after("events.jsonl", "step", 0),
        lambda: other.delete("manifest.json"),
    ):
        with pytest.raises(NotWriterError, match="only the writer"):
            call()
    other.write_host_json("diag.json", {"host": 1})
    other.write_host_text("note.txt", "from 1")
    assert writer.read_json("hosts/1/diag.json") == {"host": 1}
    assert other.read_text("hosts/1/note.txt") == "from 1"
    assert other.read_json("manifest.json") == {"ok": True}  # reads work on every host
    assert writer.listdir("hosts") == ["1"]


def test_check_writable_local_errors(tmp_path) -> None:
    # Tests run as root, which chmod does not stop: a path under a regular file cannot exist.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    store = ArtifactStore(str(blocker / "sub" / "run"))
    with pytest.raises(StorageError, match="cannot create output directory .*run.output_uri"):
        store.check_writable()
    ok = ArtifactStore(str(tmp_path / "new" / "run"))
    ok.check_writable()
    assert os.listdir(tmp_path / "new" / "run") == []  # the probe is gone


@pytest.mark.gcs
def test_check_writable_missing_bucket(gcs_bucket: str) -> None:
    store = ArtifactStore("gs://no-such-bucket-x/runs/r1")
    with pytest.raises(
        StorageError, match="gs bucket 'no-such-bucket-x' does not exist; create it"
    ):
        store.check_writable()
    ArtifactStore(f"{gcs_bucket}/runs/r1").check_writable()


def test_gs_without_gcsfs_is_a_storage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs now raises ImportError
    with pytest.raises(StorageError, match="gcsfs is not installed"):
        ArtifactStore("gs://bucket/run").check_writable()


@pytest.mark.gcs
def test_gs_reads_see_writes_from_other_clients(gs_run_uri: str) -> None:
    a = ArtifactStore(gs_run_uri)
    a.write_json("x/one.json", {"n": 1})
    assert a.listdir("x") == ["one.json"]
    # Another client (Orbax, another host) writes and deletes behind this store's back.
    other = type(a.fs)(
        token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"], skip_instance_cache=True
    )
    other.pipe_file(a._path("x/two.json"), b"{}")
    assert a.listdir("x") == ["one.json", "two.json"]
    other.rm_file(a._path("x/one.json"))
    assert not a.exists("x/one.json")


def test_torn_last_line_is_dropped_then_cut_but_a_torn_middle_is_corruption(tmp_path, capsys):
    store = ArtifactStore(str(tmp_path / "run"))
    store.append_jsonl("events.jsonl", [{"event": "start"}, {"event": "first_step"}])
    path = tmp_path / "run" / "events.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"event": "chec')  # a crash in the middle of an append
    assert store.read_jsonl("events.jsonl") == [{"event": "start"}, {"event": "first_step"}]
    assert "last line of" in capsys.readouterr().err and path.read_bytes().endswith(b"chec")
    store.append_jsonl("events.jsonl", [{"event": "resume"}])  # cuts the torn line off first
    assert "cut it off the file" in capsys.readouterr().err
    assert [r["event"] for r in store.read_jsonl("events.jsonl")] == [
        "start",
        "first_step",
        "resume",
    ]
    path.write_bytes(b'{"event": "start"}\n{"ev\n{"event": "resume"}\n')
    with pytest.raises(StorageError, match="line 2 is not valid JSON .* not the last line"):
        store.read_jsonl("events.jsonl")


@pytest.mark.gcs
def test_gs_jsonl_is_appended_in_bounded_parts(gs_run_uri: str, capsys) -> None:
    from runfolder.storage import list_parts

    store = ArtifactStore(gs_run_uri, part_bytes=200)
    for step in range(1, 31):
        store.append_jsonl("metrics/train.jsonl", [{"step": step, "loss": 1.0 / step}])
    parts = list_parts(store.fs, store._path("metrics/train.jsonl"))
    sizes = [len(store.fs.cat_file(p)) for _, p in parts]
    assert len(parts) >= 5 and max(sizes) <= 200 + 40  # bounded: one row over at most
    assert not store.fs.exists(store._path("metrics/train.jsonl"))  # no whole-object rewrite
    # Another process (a resumed run) reads the parts back in order and cuts after step 12.
    resumed = ArtifactStore(gs_run_uri, part_bytes=200)
    assert [r["step"] for r in resumed.read_jsonl("metrics/train.jsonl")] == list(range(1, 31))
    assert resumed.truncate_jsonl_after("metrics/train.jsonl", "step", 12) == 18
    resumed.append_jsonl("metrics/train.jsonl", [{"step": 13, "loss": 0.5}])
    assert [r["step"] for r in ArtifactStore(gs_run_uri).read_jsonl("metrics/train.jsonl")] == [
        *range(1, 14)
    ]
    # A torn tail part (a broken upload) is dropped on read and cut before the next append.
    _, last = list_parts(store.fs, store._path("metrics/train.jsonl"))[-1]
    store.fs.pipe_file(last, store.fs.cat_file(last) + b'{"step": 14, "lo')
    fresh = ArtifactStore(gs_run_uri)
    assert fresh.read_jsonl("metrics/train.jsonl")[-1]["step"] == 13
    fresh.append_jsonl("metrics/train.jsonl", [{"step": 14, "loss": 0.4}])
    assert [r["step"] for r in fresh.read_jsonl("metrics/train.jsonl")][-2:] == [13, 14]
    assert "cut it off the file" in capsys.readouterr().err


def test_the_host_log_path_is_parsed_back_from_any_root() -> None:
    """runtime/host/hostlog.py writes host_log's path, launch's saved_logs reads it back."""
    from runfolder.layout import host_log, parse_host_log

    assert host_log(2, 3) == "logs/attempt-2/host-3.log"
    assert parse_host_log(f"gs://b/run/{host_log(2, 3)}") == (2, 3)
    assert parse_host_log("/r/logs/attempt-12/") == (12, None)  # the attempt's folder
    others = ["logs/attempt-x", "blogs/attempt-1", "logs/attempt-1/host-1.txt",
              "logs/attempt-1/host-1.log.parts", "logs/attempt-1/host-1.log/000000.log"]  # fmt: skip
    assert [parse_host_log(f"/r/{p}") for p in others] == [None] * len(others)


@pytest.mark.gcs
def test_gs_host_log_is_uploaded_in_parts_and_read_in_order(gcs_bucket, monkeypatch) -> None:
    import runtime.host.hostlog as hostlog
    from launch.backends.k8s.backend import saved_logs
    from runfolder.storage import list_parts

    monkeypatch.setattr(hostlog, "PART_BYTES", 100)
    root = f"{gcs_bucket}/logs-{os.getpid()}-{id(monkeypatch)}"
    tee = hostlog.HostLogTee(hostlog.log_uri(f"{root}/run1", 0, 1))  # not started: no fd games
    lines = [f"step {i} | loss {1.0 / (i + 1):.4f}\n".encode() for i in range(40)]
    for k in range(0, 40, 3):
        tee._buffer_remote(b"".join(lines[k : k + 3]))
        tee._flush_remote()
    parts = list_parts(tee.fs, tee.path)
    held = len(tee._log_upload.buf)
    assert len(parts) > 5 and held < 100 + 80  # memory holds the current part only
    got = list(saved_logs(root, "run1", host=None, tail=None))
    assert got == [f"[host 1] {ln.decode().rstrip()}" for ln in lines]


def test_with_retries_retries_transient_faults_only(monkeypatch) -> None:
    from gcsfs.retry import HttpError

    import runfolder.storage as storage
    from jobspec.errors import StorageFaultError

    monkeypatch.setattr(storage, "_pause", lambda s: None)
    monkeypatch.setattr(storage, "_state", storage._State())  # the give-up below stays here
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise HttpError({"code": 503, "message": "backend unavailable"})
        return "ok"

    retried: list[int] = []

    def listener() -> None:
        retried.append(1)

    storage.on_retry(listener)
    try:
        assert storage.with_retries(flaky, "write x") == "ok" and len(calls) == 4
    finally:
        storage.on_retry(listener, remove=True)
    assert len(retried) == 3  # each retry is progress for the host watchdog
    with pytest.raises(FileNotFoundError):  # not a fault: no retry, the caller words it
        storage.with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("x")), "read x")

    def full() -> None:
        calls.append(1)
        raise OSError(28, "No space left on device")

    calls.clear()
    policy = storage.RetryPolicy(disk_tries=3, disk_wait_s=0)
    with pytest.raises(
        StorageFaultError, match=r"cannot write /d/x: No space left on device \(ENOSPC\)"
    ):
        storage.with_retries(full, "write /d/x", policy)
    assert len(calls) == 3
    clock = iter(range(0, 1000, 7))  # every try seems to take 7 s: the budget runs out
    monkeypatch.setattr(storage.time, "monotonic", lambda: next(clock))
    # Tries in the calling thread: their deadlines would read the fake clock too.
    monkeypatch.setattr(storage, "_attempt", lambda fn, limit, since=None: fn())

    def down() -> None:
        raise HttpError({"code": 503, "message": "down"})

    with pytest.raises(StorageFaultError, match="HTTP 503.*restartable") as e:
        storage.with_retries(down, "write gs://b/x", storage.RetryPolicy(total_s=30))
    assert e.value.exit_code == 45
