"""Issue 35, items 2 and 7: `runtime data prepare --out` never writes over a folder that is not a
jaxjob dataset unless --overwrite (and then keeps its files); SIGTERM is one line and exit 42; a
shard folder a killed prepare left is removed by the next one, which says so. `data tokenizer
--out` names a file: a folder there is one sentence."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.errors import DataError
from jobspec.exit_codes import EXIT_RESTARTABLE
from jobspec.run_config import DataConfig
from runtime.data.mixture import ensure_manifest
from runtime.data.prepare.build import prepare_dataset

from runs import ROOT, run_cli, stderr_lines

HANG_S = 300  # bounds a hang only: the child reaches its stop at once when it works


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def texts(tmp_path) -> str:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text(f"document {i} " * 60)
    return str(src / "*.txt")


def _prepare(texts: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("data", "prepare", "--input", texts, "--out", str(out), "--no-progress", *extra)


def test_a_folder_that_is_no_dataset_is_refused_unless_overwrite(tmp_path, texts):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_text('{"my": "own manifest"}')
    (out / "train-00000.bin").write_bytes(b"my own file, named like a shard")
    (out / "notes.txt").write_text("keep me")
    before = _tree(out)
    r = _prepare(texts, out)
    assert r.returncode == 2, r.stderr
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and "not a jaxjob dataset (manifest.json, notes.txt)" in lines[0]
    assert "--overwrite" in lines[0]
    assert _tree(out) == before
    r = _prepare(texts, out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert stderr_lines(r.stderr) == []
    after = _tree(out)
    for name in ("notes.txt", "train-00000.bin"):
        assert after[name] == before[name]
    assert json.loads((out / "manifest.json").read_text())["format"] == "jaxjob.tokens"
    # Now it is a dataset's folder: prepared again without --overwrite, its files still kept.
    r = _prepare(texts, out)
    assert r.returncode == 0 and stderr_lines(r.stderr) == [], r.stderr
    assert _tree(out)["notes.txt"] == before["notes.txt"]


def test_an_out_that_is_a_file_is_one_sentence(tmp_path, texts):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    with pytest.raises(DataError, match="is a file; give a new or empty folder"):
        prepare_dataset([texts], "byte", str(blocker))
    assert blocker.read_text() == "mine"


def test_a_share_into_a_folder_that_is_no_dataset_is_refused(tmp_path, texts):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = _prepare(texts, out, "--shard", "0/2")
    assert r.returncode == 2, r.stderr
    assert "not a jaxjob dataset (notes.txt)" in r.stderr
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_runs_data_folder_that_is_no_dataset_is_refused(tmp_path, texts):
    """[data.prepare] makes data.manifest's folder on first use: not over someone's files."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    cfg = DataConfig(manifest=str(folder / "manifest.json"), prepare={"inputs": [texts]})
    with pytest.raises(DataError, match=r"data\.manifest .*not a jaxjob dataset \(notes\.txt\)"):
        ensure_manifest(cfg)
    assert sorted(os.listdir(folder)) == ["notes.txt"]


# --- signals ---------------------------------------------------------------------------------

# The real command, stopped where its shard folder exists and no part is written yet.
CHILD = """
import sys, time
from pathlib import Path
import runtime.data.prepare.build as prepare


def stopped(*args, **kwargs):
    Path(sys.argv[1]).touch()  # the test's event: it signals this process now
    while True:
        time.sleep(60)


prepare.run_parts = stopped
from runtime.commands.cli import main
main(sys.argv[2:])
"""


def _stopped_prepare(ready: Path, texts: str, out: Path, *extra: str) -> subprocess.Popen:
    args = ["data", "prepare", "--input", texts, "--out", str(out), "--no-progress", *extra]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ready), *args], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + HANG_S
    while not ready.exists():  # an event: the prepare is under way
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"it did not reach its parts: {proc.communicate()}")
        time.sleep(0.02)
    return proc


@pytest.mark.parametrize("share", [None, "1/2"], ids=["whole", "share"])
def test_sigterm_is_one_line_and_exit_42(tmp_path, texts, share):
    out = tmp_path / "ds"
    assert _prepare(texts, out).returncode == 0
    before = _tree(out)
    extra = ("--shard", share) if share else ()
    proc = _stopped_prepare(tmp_path / "ready", texts, out, *extra)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_RESTARTABLE, err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM while preparing")
    assert ("share 1/2" in lines[0]) == bool(share), lines
    after = _tree(out)
    if share:  # a share keeps its folder for the parts it commits: only its plan so far
        assert [k for k in after if k not in before] == [
            f"{next(out.glob('shares-*')).name}/plan.json"
        ]
    else:  # no new shard folder left: only the committed dataset
        assert after == before
        assert sorted(os.listdir(out)) == sorted({k.split("/")[0] for k in before})


SIGTERM_EARLY = """
import os, signal
from runtime.data.prepare.stop import PrepareStopped, SigtermStop

before = signal.getsignal(signal.SIGTERM)
with SigtermStop() as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this (the main) thread
    try:
        stop.arm("preparing x")
    except PrepareStopped as e:
        assert str(e) == "stopped by SIGTERM while preparing x", e
    else:
        raise AssertionError("the SIGTERM before arm() was lost")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the clean-up runs to its end
assert signal.getsignal(signal.SIGTERM) is before
print("ok")
"""


def test_a_sigterm_before_arming_waits_for_it():
    """A SIGTERM while the prepare's modules are still importing stops it once they are. In a
    process of its own: a real SIGTERM to the test process would also reach whatever signal
    watcher an earlier in-process test left there."""
    r = subprocess.run([sys.executable, "-c", SIGTERM_EARLY], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_a_killed_prepares_folder_is_removed_and_said(tmp_path, texts):
    out = tmp_path / "ds"
    assert _prepare(texts, out).returncode == 0
    dataset = json.loads((out / "manifest.json").read_text())["splits"]["train"]["offsets"]
    proc = _stopped_prepare(tmp_path / "ready", texts, out)
    proc.kill()
    proc.communicate()
    left = [p.name for p in out.iterdir() if p.name.startswith("shards-")]
    assert len(left) == 2  # the dataset's and the killed prepare's
    (orphan,) = [name for name in left if not dataset.startswith(f"{name}/")]
    r = _prepare(texts, out)
    assert r.returncode == 0, r.stderr
    lines = stderr_lines(r.stderr)
    assert lines == [f"note: removed {out / orphan}, left by a prepare that did not finish"]
    assert len([p for p in out.iterdir() if p.name.startswith("shards-")]) == 1
    # Replacing a dataset (its own shards deleted) is no news: nothing on stderr.
    r = _prepare(texts, out)
    assert r.returncode == 0 and stderr_lines(r.stderr) == [], r.stderr


def test_tokenizer_out_naming_a_folder_is_one_sentence(tmp_path, texts):
    """`data tokenizer --out` names a file: a folder is said before the training, not after."""
    folder = tmp_path / "tok"
    folder.mkdir()
    r = run_cli("data", "tokenizer", "--input", texts, "--vocab-size", "300", "--out", str(folder))
    assert r.returncode == 2, r.stderr
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and f"--out {folder}/tokenizer.json" in lines[0], lines
    assert list(folder.iterdir()) == []
