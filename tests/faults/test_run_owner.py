"""One live owner per run directory, with real processes.

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
from launch.backend import TERMINAL
from runfolder.storage import parted_exists, read_parted, url_to_fs
from runtime.run.owner import OwnerRecord, takeover_reason

from runs import ROOT, run_cli, stderr_lines, tiny_config, write_config

STEPS = 20
# Every run here decays its schedule over the suite's 20 tiny steps, however long it may train:
# one train step program, which XLA compiles once per session (the persistent cache), where a
# schedule over 400 or 100,000 steps would be a program (a compile) of its own.
SCHEDULE = {"schedule": {"decay_steps": STEPS}}


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


def _race_many(root: str, n: int) -> list[tuple[str, str]]:
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


PLACES = ["local", pytest.param("gs", marks=pytest.mark.gcs)]


def _place(request: pytest.FixtureRequest, tmp_path: Path, gs_fixture: str) -> tuple[str, str]:
    """("local" or "gs", a fresh URI there), resolved while the test is set up: the emulator's
    session fixture, first started from a test's body, would export its address for that body
    only (tests/conftest.py restores os.environ after each call)."""
    if request.param == "local":
        return "local", str(tmp_path / "runs")
    return "gs", request.getfixturevalue(gs_fixture)


@pytest.fixture(params=PLACES)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    return _place(request, tmp_path, "gs_run_uri")


@pytest.fixture(params=PLACES)
def orbax_place(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    return _place(request, tmp_path, "orbax_gs_run_uri")


def test_one_of_many_takers_of_a_stale_claim_wins(place):
    where, root = place
    if where == "local":
        os.makedirs(root)
    _write_record(root, _record(host="elsewhere", pid=1, renewed_epoch=time.time() - 600))
    # Three takers, all past one barrier (a process each: the lock and the upload race as
    # across hosts); a fourth would take the same paths.
    results = _race_many(root, 3)
    assert sorted(r[0] for r in results) == ["refused"] * 2 + ["won"], results
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


def _threads_stopped(pid: int) -> bool:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return all(s in "Tt" for s in states)


def _freeze(proc: subprocess.Popen, root: str, timeout: float = 60) -> dict[str, bytes]:
    """SIGSTOP `proc` and return the run's bytes once nothing moves any more. kill() returns before
    every thread has stopped (one inside a write or an fsync finishes it first; on gs:// the
    emulator completes an upload already sent), so wait for each thread's stopped state and then
    for two snapshots in a row that agree."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _threads_stopped(proc.pid):
        assert time.monotonic() < deadline, "the first run did not stop"
        time.sleep(0.01)
    last = _snapshot(root)
    while True:
        time.sleep(0.5)
        now = _snapshot(root)
        if now == last:
            return now
        assert time.monotonic() < deadline, (
            "the first run's files kept changing while it was stopped"
        )
        last = now


def _cfg(tmp_path: Path, prepared: str, uri: str, **over) -> Path:
    base = {"training": {"target_tokens": 16 * 8 * STEPS}, "checkpoint": {"every": 10},
            "optimizer": SCHEDULE}  # fmt: skip
    return write_config(tmp_path / "cfg.toml", tiny_config(prepared, uri, **{**base, **over}))


def _start(cfg: Path, *args: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", "local", str(cfg), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until `text` is in the file `proc` writes its stderr to."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} in time: {path.read_text()[-3000:]}"
        time.sleep(0.05)


def _wait_for_rows(root: str, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the owner has logged `rows` training rows (it owns the run and is in its loop)."""
    fs, path = url_to_fs(root)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        fs.invalidate_cache()
        if parted_exists(fs, f"{path}/metrics/train.jsonl"):
            if len(read_parted(fs, f"{path}/metrics/train.jsonl").splitlines()) >= rows:
                return
        time.sleep(0.1)
    raise AssertionError("the first run logged no rows in time")


def _losses(root: str) -> list[tuple[int, float]]:
    fs, path = url_to_fs(root)
    fs.invalidate_cache()
    rows = [json.loads(x) for x in read_parted(fs, f"{path}/metrics/train.jsonl").splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def test_second_process_on_a_run_is_refused_and_changes_nothing(orbax_place, tmp_path, prepared):
    where, uri = orbax_place
    # The first run would train for hours: it is still training (and owns the run) whenever the
    # test freezes it, however late a loaded machine lets the test look; SIGTERM ends it after.
    cfg = _cfg(tmp_path, prepared, uri, training={"target_tokens": 16 * 8 * 100_000})
    root = f"{uri}/t"
    first = _start(cfg)
    try:
        _wait_for_rows(root, 3, first)
        before = _freeze(first, root)  # frozen, still alive: nothing moves while we compare
        refused = [run_cli("local", str(cfg))]
        if where == "local":  # --resume is refused the same way (before it reads the index)
            refused.append(run_cli("local", str(cfg), "--resume"))
        after = _snapshot(root)
        first.send_signal(signal.SIGCONT)
        _wait_for_rows(root, len(_losses(root)) + 1, first)  # it goes on where it was
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()
    rec = OwnerRecord.from_bytes(before[next(k for k in before if k.endswith("/owner.json"))])
    for r in refused:
        assert r.returncode == 2, r.stderr
        lines = stderr_lines(r.stderr)
        assert lines == [
            f"error: run 't' at {root if where == 'gs' else os.path.abspath(root)} is in use "
            f"by host {socket.gethostname()} pid {first.pid} (started {rec.started}, attempt 0); "
            "wait for it to finish or use another run.id"
        ], r.stderr
    assert after == before  # not one byte of the run changed (metrics, events, checkpoints)
    assert first.returncode == 42, err  # stopped by the SIGTERM, with a checkpoint
    # The first run's results are its own alone: every step once, one start, one end.
    steps = [step for step, _ in _losses(root)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 3
    fs, path = url_to_fs(root)
    fs.invalidate_cache()
    kinds = [json.loads(x)["event"] for x in read_parted(fs, f"{path}/events.jsonl").splitlines()]
    assert kinds.count("start") == 1 and kinds[-1] == "interrupted", kinds
    assert not fs.exists(f"{path}/owner.json")  # released at the end


def test_dead_owners_claim_is_taken_over(tmp_path, prepared):
    """Another host's claim: refused while its lease is fresh, taken over once it is older than
    runtime.owner_lease_s; then kill -9 of the new owner: the next start takes over at once
    (its pid is gone on this host) although its lease is still fresh."""
    uri = str(tmp_path / "runs")
    cfg = _cfg(
        tmp_path, prepared, uri, training={"target_tokens": 16 * 8 * 400}, checkpoint={"every": 0}
    )
    root = Path(uri) / "t"
    root.mkdir(parents=True)
    fresh = _record(host="gpu-node-7", pid=4242, renewed_epoch=time.time())
    _write_record(str(root), fresh)
    r = run_cli("local", str(cfg))
    assert r.returncode == 2 and "in use by host gpu-node-7 pid 4242" in r.stderr, r.stderr
    assert sorted(p.name for p in root.iterdir()) == [".owner.lock", "owner.json"]

    _write_record(str(root), _record(host="gpu-node-7", pid=4242, renewed_epoch=time.time() - 61))
    err_path = tmp_path / "first.stderr"
    with open(err_path, "w") as err_file:
        first = _start(cfg, stderr=err_file)
    try:
        # It owns the run once it says so (the note comes after the claim is written); a kill
        # then leaves the claim as one in the middle of a step would, with nothing compiled.
        _wait_for_text(err_path, "note: run 't': took over", first)
    finally:
        first.kill()  # SIGKILL: no release, and its lease (60 s) is still fresh
        first.communicate()
    err = err_path.read_text()
    assert "took over from host gpu-node-7 pid 4242: its lease was last renewed" in err
    assert json.loads((root / "owner.json").read_text())["pid"] == first.pid

    r = run_cli("local", str(cfg), "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    # The pid check let it in, not the lease (its reason would name the lease's age): a reason,
    # not a clock, so a loaded machine that starts slowly cannot make it pass or fail.
    assert f"took over from host {socket.gethostname()} pid {first.pid}" in r.stderr
    assert "has exited" in r.stderr and "lease was last renewed" not in r.stderr
    assert not (root / "owner.json").exists()


# ---- a restarted attempt through the local backend ----------------------------------------------


@pytest.mark.slow
def test_restarted_attempt_succeeds_the_killed_writer(tmp_path, prepared):
    """kill -9 of the writer (host 0) mid-run: the supervisor restarts the group and attempt 1's
    writer takes the run over at once as the successor of the same submission."""
    from test_launch_local import (
        kill_leftovers,
        status,
        submit,
        supervisor_state,
        wait_for,
        write_job,
    )

    state = tmp_path / "state"
    job = write_job(
        tmp_path, prepared, "own", steps=60, training={"log_every": 10}, optimizer=SCHEDULE,
        checkpoint={"every": 10, "keep": 2}, runtime={"host_loss_timeout_s": 5},
    )  # fmt: skip
    try:
        run_id = submit(job, state)
        run_uri = Path(status(run_id, state)["run_uri"])
        index = run_uri / "checkpoints" / "index.json"
        wait_for(
            lambda: index.exists() and json.loads(index.read_text()).get("latest"), 180, "a commit"
        )
        st = supervisor_state(state, run_id)
        claim = json.loads((run_uri / "owner.json").read_text())
        assert claim["pid"] == st["hosts"][0]["pid"] and claim["submission_id"].startswith("local-")
        os.kill(st["hosts"][0]["pid"], signal.SIGKILL)
        # The supervisor's own file, not `launch status` (a process per look) until it ends.
        wait_for(
            lambda: (supervisor_state(state, run_id) or {}).get("state") in TERMINAL,
            240,
            "the restarted run to end",
        )
        final = status(run_id, state)
    finally:
        kill_leftovers(state)
    assert final["state"] == "succeeded", final
    assert final["backend_status"]["restarts"] == 1 and final["progress"]["step"] == 60
    log = (state / "jaxjob" / "runs" / run_id / "logs" / "attempt-1" / "host-0.log").read_text()
    assert (
        f"took over from host {socket.gethostname()} pid {claim['pid']}: attempt 1 succeeds "
        "attempt 0 of the same submission" in log
    ), log[-3000:]
    kinds = [json.loads(x)["event"] for x in (run_uri / "events.jsonl").read_text().splitlines()]
    assert kinds.count("resume") == 1 and kinds[-1] == "finish", kinds
    assert not (run_uri / "owner.json").exists()


def test_every_host_of_a_refused_job_exits_with_the_owners_sentence(tmp_path, prepared):
    """Two `runtime worker` hosts on a run another host owns: the writer is refused, the other
    host learns it through the coordination service, and both exit 2 with the same sentence;
    neither writes its host log or anything else into the run."""
    from multihost import run_hosts

    uri = str(tmp_path / "runs")
    cfg = _cfg(tmp_path, prepared, uri, mesh={"data": 2})
    root = Path(uri) / "job"
    root.mkdir(parents=True)
    _write_record(str(root), _record(run_id="job", host="tpu-vm-3", pid=77))
    env = {"JAXJOB_RUN_ID": "job", "JAXJOB_SUBMISSION_ID": "other-submission"}
    results = run_hosts(["worker", str(cfg)], 2, 1, env=env, timeout=240)
    want = f"error: run 'job' at {os.path.abspath(root)} is in use by host tpu-vm-3 pid 77"
    for r in results:
        assert r.returncode == 2, r.output[-3000:]
        assert [ln for ln in stderr_lines(r.stderr) if ln.startswith("error:")] == [
            ln for ln in stderr_lines(r.stderr) if ln.startswith(want)
        ] and want in r.stderr, r.stderr
    assert sorted(p.name for p in root.iterdir()) == [".owner.lock", "owner.json"]


def test_rollback_is_refused_while_the_run_has_a_live_owner(tmp_path):
    """`runtime checkpoints rollback` deletes checkpoints: never under a live run."""
    root = tmp_path / "t"
    (root / "checkpoints").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"run_id": "t", "status": "running"}))
    live = _record(host="elsewhere", pid=1, renewed_epoch=time.time())
    _write_record(str(root), live)
    before = (root / "owner.json").read_bytes()
    res = run_cli("checkpoints", "rollback", str(root), "--to-step", "5")
    assert res.returncode == 2, res.stderr
    lines = stderr_lines(res.stderr)
    assert len(lines) == 1 and "in use by host elsewhere pid 1" in lines[0], lines
    assert (root / "owner.json").read_bytes() == before
    # Not a run directory: one sentence, and nothing (not even a claim) is written there.
    typo = tmp_path / "typo"
    res = run_cli("checkpoints", "rollback", str(typo), "--to-step", "5")
    assert res.returncode == 2 and "not a jaxjob run directory" in stderr_lines(res.stderr)[-1]
    assert not typo.exists()


def test_a_lease_renewal_the_storage_does_not_answer_is_a_failed_try(monkeypatch):
    """A renewal whose storage stops answering (the read never returns) is a failed try by the
    time the next one is due: the warning comes once half the lease has gone unrenewed, no second
    renewal is started on top of the stuck one, and renewing resumes once the storage answers."""
    import contextlib
    import io
    import threading

    from runtime.run.owner import RunClaim

    record = OwnerRecord(
        run_id="r", submission_id=None, attempt=0, host="h", pid=1, pid_start=None, boot_id="b",
        pid_namespace="n", started="now", renewed_epoch=time.time(), lease_s=2.0, token="t",
    )  # fmt: skip
    gate, wrote, warned = threading.Event(), threading.Event(), threading.Event()
    reads: list[float] = []

    class Slot:
        @contextlib.contextmanager
        def locked(self):
            yield

        def read(self):
            reads.append(time.monotonic())
            gate.wait()  # the storage answers once the test lets it
            return record.to_bytes(), 1

        def write(self, data, generation):
            wrote.set()
            return generation + 1

    class Stderr(io.StringIO):
        def write(self, s: str) -> int:
            if "could not renew the claim" in s:
                warned.set()
            return super().write(s)

    err = Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    claim = RunClaim("/nonexistent/run", record, Slot())
    claim.start_renewing()  # every 0.5 s
    try:
        assert warned.wait(60), err.getvalue()
        assert "did not answer within 0.5 s" in err.getvalue(), err.getvalue()
        assert len(reads) == 1, reads  # the stuck renewal is not started again
        gate.set()
        assert wrote.wait(60)  # it answered: the renewal went through
    finally:
        gate.set()
        claim._stop.set()
