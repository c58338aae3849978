"""A corrupt checkpoint, for real: a run whose latest checkpoint's array files are truncated.

Resume, eval and the worker's auto-resume end in one sentence naming the step (exit 2, not a
restart loop); `checkpoints verify` finds it; `--resume --from-step` branches off an older one,
discards the later ones explicitly, and trains to the same losses as an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

from jobspec.files.run_toml import parse_run_config
from runtime.run.inspect import inspect_run, render
from runtime.train.loop import train

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config


def _train(cfg_dict: dict, **kw):
    return train(parse_run_config(cfg_dict), "# test\n", emit=lambda _line: None, **kw)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics/train.jsonl")}


def _truncate_arrays(step_dir: Path) -> None:
    # The array data of the parameters, cut short as a full disk or a torn copy leaves it.
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        with p.open("r+b") as f:
            f.truncate(7)


def test_corrupt_latest_checkpoint_then_resume_from_an_older_step(tmp_path, prepared) -> None:
    out = str(tmp_path)
    whole = tiny_config(prepared, out, run_id="whole")
    assert _train(whole, resume=False).status == "completed"

    cfg = tiny_config(prepared, out, run_id="bad", checkpoint={"every": 4, "keep": 3})
    path = write_config(tmp_path / "bad.toml", cfg)
    run = tmp_path / "bad"
    assert _train(cfg, resume=False, max_steps=12).summary["steps"] == 12
    _truncate_arrays(run / "checkpoints/12")
    # As saved before checksums were recorded: the damage is found by reading the step (a
    # recorded step falls back instead, tests/faults/test_checkpoint_integrity.py).
    (run / "checkpoints/12/checksums.json").unlink()

    res = run_cli("local", str(path), "--resume")
    lines = stderr_lines(res.stderr)
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"error: checkpoint 12 under {run}/checkpoints cannot be read (")
    assert "`runtime local --resume --from-step 8` (available: 4, 8, 12)" in lines[0]
    assert f"`runtime checkpoints verify {run}`" in lines[0]
    # The record says so: the index marks the step, the events and the manifest the failure.
    index = json.loads((run / "checkpoints/index.json").read_text())
    assert [bool(e.get("unreadable")) for e in index["checkpoints"]] == [False, False, True]
    assert read_jsonl(run / "events.jsonl")[-1]["event"] == "checkpoint_unreadable"
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"
    assert "unreadable [12]" in render(inspect_run(str(run)))

    ver = run_cli("checkpoints", "verify", str(run))
    assert ver.returncode == 1, ver.stderr
    got = ver.stdout.splitlines()
    assert got[0].startswith("step 4: ok (") and got[0].endswith(" MiB)")
    assert got[1].startswith("step 8: ok (")
    assert got[2].startswith("step 12: unreadable: params: ") and len(got) == 3
    doc = json.loads(run_cli("checkpoints", "verify", str(run), "--json").stdout)
    assert not doc["ok"] and [s["ok"] for s in doc["steps"]] == [True, True, False]

    ev = run_cli("eval", "checkpoint", str(run))
    assert ev.returncode == 2 and len(stderr_lines(ev.stderr)) == 1, ev.stderr
    assert "checkpoint 12 " in ev.stderr and "--checkpoint 8 (available: 4, 8, 12)" in ev.stderr

    # A launched job's auto-resume: not restartable (a restart reads the same bytes), and the
    # way back is one that works before submitting again.
    wk = run_cli("worker", str(path))
    assert wk.returncode == 2, wk.stderr
    assert "error: checkpoint 12 " in wk.stderr and "Traceback" not in wk.stderr
    assert f"`runtime checkpoints rollback {run} --to-step 8` and submit the job again" in wk.stderr

    # A step that is not a committed checkpoint: one sentence with the choices, nothing lost.
    miss = run_cli("local", str(path), "--resume", "--from-step", "6")
    assert miss.returncode == 2 and len(stderr_lines(miss.stderr)) == 1, miss.stderr
    assert "step 6 is not a committed checkpoint" in miss.stderr and "4, 8, 12" in miss.stderr
    assert (run / "checkpoints/12").is_dir()

    ok = run_cli("local", str(path), "--resume", "--from-step", "8")
    assert ok.returncode == 0, ok.stderr
    assert "discarded checkpoint 12 (newer than --from-step 8)" in ok.stdout.splitlines()
    assert "resumed bad from checkpoint 8; training to step 20" in ok.stdout
    events = read_jsonl(run / "events.jsonl")
    discarded = [e for e in events if e["event"] == "checkpoints_discarded"]
    assert [(e["steps"], e["resume_from"]) for e in discarded] == [([12], 8)]
    assert events[-1]["event"] == "finish"
    assert json.loads((run / "manifest.json").read_text())["status"] == "completed"
    index = json.loads((run / "checkpoints/index.json").read_text())
    assert [e["step"] for e in index["checkpoints"]] == [12, 16, 20]
    assert not any(e.get("unreadable") for e in index["checkpoints"])  # 12 is a new save
    # No committed data lost: every step's loss equals the uninterrupted run's, once each.
    assert _losses(run) == _losses(tmp_path / "whole")
    assert len(read_jsonl(run / "metrics/train.jsonl")) == 20


def test_from_step_needs_resume(tmp_path, prepared) -> None:
    path = write_config(tmp_path / "c.toml", tiny_config(prepared, str(tmp_path)))
    res = run_cli("local", str(path), "--from-step", "4")
    assert res.returncode == 2 and len(stderr_lines(res.stderr)) == 1, res.stderr
    assert "--from-step 4 continues a run: pass it with --resume" in res.stderr
    assert not (tmp_path / "t").exists()
