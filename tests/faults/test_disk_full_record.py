"""The run's output directory on a disk that fills up: the job ends with one
sentence on stderr (no Orbax/absl ERROR lines before it), and the run's record says failed,
though the disk has no room left for the manifest when the failure is recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults.conftest import fill

from jobspec.exit_codes import EXIT_STORAGE_FAULT
from runfolder.view import read_progress

from runs import ROOT, read_jsonl, run_cli, stderr_lines, tiny_config, write_config

HANG_S = 600  # bounds only a hang: every wait below is for an event
STEPS = 100_000  # the run ends only when the disk is full
# ... and its schedule decays over the suite's 20 tiny steps: the one train step program XLA
# compiles once per session (its persistent cache), not one more for 100,000 steps.
SCHEDULE = {"schedule": {"decay_steps": 20}}


def _start(tmp_path: Path, cfg: dict) -> tuple[subprocess.Popen, Path, Path]:
    path = write_config(tmp_path / "run.toml", cfg)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "local", str(path)], cwd=ROOT, stdout=o, stderr=e
        )
    return proc, out, err


def _wait_for(proc: subprocess.Popen, ready, err: Path, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {HANG_S} s"
        time.sleep(0.05)


def _ended(proc: subprocess.Popen, err: Path) -> str:
    try:
        proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the run did not end within {HANG_S} s of the disk filling up")
    stderr = err.read_text()
    assert proc.returncode == EXIT_STORAGE_FAULT, stderr[-3000:]
    return stderr


def _one_sentence(stderr: str) -> str:
    lines = stderr_lines(stderr)
    assert len(lines) == 1, stderr[-5000:]
    assert lines[0].startswith("error: ") and "No space left on device" in lines[0], lines
    return lines[0]


def _recorded_failed(run_dir: Path, sentence: str) -> None:
    """manifest.json, `runtime inspect` and `launch status`'s progress all say failed, with the
    sentence the user saw."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed", manifest
    assert "error: " + manifest["failure"] == sentence
    ins = run_cli("inspect", str(run_dir), "--json")
    assert ins.returncode == 0, ins.stderr
    assert json.loads(ins.stdout)["status"] == "failed"
    progress = read_progress(str(run_dir))
    assert progress["status"] == "failed" and progress["eta_s"] is None, progress
    failures = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["exit_code"] == EXIT_STORAGE_FAULT


def test_checkpoint_on_a_full_disk_is_one_sentence(tmp_path, prepared, small_fs) -> None:
    disk = small_fs("8m")
    run_dir = Path(disk) / "full"
    # The step rows go to another disk, so the save is what meets the full disk first (a row
    # that does first is the sentence, and closing the checkpoints logs the save's own error).
    run_dir.mkdir()
    (tmp_path / "metrics").mkdir()
    (run_dir / "metrics").symlink_to(tmp_path / "metrics")
    cfg = tiny_config(prepared, disk, "full", checkpoint={"every": 5, "keep": 2, "async": True},
                      training={"target_tokens": 16 * 8 * STEPS}, optimizer=SCHEDULE)  # fmt: skip
    proc, _, err = _start(tmp_path, cfg)
    try:
        index = run_dir / "checkpoints" / "index.json"
        _wait_for(proc, lambda: index.exists() and json.loads(index.read_text())["latest"], err,
                  "first committed checkpoint")  # fmt: skip
        # Room for a few events, not for a checkpoint (~0.4 MB).
        fill(disk, leave_bytes=64 * 1024)
        stderr = _ended(proc, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Orbax logged the failed save from each of its threads (ERROR:absl:...): the user sees only
    # the one sentence the failure is reported with.
    sentence = _one_sentence(stderr)
    assert sentence.startswith("error: checkpoint "), sentence
    _recorded_failed(run_dir, sentence)


def test_a_disk_with_no_room_left_still_records_failed(tmp_path, prepared, small_fs) -> None:
    # No checkpoints: nothing but the run's own records writes, and the disk is filled to the
    # last byte, so when the failure is recorded no new file fits (manifest.json is replaced by
    # a new file: before the fix it stayed `running` and inspect said so).
    disk = small_fs("4m")
    run_dir = Path(disk) / "nospace"
    cfg = tiny_config(prepared, disk, "nospace", training={"target_tokens": 16 * 8 * STEPS},
                      optimizer=SCHEDULE)  # fmt: skip
    proc, _, err = _start(tmp_path, cfg)
    try:
        rows = run_dir / "metrics" / "train.jsonl"
        _wait_for(proc, lambda: rows.exists() and rows.stat().st_size > 0, err, "first step row")
        fill(disk)
        stderr = _ended(proc, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sentence = _one_sentence(stderr)
    assert f"{rows}" in sentence, sentence
    _recorded_failed(run_dir, sentence)


def _write(run_dir: Path, manifest: dict, events: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _status(run_dir: Path) -> tuple[dict, dict]:
    """What `runtime inspect --json` prints (its report, read in this process: the command
    itself is run below) and what `launch status` reads."""
    from runtime.run.inspect import inspect_run

    report = json.loads(json.dumps(inspect_run(str(run_dir)), default=str))
    return report, read_progress(str(run_dir))


def test_a_manifest_left_running_under_a_recorded_failure_reads_failed(tmp_path) -> None:
    # Where even the failure's manifest could not be written (another writer took the space),
    # the failure event recorded after it decides: inspect and launch status say failed.
    run_dir = tmp_path / "stale"
    sentence = "cannot append to x: No space left on device (ENOSPC); free space and restart"
    manifest = {"run_id": "stale", "status": "running", "total_steps": 20,
                "updated": "2026-01-01T00:00:00.000+00:00"}  # fmt: skip
    events = [
        {"time": "2026-01-01T00:00:00.001+00:00", "event": "start", "step": 0},
        {"time": "2026-01-01T00:00:09.000+00:00", "event": "failure", "step": 7,
         "error": sentence, "type": "StorageFaultError", "exit_code": EXIT_STORAGE_FAULT},
    ]  # fmt: skip
    _write(run_dir, manifest, events)
    ins, progress = _status(run_dir)
    assert ins["status"] == progress["status"] == "failed", (ins, progress)
    assert ins["failure"] == progress["failure"] == sentence
    shown = run_cli("inspect", str(run_dir))
    assert "status       failed" in shown.stdout and f"failure      {sentence}" in shown.stdout
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "running"  # read only

    # A diverged run's failure says so, with the step it diverged at.
    diverged = {**events[1], "type": "DivergedError", "exit_code": 46, "diverged_at_step": 6}
    _write(run_dir, manifest, [events[0], diverged])
    ins, progress = _status(run_dir)
    assert ins["status"] == progress["status"] == "diverged"
    assert ins["diverged_at_step"] == progress["diverged_at_step"] == 6

    # A new attempt that started after that failure is running again (its manifest is newer,
    # before its own start event is appended, and after).
    manifest["updated"] = "2026-01-01T00:01:00.000+00:00"
    _write(run_dir, manifest, events)
    ins, progress = _status(run_dir)
    assert ins["status"] == progress["status"] == "running" and ins["failure"] is None
    events.append({"time": "2026-01-01T00:01:00.001+00:00", "event": "resume", "step": 5})
    _write(run_dir, manifest, events)
    ins, progress = _status(run_dir)
    assert ins["status"] == progress["status"] == "running"
