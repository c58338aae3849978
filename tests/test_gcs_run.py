"""gs:// end to end against the GCS emulator on 127.0.0.1: data, artifacts and checkpoints in a
bucket, a resume from there, and `runtime inspect gs://…` reading it back."""

from __future__ import annotations

import json

import pytest

from runs import run_cli, tiny_config, write_config

pytestmark = pytest.mark.gcs


def test_run_resume_and_inspect_on_gcs(tmp_path, corpus_dir, orbax_gs_run_uri):
    # A fresh prefix per test (nothing left by another test is seen), on an emulator that
    # honours the conditional writes Orbax's saves need (the fixture skips on one that does not).
    data = f"{orbax_gs_run_uri}/data/tiny"
    prep = run_cli(
        "data",
        "prepare",
        "--input",
        str(corpus_dir / "*.txt"),
        "--out",
        data,
        "--val-fraction",
        "0.1",
    )
    assert prep.returncode == 0, prep.stderr
    check = run_cli("data", "check", f"{data}/manifest.json", "--deep", "--json")
    assert check.returncode == 0, check.stderr

    runs = f"{orbax_gs_run_uri}/runs"
    cfg = tiny_config(f"{data}/manifest.json", runs, run_id="gcs", checkpoint={"every": 5},
                      evals=[{"name": "val", "batches": 1}])  # fmt: skip
    path = write_config(tmp_path / "gcs.toml", cfg)
    first = run_cli("local", str(path), "--max-steps", "10")
    assert first.returncode == 0, first.stderr
    second = run_cli("local", str(path), "--resume")
    assert second.returncode == 0, second.stderr
    assert "from checkpoint 10" in second.stdout

    ins = run_cli("inspect", f"{runs}/gcs", "--json")
    assert ins.returncode == 0, ins.stderr
    rep = json.loads(ins.stdout)
    assert rep["status"] == "completed" and rep["steps"] == 20
    assert rep["latest_checkpoint"] == 20 and rep["checkpoints"][-1] == 20
    assert rep["best_eval"]["name"] == "val"

    from runfolder.storage import list_parts, read_parted, url_to_fs

    fs, root = url_to_fs(f"{runs}/gcs")
    fs.invalidate_cache()
    for rel in ("manifest.json", "config/source.toml", "config/resolved.json", "diagnostics/runtime.json",
                "summaries/final.json", "checkpoints/index.json",
                "checkpoints/20/commit_success.txt"):  # fmt: skip
        assert fs.exists(f"{root}/{rel}"), rel
    # JSONL on gs:// is appended as bounded parts (no object is rewritten whole per append).
    for rel in ("metrics/train.jsonl", "metrics/eval.jsonl", "events.jsonl"):
        assert list_parts(fs, f"{root}/{rel}"), rel
        assert not fs.exists(f"{root}/{rel}"), rel
    text = read_parted(fs, f"{root}/metrics/train.jsonl").decode()
    rows = [json.loads(x) for x in text.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))

    ev = run_cli("eval", "checkpoint", f"{runs}/gcs", "--checkpoint", "latest", "--json")
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["step"] == 20
