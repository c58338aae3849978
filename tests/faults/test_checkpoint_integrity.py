"""Checkpoints that changed after they were committed, for real: a step directory the index lists
is gone, or array bytes rotted in place (same size). `checkpoints verify` names the step and the
file; a resume never passes them in silence: it falls back to the newest intact step with one
warning line and an event, and trains on from there to the losses it had before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jobspec.files.run_toml import parse_run_config
from runtime.commands.checkpoints import verify_checkpoints
from runtime.train.loop import train

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config

CKPT = {"every": 5, "keep": 3, "async": True}


@pytest.fixture(scope="module")
def stopped_at_15(tmp_path_factory, prepared) -> tuple[Path, Path, Path, dict]:
    """A run stopped at step 15 (checkpoints 5, 10, 15), trained once for the module: (where
    each test gets its own copy, an untouched copy, its config, its losses by step)."""
    out = tmp_path_factory.mktemp("integrity")
    cfg = tiny_config(prepared, str(out), run_id="ck", checkpoint=CKPT)
    path = write_config(out / "ck.toml", cfg)
    result = train(
        parse_run_config(cfg), "# test\n", resume=False, max_steps=15, emit=lambda _: None
    )
    assert result.summary["steps"] == 15
    run = out / "ck"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [
        "10", "15", "5",
    ]  # fmt: skip
    shutil.copytree(run, out / "untouched", symlinks=True)
    return run, out / "untouched", path, _losses(run)


@pytest.fixture
def first_attempt(stopped_at_15) -> tuple[Path, Path, dict]:
    """The stopped run as it was trained (whatever an earlier test did to it), at the path it
    was trained at: its dir, config and losses by step."""
    run, untouched, path, before = stopped_at_15
    shutil.rmtree(run)
    shutil.copytree(untouched, run, symlinks=True)
    return run, path, before


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics/train.jsonl")}


def _warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr_lines(stderr) if ln.startswith("warning: ")]


def _index_steps(run: Path) -> list[int]:
    return [
        e["step"] for e in json.loads((run / "checkpoints/index.json").read_text())["checkpoints"]
    ]


def _resumed_to_the_same_losses(run: Path, path: Path, before: dict, *, resume_from: int) -> str:
    """Resume to step 20; returns the warning it gave (exactly one)."""
    res = run_cli("local", str(path), "--resume")
    assert res.returncode == 0, res.stderr
    assert f"resumed {run.name} from checkpoint {resume_from}; training to step 20" in res.stdout
    warned = _warnings(res.stderr)
    assert len(warned) == 1, res.stderr
    after = _losses(run)
    assert sorted(after) == list(range(1, 21))
    assert {s: after[s] for s in before} == before  # recomputed from the intact step, not NaN
    assert _index_steps(run) == [10, 15, 20]  # the bad step was saved again
    return warned[0]


def test_missing_checkpoint_directory(first_attempt) -> None:
    run, path, before = first_attempt
    shutil.rmtree(run / "checkpoints/15")

    ver = run_cli("checkpoints", "verify", str(run))
    assert ver.returncode == 1, ver.stdout + ver.stderr
    lines = ver.stdout.splitlines()
    assert lines[0].startswith("step 5: ok (") and lines[1].startswith("step 10: ok ("), lines
    assert lines[2] == f"step 15: missing: {run}/checkpoints/15 is gone", lines

    warning = _resumed_to_the_same_losses(run, path, before, resume_from=10)
    assert warning.startswith(
        f"warning: checkpoint 15 is listed in {run}/checkpoints/index.json but {run}/checkpoints/15"
        " is gone;"
    ), warning
    assert "newest intact checkpoint is 10" in warning, warning
    missing = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "checkpoint_missing"]
    assert [e["step"] for e in missing] == [15], missing


def _flip_bytes(step_dir: Path) -> str:
    """Rot the largest array file of the parameters in place: same size, some bytes inverted.
    Returns its path within the step."""
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + 8, len(data))):
        data[i] ^= 0xFF
    size = target.stat().st_size
    target.write_bytes(bytes(data))
    assert target.stat().st_size == size
    return str(target.relative_to(step_dir))


def test_flipped_bytes(first_attempt) -> None:
    run, path, before = first_attempt
    rotten = _flip_bytes(run / "checkpoints/15")
    # A checkpoint written before checksums were recorded still verifies (by reading it).
    (run / "checkpoints/5/checksums.json").unlink(missing_ok=True)

    ver = run_cli("checkpoints", "verify", str(run))
    lines = ver.stdout.splitlines()
    assert len(lines) == 3 and lines[2].startswith(f"step 15: damaged: {rotten}: "), lines
    assert ver.returncode == 1, ver.stdout + ver.stderr
    assert lines[0].startswith("step 5: ok (") and "unverified" in lines[0], lines
    assert lines[1].startswith("step 10: ok (") and "unverified" not in lines[1], lines

    # Reading it for an eval: one sentence naming the step and the file (never the rotten bytes).
    ev = run_cli("eval", "checkpoint", str(run))
    assert ev.returncode == 2 and len(stderr_lines(ev.stderr)) == 1, ev.stderr
    assert "error: checkpoint 15 " in ev.stderr and rotten in ev.stderr, ev.stderr
    assert "--checkpoint 10" in ev.stderr, ev.stderr

    warning = _resumed_to_the_same_losses(run, path, before, resume_from=10)
    assert warning.startswith(f"warning: checkpoint 15 under {run}/checkpoints is damaged ("), (
        warning
    )
    assert rotten in warning and "resuming from checkpoint 10" in warning, warning
    damaged = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "checkpoint_damaged"]
    assert [(e["step"], e["resume_from"]) for e in damaged] == [(15, 10)], damaged
    assert rotten in damaged[0]["cause"]
    # The new step 15 verifies again (what `checkpoints verify`, run above, reports).
    again = verify_checkpoints(str(run))
    assert again["ok"] and [s["ok"] for s in again["steps"]] == [True] * 3, again
