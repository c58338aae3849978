"""The run registry: records, lookups with close matches, newest-first listing, atomic files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jobspec.errors import JaxjobError
from launch.backend import Handle, tail_lines
from launch.backends.local import LocalBackend
from launch.registry import Registry, RunRecord
from launch.runid import is_run_id, new_run_id
from launch.state import state_root, write_json_atomic


def rec(run_id: str, submitted: str, backend: str = "local", **handle) -> RunRecord:
    return RunRecord(
        run_id=run_id, backend=backend, handle=handle or {"pid": 1, "run_dir": "/runs/x"}, output_uri="/out",
        submitted=submitted, job_path="/jobs/job.yaml",
    )  # fmt: skip


@pytest.fixture
def reg(tmp_path) -> Registry:
    return Registry(tmp_path / "jaxjob")


def test_record_and_lookup_round_trip(reg):
    r = rec("smoke-a1b2c3", "2026-01-01T00:00:00.000000+00:00", backend="k8s",
            namespace="ml", jobset="smoke-a1b2c3")  # fmt: skip
    r.backend_options = {"context": "gke", "namespace": "ml"}
    reg.record(r)
    got = reg.lookup("smoke-a1b2c3")
    assert got == r
    assert got.to_handle().backend == "k8s" and got.to_handle().data["jobset"] == "smoke-a1b2c3"
    assert got.run_uri == "/out/smoke-a1b2c3"
    assert reg.exists("smoke-a1b2c3") and not reg.exists("smoke-zzzzzz")
    assert (reg.run_dir("smoke-a1b2c3") / "record.json").is_file()


def test_list_is_newest_first(reg):
    times = ["2026-01-02T00:00:00.000000+00:00", "2026-01-01T00:00:00.000000+00:00",
             "2026-01-03T00:00:00.000000+00:00"]  # fmt: skip
    for i, t in enumerate(times):
        reg.record(rec(f"job-{i}aaaaa", t))
    assert [r.run_id for r in reg.list()] == ["job-2aaaaa", "job-0aaaaa", "job-1aaaaa"]


def test_rerecording_a_run_replaces_it(reg):
    reg.record(rec("job-aaaaaa", "2026-01-01T00:00:00.000000+00:00", pid=1, run_dir="/r"))
    reg.record(rec("job-aaaaaa", "2026-01-02T00:00:00.000000+00:00", pid=2, run_dir="/r"))
    assert [(r.run_id, r.handle["pid"]) for r in reg.list()] == [("job-aaaaaa", 2)]


def test_unknown_run_lists_close_matches(reg):
    for rid in ("smoke-a1b2c3", "smoke-x9y8z7", "train-qqqqqq"):
        reg.record(rec(rid, "2026-01-01T00:00:00.000000+00:00"))
    with pytest.raises(JaxjobError, match="did you mean smoke-a1b2c3") as e:
        reg.lookup("smoke-a1b2c4")
    assert "train-qqqqqq" not in str(e.value)
    # The job name alone finds its runs.
    with pytest.raises(JaxjobError, match="smoke-a1b2c3") as e:
        reg.lookup("smoke")
    assert "smoke-x9y8z7" in str(e.value)
    with pytest.raises(JaxjobError, match="`launch list` shows"):
        reg.lookup("zzzzzzzzzzzzzzzz")


def test_unknown_run_in_an_empty_registry(reg):
    with pytest.raises(JaxjobError, match="no run has been submitted from this machine yet"):
        reg.lookup("anything")
    assert reg.list() == []


def test_unreadable_entry_does_not_hide_the_others(reg):
    reg.record(rec("good-aaaaaa", "2026-01-01T00:00:00.000000+00:00"))
    bad = reg.run_dir("bad-aaaaaa") / "record.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert [r.run_id for r in reg.list()] == ["good-aaaaaa"]
    with pytest.raises(JaxjobError, match="cannot be read"):
        reg.lookup("bad-aaaaaa")


def test_a_run_dir_without_a_record_is_not_a_run(reg):
    reg.run_dir("half-aaaaaa").mkdir(parents=True)  # e.g. a backend's workdir, submit failed
    assert reg.list() == [] and not reg.exists("half-aaaaaa")


def test_atomic_writes_leave_no_temporary_files(tmp_path):
    path = tmp_path / "d" / "x.json"
    for i in range(3):
        write_json_atomic(path, {"i": i})
    assert json.loads(path.read_text()) == {"i": 2}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_state_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert state_root() == tmp_path / "jaxjob"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_root() == Path(tmp_path / "home" / ".local" / "state" / "jaxjob")


def test_run_ids_are_dns_labels():
    ids = {new_run_id("smoke") for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"smoke-[a-z0-9]{6}", i) and is_run_id(i) for i in ids)
    long = new_run_id("a" * 40)
    assert len(long) == 47 and is_run_id(long)
    assert len(new_run_id("b" * 70)) <= 63
    assert not is_run_id("Bad_Id") and not is_run_id("x" * 64)


def test_tail_is_the_last_k_lines_and_zero_is_none(tmp_path):
    assert tail_lines(["a", "b", "c"], None) == ["a", "b", "c"]
    assert tail_lines(["a", "b", "c"], 2) == ["b", "c"]
    assert tail_lines(["a", "b", "c"], 5) == ["a", "b", "c"]
    assert tail_lines(["a", "b", "c"], 0) == []
    # The local backend: the last K lines of each host, over its attempts.
    for attempt, text in ((0, "a\nb\n"), (1, "c\nd\n")):
        for i in (0, 1):
            f = tmp_path / "logs" / f"attempt-{attempt}" / f"host-{i}.log"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text.replace("\n", f"{i}\n"))
    backend, h = LocalBackend(Registry(tmp_path)), Handle("local", {"run_dir": str(tmp_path)})
    logs = list(backend.logs(h, host=None, follow=False, tail=3))
    assert logs == ["[host 0] b0", "[host 1] b1", "[host 0] c0", "[host 0] d0", "[host 1] c1",
                    "[host 1] d1"]  # fmt: skip
    assert list(backend.logs(h, host=None, follow=False, tail=0)) == []
