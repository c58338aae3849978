"""Resumes at the edges of a run: one with nothing left to train, one past a lowered target,
a target below one step, and checkpoint folders that retention must not (or cannot) delete."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

from jobspec.errors import CheckpointError, ConfigError
from jobspec.files.run_toml import merge, parse_run_config
from runtime.train.loop import train

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config


def _train(cfg: dict, emit=lambda _line: None, **kw):
    return train(parse_run_config(cfg), "# test\n", emit=emit, **kw)


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _index_steps(run: Path) -> list[int]:
    doc = json.loads((run / "checkpoints/index.json").read_text())
    return [e["step"] for e in doc["checkpoints"]]


def test_target_tokens_below_one_step_is_refused(tmp_path) -> None:
    one_step = tiny_config("m.json", str(tmp_path), training={"target_tokens": 16 * 8})
    assert parse_run_config(one_step).training.total_steps == 1
    cfg = tiny_config("m.json", str(tmp_path), training={"target_tokens": 100})
    with pytest.raises(ConfigError) as caught:
        parse_run_config(cfg)
    assert caught.value.exit_code == 2
    assert (
        "training.target_tokens: must be at least one step's tokens, global_batch_size x "
        "seq_len = 8 x 16 = 128 (a run trains whole steps)"
    ) in str(caught.value)
    res = run_cli("config", "check", str(write_config(tmp_path / "c.toml", cfg)))
    assert res.returncode == 2 and len(stderr_lines(res.stderr)) == 1, res.stderr
    assert "training.target_tokens: must be at least one step's tokens" in res.stderr


def test_a_completed_run_resumed_trains_nothing_and_writes_nothing(tmp_path, prepared) -> None:
    cfg = tiny_config(
        prepared, str(tmp_path), run_id="done", training={"target_tokens": 16 * 8 * 4},
        evals=[{"name": "val", "batches": 1}], checkpoint={"every": 2},
    )  # fmt: skip
    first = _train(cfg, resume=False)
    assert first.status == "completed"
    run = tmp_path / "done"
    before = _files(run)

    for resume in (True, "auto"):  # `--resume`, and a launched job started again
        lines: list[str] = []
        again = _train(cfg, resume=resume, emit=lines.append)
        assert (again.status, again.exit_code, again.summary["steps"]) == ("completed", 0, 4)
        assert lines == [
            "run done completed step 4 already (training.target_tokens = 512): nothing to "
            "train; raise target_tokens to continue it"
        ]
        assert _files(run) == before
    assert [r["step"] for r in read_jsonl(run / "metrics/eval.jsonl")] == [4]

    # A lowered target_tokens: the run is past its new end; said, and nothing changes.
    lower = merge(cfg, {"training": {"target_tokens": 16 * 8 * 2}})
    for from_step, what in ((None, "its latest checkpoint"), (4, "--from-step")):
        with pytest.raises(ConfigError) as caught:
            _train(lower, resume=True, from_step=from_step)
        assert str(caught.value) == (
            f"run 'done' cannot resume from step 4 ({what}): training.target_tokens = 256 ends "
            "it at step 2, so nothing was trained; raise target_tokens past 512 to continue it, "
            "or branch off an earlier checkpoint with --resume --from-step 2 (at or before "
            "step 2: 2)"
        )
        assert _files(run) == before


def _move_behind_link(run: Path, step: int, elsewhere: Path) -> Path:
    """Step `step`'s folder moved to `elsewhere`, a symbolic link left in its place."""
    target = elsewhere / str(step)
    shutil.move(run / f"checkpoints/{step}", target)
    os.symlink(target, run / f"checkpoints/{step}")
    return target


def test_retention_never_deletes_through_a_link(tmp_path, prepared, capsys) -> None:
    from runtime.commands.checkpoints import rollback

    cfg = tiny_config(
        prepared, str(tmp_path), run_id="ln", training={"target_tokens": 16 * 8 * 8},
        checkpoint={"every": 2, "keep": 2, "async": True},
    )  # fmt: skip
    assert _train(cfg, resume=False, max_steps=4).summary["steps"] == 4
    run, elsewhere = tmp_path / "ln", tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = _move_behind_link(run, 2, elsewhere)
    files = _files(target)
    capsys.readouterr()

    # Retention would retire step 2 before the final save: it is kept, said once.
    done = _train(cfg, resume=True)
    assert (done.status, done.summary["steps"]) == ("completed", 8)
    assert _index_steps(run) == [2, 6, 8]
    assert (run / "checkpoints/2").is_symlink() and _files(target) == files
    warned = [ln for ln in stderr_lines(capsys.readouterr().err) if ln.startswith("warning: ")]
    assert warned == [
        f"warning: checkpoint 2 under {run}/checkpoints is a symbolic link to "
        f"{os.path.realpath(target)}; it is kept past checkpoint.keep = 2, as checkpoints are "
        "never deleted through a link (remove the link yourself once it is not needed)"
    ]

    # Discarding a linked step is the user's to do: one sentence, and nothing changes.
    newest = _move_behind_link(run, 8, elsewhere)
    files = _files(newest)
    with pytest.raises(CheckpointError) as caught:
        rollback(str(run), 6)
    assert caught.value.exit_code == 2
    assert str(caught.value) == (
        f"{run}/checkpoints/8 is a symbolic link to {os.path.realpath(newest)}, and checkpoints "
        "are never deleted through a link; remove the link yourself (what it points to is "
        "kept) and run again"
    )
    assert _index_steps(run) == [2, 6, 8] and _files(newest) == files


def test_a_step_retention_cannot_delete_never_costs_the_final_save(
    tmp_path, prepared, monkeypatch, capsys
) -> None:
    cfg = tiny_config(
        prepared, str(tmp_path), run_id="perm", training={"target_tokens": 16 * 8 * 6},
        checkpoint={"every": 2, "keep": 1, "async": True},
    )  # fmt: skip
    run = tmp_path / "perm"
    real_delete = ocp.CheckpointManager.delete

    def delete(self, step: int) -> None:
        if step == 2:  # as a folder the run may not delete leaves it (root ignores modes)
            raise PermissionError(13, "Permission denied", f"{run}/checkpoints/2/params")
        real_delete(self, step)

    monkeypatch.setattr(ocp.CheckpointManager, "delete", delete)
    # Retention retires step 2 right before the final save (step 6): that save still happens.
    with pytest.raises(CheckpointError) as caught:
        _train(cfg, resume=False)
    assert caught.value.exit_code == 2
    assert str(caught.value) == (
        f"checkpoint 2 under {run}/checkpoints could not be deleted ([Errno 13] Permission "
        f"denied: '{run}/checkpoints/2/params'); every other checkpoint is kept: fix what the "
        f"cause names under {run}/checkpoints/2 (or delete it yourself) and run again"
    )
    assert _index_steps(run) == [4, 6] and (run / "checkpoints/2").is_dir()
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"
    assert "warning:" not in capsys.readouterr().err  # said once, by the error alone
