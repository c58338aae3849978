"""Storage faults for real: a tmpfs that fills up under the checkpoints or the metrics, a GCS
proxy that answers 503 for a while or for good, torn JSONL lines. Each run that failed must end
restartable (exit 45) with one sentence, record the failure at the step reached, list no half
save, and resume to the losses of a run that never failed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from faults.conftest import fill
from faults.gcs_proxy import GcsFaultProxy

from jobspec.exit_codes import EXIT_STORAGE_FAULT

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config

CKPT = {"every": 5, "keep": 3, "async": True}


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prepared) -> dict[int, float]:
    """Losses of the same tiny run, uninterrupted (20 steps, a checkpoint every 5)."""
    out = tmp_path_factory.mktemp("ref")
    path = write_config(out / "ref.toml", tiny_config(prepared, str(out), "ref", checkpoint=CKPT))
    r = run_cli("local", str(path))
    assert r.returncode == 0, r.stderr
    losses = _losses(read_jsonl(out / "ref" / "metrics/train.jsonl"))
    assert sorted(losses) == list(range(1, 21))
    return losses


def _last_line(stderr: str) -> str:
    """The run's one error sentence (Orbax's threads may still print their own after it)."""
    errors = [ln for ln in stderr_lines(stderr) if ln.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def _failure(events: list[dict]) -> dict:
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 1, events
    return failures[0]


def _grow(path: str, size: str) -> None:
    """Space is freed: a tmpfs keeps its files when remounted larger."""
    subprocess.run(["mount", "-o", f"remount,size={size}", path], check=True, timeout=30)


def test_disk_full_during_a_checkpoint_save(tmp_path, prepared, reference, small_fs) -> None:
    run_dir = tmp_path / "ck"
    # The checkpoints live on a tmpfs with room for one tiny checkpoint (~0.4 MB), not two.
    ck = small_fs("600k")
    (run_dir).mkdir()
    (run_dir / "checkpoints").symlink_to(ck)
    path = write_config(
        tmp_path / "ck.toml", tiny_config(prepared, str(tmp_path), "ck", checkpoint=CKPT)
    )

    r = run_cli("local", str(path))
    assert r.returncode == EXIT_STORAGE_FAULT, r.stderr
    last = _last_line(r.stderr)
    # One sentence: the first error (not a second one from closing the checkpoints), with the
    # errno and the path it hit.
    assert last.startswith("error: checkpoint 10 under "), last
    assert "No space left on device (ENOSPC)" in last, last
    assert f"writing {run_dir}/checkpoints/10.orbax-checkpoint-tmp/" in last, last
    assert "checkpoint ?" not in r.stderr
    failure = _failure(read_jsonl(run_dir / "events.jsonl"))
    rows = read_jsonl(run_dir / "metrics/train.jsonl")
    # The step reached (not 0): the failure surfaces at the next poll, possibly before that
    # step's row is written.
    assert rows[-1]["step"] <= failure["step"] <= rows[-1]["step"] + 1 and failure["step"] > 10
    assert failure["exit_code"] == EXIT_STORAGE_FAULT and failure["type"] == "StorageFaultError"
    index = json.loads((run_dir / "checkpoints/index.json").read_text())
    assert [c["step"] for c in index["checkpoints"]] == [5] and index["latest"] == 5
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "failed"

    _grow(ck, "20m")
    again = run_cli("local", str(path), "--resume")
    assert again.returncode == 0, again.stderr
    assert "from checkpoint 5" in again.stdout
    assert _losses(read_jsonl(run_dir / "metrics/train.jsonl")) == reference
    index = json.loads((run_dir / "checkpoints/index.json").read_text())
    assert [c["step"] for c in index["checkpoints"]] == [10, 15, 20]
    assert not [p for p in Path(ck).iterdir() if "tmp" in p.name]  # the half save is gone


def test_metrics_disk_full_then_torn_lines(tmp_path, prepared, reference, small_fs) -> None:
    run_dir = tmp_path / "mx"
    metrics = small_fs("64k")
    run_dir.mkdir()
    (run_dir / "metrics").symlink_to(metrics)
    fill(metrics, leave_bytes=4096)  # one page: about 11 rows of ~360 bytes
    cfg = tiny_config(prepared, str(tmp_path), "mx", checkpoint=CKPT)
    path = write_config(tmp_path / "mx.toml", cfg)

    r = run_cli("local", str(path))
    assert r.returncode == EXIT_STORAGE_FAULT, r.stderr
    last = _last_line(r.stderr)
    assert last.startswith(f"error: cannot append to {run_dir}/metrics/train.jsonl: "), last
    assert "No space left on device (ENOSPC)" in last, last
    rows = read_jsonl(run_dir / "metrics/train.jsonl")  # whole rows only: the cut write is gone
    failure = _failure(read_jsonl(run_dir / "events.jsonl"))
    # The row after the last is the one that did not fit; rows are fetched and written once the
    # next step is dispatched, so the failure is recorded at that next step, the step reached.
    assert failure["step"] == rows[-1]["step"] + 2
    assert failure["exit_code"] == EXIT_STORAGE_FAULT
    assert rows[-1]["step"] >= 5, "the tmpfs must hold a checkpoint's worth of rows"

    # Then a crash in the middle of an append (half a row, no newline) on top of it.
    (Path(metrics) / ".filler").unlink()
    for rel in ("metrics/train.jsonl", "events.jsonl"):
        with open(run_dir / rel, "ab") as f:
            f.write(b'{"step": 13, "loss": 2.1')
    ins = run_cli("inspect", str(run_dir), "--json")
    assert ins.returncode == 0, ins.stderr
    assert json.loads(ins.stdout)["steps"] == rows[-1]["step"]
    assert "warning: the last line of" in ins.stderr and "ignoring it" in ins.stderr
    assert (run_dir / "events.jsonl").read_bytes().endswith(b'"loss": 2.1')  # inspect only reads

    again = run_cli("local", str(path), "--resume")
    assert again.returncode == 0, again.stderr
    warned = [ln for ln in stderr_lines(again.stderr) if ln.startswith("warning: the last line")]
    assert len(warned) == 2 and all("cut it off the file" in w for w in warned), warned
    assert _losses(read_jsonl(run_dir / "metrics/train.jsonl")) == reference
    assert read_jsonl(run_dir / "events.jsonl")[-1]["event"] == "finish"  # every line parses


@pytest.fixture
def proxy(gcs_emulator):
    import os

    p = GcsFaultProxy(os.environ["STORAGE_EMULATOR_HOST"]).start()
    yield p
    p.stop()


def _via(proxy: GcsFaultProxy) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}


@pytest.mark.gcs
def test_gcs_503s_for_a_while_are_retried(tmp_path, prepared, reference, orbax_gs_run_uri, proxy):
    cfg = tiny_config(prepared, orbax_gs_run_uri, "g1", checkpoint=CKPT)
    path = write_config(tmp_path / "g1.toml", cfg)
    # From the first metrics upload on, every request (ours, gcsfs's, Orbax's) fails for 4 s.
    plan = proxy.fail(status=503, when="train.jsonl", window_s=4.0)
    r = run_cli("local", str(path), env=_via(proxy))
    assert r.returncode == 0, r.stderr
    assert plan.hits >= 3, plan.seen
    from runfolder.store import ArtifactStore

    store = ArtifactStore(f"{orbax_gs_run_uri}/g1")
    assert _losses(store.read_jsonl("metrics/train.jsonl")) == reference
    assert store.read_json("checkpoints/index.json")["latest"] == 20


@pytest.mark.gcs
def test_gcs_503s_that_outlast_the_retries(tmp_path, prepared, orbax_gs_run_uri, proxy):
    cfg = tiny_config(prepared, orbax_gs_run_uri, "g2", checkpoint=CKPT,
                      runtime={"storage_retry_s": 1})  # fmt: skip
    path = write_config(tmp_path / "g2.toml", cfg)
    # The metrics never get through again (gcsfs alone retries ~30 s before giving up).
    uploads = r"^POST /upload/(?s:.*)train\.jsonl\.parts"
    proxy.fail(status=503, when=uploads, only=uploads)
    r = run_cli("local", str(path), env=_via(proxy), timeout=240)
    assert r.returncode == EXIT_STORAGE_FAULT, r.stderr
    last = _last_line(r.stderr)
    assert last.startswith(
        f"error: cannot write {orbax_gs_run_uri}/g2/metrics/train.jsonl: HTTP 503"
    ), last
    assert "restartable" in last
    from runfolder.store import ArtifactStore

    store = ArtifactStore(f"{orbax_gs_run_uri}/g2")
    failure = _failure(store.read_jsonl("events.jsonl"))
    # Step 1's row is written once step 2 is dispatched: the step reached when it failed.
    assert failure["step"] == 2 and failure["exit_code"] == EXIT_STORAGE_FAULT
