"""One live owner per run directory (issue 11, point 2), with real processes.

A second `runtime local` on a run another process is training exits 2 with one sentence naming
the owner and changes nothing; a dead owner's claim is taken over (at once when its pid is gone
on this host, after `runtime.owner_lease_s` when it was another host's); a restarted attempt of
the same submission succeeds the owner at once; of several takers of one stale claim exactly one
wins, locally (flock) and on gs:// (generation-matched uploads).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.errors import RunOwnedError
from jobspec.storage import url_to_fs
from runtime.run.owner import OwnerRecord, takeover_reason

from runs import ROOT, read_jsonl, run_cli, stderr_lines, tiny_config, write_config

STEPS = 40


def _record(**over) -> OwnerRecord:
    rec = OwnerRecord.mine("t", "sub-0", 0, 60)
    for k, v in over.items():
        setattr(rec, k, v)
    return rec


# ---- the decision, without processes ------------------------------------------------------------


def test_takeover_rules():
    me = OwnerRecord.mine("t", "sub-1", 1, 60)
    live_elsewhere = _record(host="elsewhere", pid=1, renewed_epoch=time.time())
    assert takeover_reason(live_elsewhere, me, 60) is None
    stale_elsewhere = _record(host="elsewhere", pid=1, renewed_epoch=time.time() - 61)
    assert "lease was last renewed 61 s ago" in takeover_reason(stale_elsewhere, me, 60)
    # Same host: a live pid (ours, with its real start time) holds; a gone pid or a reused one not.
    assert takeover_reason(_record(), me, 60) is None
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    assert "has exited" in takeover_reason(_record(pid=gone.pid), me, 60)
    reused = _record(pid_start="1")
    assert "now belongs to another process" in takeover_reason(reused, me, 60)
    # A restarted attempt of the same submission succeeds a live owner; a lower or another one not.
    assert "succeeds attempt 0" in takeover_reason(_record(submission_id="sub-1"), me, 60)
    assert takeover_reason(_record(attempt=1, submission_id="sub-1"), me, 60) is None
    assert takeover_reason(_record(attempt=0, submission_id=None), me, 60) is None
    assert takeover_reason(None, me, 60) is not None  # unreadable: names no live owner


def _race(root: str, q, start, done) -> None:
    from runtime.run import owner as _owner  # imported before the start line, so all race

    _owner.url_to_fs(root)
    start.wait()
    try:
        claim = _owner.acquire(root, run_id="t", submission_id=None, attempt=0, lease_s=60)
        q.put(("won", str(claim.record.pid)))
        done.wait(60)  # hold it until every taker has decided
        claim.release()
    except RunOwnedError as e:
        q.put(("refused", str(e)))


def _race_many(root: str, n: int = 4) -> list[tuple[str, str]]:
    ctx = multiprocessing.get_context("spawn")
    q, start, done = ctx.Queue(), ctx.Barrier(n), ctx.Event()
    procs = [ctx.Process(target=_race, args=(root, q, start, done)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=60) for _ in procs]
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
    return results


def _write_record(root: str, rec: OwnerRecord) -> None:
    fs, path = url_to_fs(root)
    fs.pipe_file(f"{path.rstrip('/')}/owner.json", rec.to_bytes())


@pytest.mark.parametrize("where", ["local", pytest.param("gs", marks=pytest.mark.gcs)])
def test_one_of_many_takers_of_a_stale_claim_wins(where, tmp_path, request):
    root = str(tmp_path / "run") if where == "local" else request.getfixturevalue("gs_run_uri")
    if where == "local":
        os.makedirs(root)
    _write_record(root, _record(host="elsewhere", pid=1, renewed_epoch=time.time() - 600))
    results = _race_many(root)
    assert sorted(r[0] for r in results) == ["refused"] * 3 + ["won"], results
    winner = next(r[1] for r in results if r[0] == "won")
    assert all(f"pid {winner}" in r[1] for r in results if r[0] == "refused"), results
    fs, path = url_to_fs(root)
    if where == "gs":
        fs.invalidate_cache()
    assert not fs.exists(f"{path}/owner.json")  # released by the winner


# ---- two `runtime local` on one run -------------------------------------------------------------


def _snapshot(root: str) -> dict[str, bytes]:
    fs, path = url_to_fs(root)
    fs.invalidate_cache()
    return {f: bytes(fs.cat_file(f)) for f in fs.find(path) if not f.endswith(".owner.lock")}


def _cfg(tmp_path: Path, prepared: str, uri: str, **over) -> Path:
    base = {"training": {"target_tokens": 16 * 8 * STEPS}, "checkpoint": {"every": 10}}
    return write_config(tmp_path / "cfg.toml", tiny_config(prepared, uri, **{**base, **over}))


def _start(cfg: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", "local", str(cfg), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_rows(root: str, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the owner has logged `rows` training rows (it owns the run and is in its loop)."""
    fs, path = url_to_fs(root)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        fs.invalidate_cache()
        if fs.exists(f"{path}/metrics/train.jsonl"):
            if len(fs.cat_file(f"{path}/metrics/train.jsonl").splitlines()) >= rows:
                return
        time.sleep(0.1)
    raise AssertionError("the first run logged no rows in time")


def _losses(root: str) -> list[tuple[int, float]]:
    fs, path = url_to_fs(root)
    fs.invalidate_cache()
    rows = [json.loads(x) for x in fs.cat_file(f"{path}/metrics/train.jsonl").splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, prepared) -> list[tuple[int, float]]:
    """The losses of the run trained with nobody else around."""
    tmp = tmp_path_factory.mktemp("alone")
    r = run_cli("local", str(_cfg(tmp, prepared, str(tmp / "runs"))))
    assert r.returncode == 0, r.stderr
    return _losses(str(tmp / "runs" / "t"))


@pytest.mark.parametrize("where", ["local", pytest.param("gs", marks=pytest.mark.gcs)])
def test_second_process_on_a_run_is_refused_and_changes_nothing(
    where, tmp_path, prepared, alone, request
):
    uri = str(tmp_path / "runs") if where == "local" else request.getfixturevalue("orbax_gs_run_uri")
    cfg = _cfg(tmp_path, prepared, uri)
    root = f"{uri}/t"
    first = _start(cfg)
    try:
        _wait_for_rows(root, 3, first)
        first.send_signal(signal.SIGSTOP)  # frozen, still alive: nothing moves while we compare
        before = _snapshot(root)
        second = run_cli("local", str(cfg))
        resumed = run_cli("local", str(cfg), "--resume")
        after = _snapshot(root)
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()
    rec = OwnerRecord.from_bytes(before[next(k for k in before if k.endswith("/owner.json"))])
    for r in (second, resumed):
        assert r.returncode == 2, r.stderr
        lines = stderr_lines(r.stderr)
        assert lines == [
            f"error: run 't' at {root if where == 'gs' else os.path.abspath(root)} is in use "
            f"by host {socket.gethostname()} pid {first.pid} (started {rec.started}, attempt 0); "
            "wait for it to finish or use another run.id"
        ], r.stderr
    assert after == before  # not one byte of the run changed (metrics, events, checkpoints)
    assert first.returncode == 0, err
    assert _losses(root) == alone  # the first run's results are as if it had run alone
    fs, path = url_to_fs(root)
    fs.invalidate_cache()
    kinds = [json.loads(x)["event"] for x in fs.cat_file(f"{path}/events.jsonl").splitlines()]
    assert kinds.count("start") == 1 and kinds.count("finish") == 1, kinds
    assert not fs.exists(f"{path}/owner.json")  # released at the end


def test_killed_owner_is_taken_over_at_once_on_the_same_host(tmp_path, prepared):
    uri = str(tmp_path / "runs")
    cfg = _cfg(tmp_path, prepared, uri, training={"target_tokens": 16 * 8 * 400})
    root = Path(uri) / "t"
    first = _start(cfg)
    try:
        _wait_for_rows(str(root), 1, first)
    finally:
        first.kill()  # SIGKILL: no release, its lease (60 s) is still fresh
        first.communicate()
    assert json.loads((root / "owner.json").read_text())["pid"] == first.pid
    t0 = time.monotonic()
    # --max-steps keeps it short; the pid check, not the lease, let it in.
    r = run_cli("local", str(cfg), "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 55
    assert f"took over from host {socket.gethostname()} pid {first.pid}" in r.stderr
    assert "has exited" in r.stderr
    assert not (root / "owner.json").exists()


def test_another_hosts_claim_is_taken_over_only_after_its_lease(tmp_path, prepared):
    uri = str(tmp_path / "runs")
    cfg = _cfg(tmp_path, prepared, uri)
    root = Path(uri) / "t"
    root.mkdir(parents=True)
    fresh = _record(host="gpu-node-7", pid=4242, submission_id=None, renewed_epoch=time.time())
    _write_record(str(root), fresh)
    r = run_cli("local", str(cfg), "--max-steps", "2")
    assert r.returncode == 2 and "in use by host gpu-node-7 pid 4242" in r.stderr, r.stderr
    assert sorted(p.name for p in root.iterdir()) == [".owner.lock", "owner.json"]
    stale = _record(host="gpu-node-7", pid=4242, renewed_epoch=time.time() - 61)
    _write_record(str(root), stale)
    r = run_cli("local", str(cfg), "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    assert "took over from host gpu-node-7 pid 4242: its lease was last renewed" in r.stderr
    assert len(read_jsonl(root / "metrics" / "train.jsonl")) == 2
