"""A run that diverges, for real: a token shard overwritten with 0xFFFF (ids past the vocabulary
make the loss NaN), as a damaged disk or a bad copy leaves it.

The run stops with one sentence and exit 46 (not restartable) before anything non-finite is
saved or evaluated; its record says `diverged`, never `completed`; every JSON line it wrote is
strict JSON (null, not NaN). `training.on_nonfinite = "skip_step"` keeps the state of the bad
steps instead, up to `training.max_skipped_steps`. The config refuses what cannot train.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jobspec.errors import ConfigError, DivergedError
from jobspec.exit_codes import EXIT_DIVERGED, is_restartable
from jobspec.files.run_toml import parse_run_config
from runfolder.store import ArtifactStore
from runtime.data.samples import sample_digest
from runtime.run.inspect import inspect_run, render
from runtime.train.loop import train

from runs import run_cli, stderr_lines, tiny_config, write_config

SEQ, ROWS = 16, 8  # tiny_config's seq_len and global_batch_size


def _strict(line: str):
    def refuse(name: str):
        raise ValueError(f"bare {name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def _strict_jsonl(path: Path) -> list[dict]:
    return [_strict(line) for line in path.read_text().splitlines() if line.strip()]


def _poisoned(prepared: str, dest: Path, first_step: int, last_step: int | None = None) -> str:
    """A copy of the prepared dataset whose train tokens read by steps first_step..last_step
    (1-based, `data.order = "sequential"`: step k reads the windows of tokens
    [(k-1)*128, k*128 + 1)) and by no other step are 0xFFFF."""
    shutil.copytree(Path(prepared).parent, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    lo = (first_step - 1) * SEQ * ROWS + 1  # past the previous step's last window
    hi = None if last_step is None else last_step * SEQ * ROWS  # before the next step's first
    start = 0
    for shard in manifest["splits"]["train"]["shards"]:
        path, n = dest / shard["path"], shard["tokens"]
        tokens = np.fromfile(path, dtype=manifest["token_dtype"])
        a, b = max(lo - start, 0), min(n if hi is None else hi - start, n)
        if a < b:
            tokens[a:b] = np.iinfo(tokens.dtype).max
            tokens.tofile(path)
            # Bad data its manifest vouches for (else the load refuses the changed shard).
            shard["sample_sha256"] = sample_digest(tokens.tobytes())
        start += n
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return str(dest / "manifest.json")


def test_a_diverged_run_stops_before_saving_and_says_so(tmp_path, prepared) -> None:
    data = _poisoned(prepared, tmp_path / "data", first_step=5)
    cfg = tiny_config(
        data, str(tmp_path), run_id="nan",
        data={"order": "sequential"},
        # Rows are fetched at steps 3 and 6 only (the saves and evals): the check adds no sync.
        training={"log_every": 10, "eval_every": 3},
        checkpoint={"every": 3},
        evals=[{"name": "val", "batches": 1}],
    )  # fmt: skip
    res = run_cli("local", str(write_config(tmp_path / "nan.toml", cfg)), timeout=240)
    run = tmp_path / "nan"
    lines = stderr_lines(res.stderr)
    assert res.returncode == EXIT_DIVERGED == 46 and not is_restartable(res.returncode), res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("error: run nan diverged at step 5 (loss nan, grad_norm nan"), lines
    assert "the newest checkpoint, 3, is finite" in lines[0]
    assert f"`runtime checkpoints rollback {run} --to-step N`" in lines[0]

    # Every line is strict JSON; the diverged steps' figures are null.
    rows = _strict_jsonl(run / "metrics/train.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in rows[:4])
    assert rows[4]["loss"] is None and rows[4]["grad_norm"] is None
    events = _strict_jsonl(run / "events.jsonl")
    failure = events[-1]
    assert failure["event"] == "failure" and failure["exit_code"] == 46 and failure["step"] == 6

    # Nothing non-finite was saved, or evaluated: step 6 was due, and is not there.
    index = json.loads((run / "checkpoints/index.json").read_text())
    assert [e["step"] for e in index["checkpoints"]] == [3]
    assert index["latest"] == index["best"] == 3
    assert not (run / "checkpoints/6").exists()
    assert [r["step"] for r in _strict_jsonl(run / "metrics/eval.jsonl")] == [3]

    # The record says diverged, with the step, everywhere it is read.
    manifest = _strict((run / "manifest.json").read_text())
    assert manifest["status"] == "diverged" and manifest["diverged_at_step"] == 5
    summary = _strict((run / "summaries/final.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 5
    assert summary["checkpoints"] == {"latest": 3, "best": 3}
    text = render(inspect_run(str(run)))
    assert "status       diverged at step 5" in text and "failure      run nan diverged" in text


def _arrays(item: Path) -> list[np.ndarray]:
    with ocp.StandardCheckpointer() as reader:
        return [np.asarray(x) for x in jax.tree.leaves(reader.restore(item))]


def test_skip_step_keeps_the_state_of_bad_steps_up_to_its_limit(tmp_path, prepared) -> None:
    data = _poisoned(prepared, tmp_path / "data", first_step=5, last_step=6)
    over = dict(
        data={"order": "sequential"},
        training={"target_tokens": SEQ * ROWS * 8, "log_every": 4,
                  "on_nonfinite": "skip_step", "max_skipped_steps": 2},
        checkpoint={"every": 2, "keep": 4, "async": False},
    )  # fmt: skip
    cfg = tiny_config(data, str(tmp_path), run_id="skip", **over)
    lines: list[str] = []
    result = train(parse_run_config(cfg), "# test\n", resume=False, emit=lines.append)
    assert result.status == "completed" and result.exit_code == 0
    run = tmp_path / "skip"
    rows = _strict_jsonl(run / "metrics/train.jsonl")
    assert [r["skipped"] for r in rows] == [False] * 4 + [True, True] + [False] * 2
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 0, 1, 2, 2, 2]
    assert rows[4]["loss"] is None and all(math.isfinite(rows[i]["loss"]) for i in (3, 6, 7))
    # A skipped step is no optimizer step: the schedule waits (rows 5 to 7 share one lr).
    assert rows[4]["lr"] == rows[5]["lr"] == rows[6]["lr"] != rows[7]["lr"]
    skips = [e for e in _strict_jsonl(run / "events.jsonl") if e["event"] == "step_skipped"]
    assert [(e["step"], e["skipped_steps"]) for e in skips] == [(5, 1), (6, 2)]
    assert sum("warning: step 5 skipped (loss nan" in ln for ln in lines) == 1, lines
    # The skipped steps changed neither the parameters nor the optimizer state.
    for item in ("params", "opt_state"):
        before, after = _arrays(run / "checkpoints/4" / item), _arrays(run / "checkpoints/6" / item)
        assert len(before) == len(after) > 0
        assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), item
        assert all(np.isfinite(a).all() for a in after if a.dtype.kind == "f")
    # The count travels with the checkpoint, so the limit spans restarts.
    assert json.loads((run / "checkpoints/6/meta/metadata").read_text())["skipped_steps"] == 2

    # One skip more than the limit ends the run as a divergence.
    over["training"]["max_skipped_steps"] = 1
    strict = tiny_config(data, str(tmp_path), run_id="limit", **over)
    with pytest.raises(DivergedError) as caught:
        train(parse_run_config(strict), "# test\n", resume=False, emit=lambda _line: None)
    assert caught.value.exit_code == 46 and caught.value.step == 6
    assert str(caught.value).startswith(
        "run limit skipped 2 steps with a non-finite loss or gradient, more than "
        "training.max_skipped_steps = 1 (the last at step 6: loss nan"
    )
    index = json.loads((tmp_path / "limit/checkpoints/index.json").read_text())
    assert [e["step"] for e in index["checkpoints"]] == [2, 4]  # 6 was due, and refused


def test_a_checkpoint_damaged_into_nan_is_refused_at_resume(tmp_path, prepared) -> None:
    """Saves are finite, so NaN read back is damage: resume ends in the damaged-checkpoint
    sentence (exit 2, the way back to an older step), not in a run that trains on NaN."""
    from jobspec.errors import CheckpointError
    from runtime.commands.checkpoints import verify_checkpoints

    cfg = tiny_config(
        prepared, str(tmp_path), run_id="dmg", checkpoint={"every": 2, "async": False}
    )
    run = tmp_path / "dmg"
    train(parse_run_config(cfg), "# test\n", resume=False, max_steps=4, emit=lambda _line: None)
    item = run / "checkpoints/4/params"
    with ocp.StandardCheckpointer() as io:
        leaves, treedef = jax.tree.flatten(io.restore(item))
        leaves = [np.asarray(x) for x in leaves]
        leaves[0] = np.full_like(leaves[0], np.nan)  # as flipped bytes can leave an array
        io.save(tmp_path / "nan-params", jax.tree.unflatten(treedef, leaves))
    shutil.rmtree(item)
    shutil.move(tmp_path / "nan-params", item)
    # As saved before checksums were recorded (else they find the change and resume falls back).
    (run / "checkpoints/4/checksums.json").unlink()

    with pytest.raises(CheckpointError) as caught:
        train(parse_run_config(cfg), "# test\n", resume=True, emit=lambda _line: None)
    assert caught.value.exit_code == 2
    assert str(caught.value).startswith(
        f"checkpoint 4 under {run}/checkpoints cannot be read (its arrays hold NaN or infinite "
        "values); resume from an older one with `runtime local --resume --from-step 2`"
    )
    index = json.loads((run / "checkpoints/index.json").read_text())
    assert [bool(e.get("unreadable")) for e in index["checkpoints"]] == [False, True]
    assert not (run / "checkpoints/6").exists()
    report = verify_checkpoints(str(run))
    assert [s["ok"] for s in report["steps"]] == [True, False]
    assert "holds NaN or infinite values" in report["steps"][1]["cause"]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"optimizer": {"lr": math.inf}}, "optimizer.lr: Input should be a finite number"),
        ({"optimizer": {"lr": math.nan}}, "optimizer.lr: Input should be a finite number"),
        ({"optimizer": {"lr": 1e4}}, "optimizer.lr: Input should be less than or equal to 10"),
        ({"optimizer": {"eps": math.inf}}, "optimizer.eps: Input should be a finite number"),
        ({"optimizer": {"grad_clip_norm": math.inf}}, "optimizer.grad_clip_norm: Input should"),
        ({"model": {"rms_norm_eps": math.nan}}, "model.rms_norm_eps: Input should be a finite"),
        ({"run": {"seed": 12345678901234567890}}, "run.seed: not a seed JAX's PRNG takes"),
        ({"training": {"target_tokens": 1e23}}, "training.target_tokens: must be a number of"),
        (
            {"optimizer": {"schedule": {"warmup_steps": 2**40}}},
            "optimizer.schedule.warmup_steps: Input should be less",
        ),
    ],
)
def test_the_config_refuses_what_cannot_train(override, says) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config(tiny_config("m/manifest.json", "out", **override), "c.toml")
    assert str(caught.value).startswith(f"c.toml: {says}"), caught.value
    assert "\n" not in str(caught.value)


def test_config_check_refuses_an_infinite_lr(tmp_path) -> None:
    path = write_config(tmp_path / "c.toml", tiny_config("m/manifest.json", str(tmp_path)))
    res = run_cli("config", "check", str(path), "--set", "optimizer.lr=inf", timeout=120)
    assert res.returncode == 2 and "valid" not in res.stdout, res.stdout
    assert stderr_lines(res.stderr) == [
        f"error: {path}: optimizer.lr: Input should be a finite number (got inf)"
    ]


def test_json_files_and_rows_are_strict_json(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path))
    store.write_json("a.json", {"loss": math.nan, "norms": [math.inf, 1.5, -math.inf],
                                "eta": np.float64("nan"), "ok": 2.0})  # fmt: skip
    store.append_jsonl("rows.jsonl", [{"step": 1, "loss": math.nan}, {"step": 2, "loss": 0.5}])
    assert _strict((tmp_path / "a.json").read_text()) == {
        "loss": None,
        "norms": [None, 1.5, None],
        "eta": None,
        "ok": 2.0,
    }
    assert _strict_jsonl(tmp_path / "rows.jsonl") == [
        {"step": 1, "loss": None},
        {"step": 2, "loss": 0.5},
    ]
    assert store.read_jsonl("rows.jsonl")[0]["loss"] is None
