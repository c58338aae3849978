"""An eval that cannot run, for real: data prepared with `--val-fraction 0` and an eval of the
validation split. `config check`, `preflight` and the start of a run refuse it before any step,
with one sentence naming the eval and the split. An eval that fails anyway (here: made to fail)
never costs the checkpoint due at its step, and a validation split too small for the eval's
distinct rows is one warning line and an event, not silent reuse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jobspec.errors import DataError
from jobspec.files.run_toml import parse_run_config
from runtime.commands.preflight import preflight
from runtime.data.prepare.build import prepare_dataset
from runtime.train.evaluate import Evaluator
from runtime.train.loop import train

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config


@pytest.fixture
def no_validation(tmp_path, corpus_dir) -> str:
    prepare_dataset([str(corpus_dir / "*.txt")], "byte", str(tmp_path / "data"), val_fraction=0)
    return str(tmp_path / "data/manifest.json")


def test_an_eval_of_an_empty_split_is_refused_before_any_step(tmp_path, no_validation) -> None:
    cfg = tiny_config(no_validation, str(tmp_path), run_id="noval", evals=[{"name": "val"}])
    path = write_config(tmp_path / "noval.toml", cfg)
    says = (
        f"eval 'val' reads the validation split of {tmp_path / 'data'}, which holds 0 tokens, and "
        "one row needs training.seq_len + 1 = 17; prepare the data with a validation share"
    )

    check = run_cli("config", "check", str(path), timeout=120)
    assert check.returncode == 2 and "valid" not in check.stdout, check.stdout
    (line,) = stderr_lines(check.stderr)
    assert line.startswith(f"error: {says}") and "set that eval's split = 'train'" in line, line

    report = preflight(parse_run_config(cfg))
    (evals,) = [c for c in report["checks"] if c["name"] == "evals"]
    assert not evals["ok"] and evals["detail"].startswith(says), evals
    assert next(c for c in report["checks"] if c["name"] == "data")["ok"]  # the data is fine

    with pytest.raises(DataError, match="^" + re.escape(says)):
        train(parse_run_config(cfg), "# test\n", resume=False, emit=lambda _line: None)
    run = tmp_path / "noval"
    assert not (run / "metrics/train.jsonl").exists()  # no step was taken
    assert not (run / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (run / "checkpoints").iterdir()
    )


def test_a_failing_eval_never_costs_the_save(tmp_path, prepared, monkeypatch, capsys) -> None:
    real = Evaluator.run
    calls: list[int] = []

    def failing_at_the_end(self, params, step, *args, **kwargs):
        calls.append(step)
        if step == 6:
            raise DataError("the validation shard vanished")
        return real(self, params, step, *args, **kwargs)

    monkeypatch.setattr(Evaluator, "run", failing_at_the_end)
    val_tokens = json.loads(Path(prepared).read_text())["splits"]["validation"]["tokens"]
    distinct = (val_tokens - 1) // 16
    batches = distinct // 8 + 1  # one batch more than the split holds: rows are reused
    cfg = tiny_config(
        prepared, str(tmp_path), run_id="evalfail",
        training={"target_tokens": 16 * 8 * 6, "eval_every": 2},
        checkpoint={"every": 2, "keep": 5},
        evals=[{"name": "val", "batches": batches}],
    )  # fmt: skip
    with pytest.raises(DataError, match="the validation shard vanished"):
        train(parse_run_config(cfg), "# test\n", resume=False, emit=lambda _line: None)
    assert calls == [2, 4, 6]
    run = tmp_path / "evalfail"
    index = json.loads((run / "checkpoints/index.json").read_text())
    # The final save was due with the failing eval, and is committed; the evals that ran
    # still pick `best`.
    assert [e["step"] for e in index["checkpoints"]] == [2, 4, 6]
    assert index["latest"] == 6 and index["best"] in (2, 4)
    assert all("val_loss" in e["metrics"] for e in index["checkpoints"][:2])
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"

    # The split holds fewer distinct rows than the eval reads: one warning, and an event.
    (warning,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warning.startswith(
        f"warning: eval 'val' reads {batches * 8:,} rows of the validation split of "
        f"{Path(prepared).parent} ({batches} batches of 8) but it holds {distinct:,} distinct "
        "rows, so rows are reused"
    ), warning
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "eval_rows_reused"]
    assert (event["eval"], event["rows"], event["needed"]) == ("val", distinct, batches * 8)
