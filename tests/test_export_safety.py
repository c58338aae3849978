"""Issue 35, items 2 and 5: `runtime export hf --out` never deletes or overwrites what it did not
write and swaps its folder in whole (a kill at any moment leaves the old folder or the new one);
`runtime import hf` says in one sentence what is wrong with a damaged HF dir."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jobspec.errors import ConfigError
from runtime.hf.export_dir import MARKER, recover, replace_folder
from runtime.hf.files import INDEX, SINGLE, read_safetensors, write_safetensors

from runs import ROOT, run_cli, stderr_lines

HANG_S = 300  # bounds a hang only: the child reaches its stop at once when it works
USER_FILES = ["model.safetensors", "model_ema.safetensors", "config.json", "tokenizer.json"]
TENSORS = {f"w{i}": np.full((4, 8), i, np.float32) for i in range(3)}  # 128 bytes each


def _tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` and its sha256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _users_folder(folder: Path) -> Path:
    """Someone's own Hugging Face dir: weights, an EMA copy, a config and a tokenizer."""
    folder.mkdir(parents=True)
    for name in USER_FILES:
        (folder / name).write_text(f"the user's {name}\n")
    return folder


def _writer(max_shard_bytes: int = 1 << 20):
    def write(folder: Path) -> list[str]:
        return write_safetensors(
            TENSORS, {"model_type": "qwen3"}, folder, max_shard_bytes=max_shard_bytes
        )

    return write


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# --- the folder rule, in process -------------------------------------------------------------


def test_a_users_folder_is_refused_and_left_as_it_was(tmp_path):
    out = _users_folder(tmp_path / "hf")
    before = _tree(out)
    with pytest.raises(
        ConfigError, match="already holds files jaxjob did not export .*--overwrite"
    ):
        replace_folder(out, _writer())
    assert _tree(out) == before and _leftovers(out) == []


def test_overwrite_replaces_only_the_model(tmp_path):
    """A sharded user model (shards + index) replaced by a single-file export: the stale shards
    and index go with the model they made; the EMA weights and the tokenizer stay."""
    out = _users_folder(tmp_path / "hf")
    for k in (1, 2):
        (out / f"model-0000{k}-of-00002.safetensors").write_text("user shard")
    (out / INDEX).write_text("{}")
    kept = {n: (out / n).read_bytes() for n in ("model_ema.safetensors", "tokenizer.json")}
    files = replace_folder(out, _writer(), overwrite=True, record={"step": 3})
    assert files == ["config.json", SINGLE]
    assert sorted(os.listdir(out)) == sorted([*files, MARKER, *kept])
    assert {n: (out / n).read_bytes() for n in kept} == kept
    assert sorted(read_safetensors(out)) == sorted(TENSORS)
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"] == files and marker["step"] == 3


def test_an_earlier_export_is_replaced_without_overwrite(tmp_path):
    out = tmp_path / "hf"
    sharded = replace_folder(out, _writer(max_shard_bytes=200))
    assert INDEX in sharded
    (out / "tokenizer.json").write_text("added after the export")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("kept too")
    files = replace_folder(out, _writer())
    assert sorted(os.listdir(out)) == sorted([*files, MARKER, "tokenizer.json", "notes"])
    assert (out / "notes" / "a.txt").read_text() == "kept too"
    assert _leftovers(out) == []


def test_the_writer_never_writes_over_a_folders_files(tmp_path):
    out = _users_folder(tmp_path / "hf")
    before = _tree(out)
    with pytest.raises(ConfigError, match="is not empty"):
        write_safetensors(TENSORS, {"model_type": "qwen3"}, out)
    assert _tree(out) == before


# --- killed mid-export ---------------------------------------------------------------------------

CHILD = """
import os, sys, time
from pathlib import Path
import numpy as np
import runtime.hf.export_dir as d
from runtime.hf.files import write_safetensors

out, ready, stage = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def stop_here():
    ready.touch()  # the test's event: it kills this process now
    while True:
        time.sleep(60)


def write(folder):
    files = write_safetensors({"w": np.ones((4, 4), np.float32)}, {"model_type": "qwen3"}, folder)
    if stage == "writing":
        stop_here()
    return files


exchange = d._exchange
if stage == "swapped":  # the new folder is in place, the old one not yet deleted
    d._exchange = lambda a, b: exchange(a, b) and stop_here()
if stage == "aside":  # no RENAME_EXCHANGE: killed between its two renames
    d._exchange = lambda a, b: False
    rename = os.rename
    def rename_then_stop(src, dst):
        rename(src, dst)
        if Path(src) == out:
            stop_here()
    d.os.rename = rename_then_stop
d.replace_folder(out, write, record={"step": "new"})
"""


def _kill_at(stage: str, out: Path, ready: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(ready), stage], cwd=ROOT,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + HANG_S
        while not ready.exists():  # an event: the child has reached the stage
            assert proc.poll() is None, ("it ended before the stage", proc.stderr.read())
            assert time.monotonic() < deadline, f"it did not reach {stage} in {HANG_S} s"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()


@pytest.mark.parametrize("stage", ["writing", "swapped", "aside"])
def test_a_kill_leaves_the_old_folder_or_the_new_one(tmp_path, stage, capsys):
    out = tmp_path / "hf"
    replace_folder(out, _writer(), record={"step": "old"})
    (out / "tokenizer.json").write_text("the user's")
    old = _tree(out)
    _kill_at(stage, out, tmp_path / "ready")
    # Beside it: the new folder (killed while writing), the old one (swapped out, not yet
    # deleted) or both (the old one moved aside, the new one not yet moved in).
    assert len(_leftovers(out)) == (2 if stage == "aside" else 1)
    if stage == "writing":
        assert _tree(out) == old
    elif stage == "swapped":
        assert json.loads((out / MARKER).read_text())["step"] == "new"
        assert (out / "tokenizer.json").read_text() == "the user's"
    else:  # no folder at `out` until the next export puts the old one back
        assert not out.exists()
    capsys.readouterr()
    recover(out)
    lines = stderr_lines(capsys.readouterr().err)
    assert all(line.startswith("note: ") for line in lines), lines
    said = [line.split()[1] for line in lines]
    assert said == (["removed", "restored"] if stage == "aside" else ["removed"]), lines
    assert _leftovers(out) == []
    if stage != "swapped":
        assert _tree(out) == old
    replace_folder(out, _writer())  # and the next export works, keeping the tokenizer
    assert (out / "tokenizer.json").read_text() == "the user's"
    assert capsys.readouterr().err == ""


def test_a_running_exports_folder_is_left_alone(tmp_path, capsys):
    """Another export of the same folder, still running: its new folder is not a leftover."""
    out = tmp_path / "hf"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        busy = tmp_path / f".hf.jaxjob-new-{sleeper.pid}-0123abcd"
        busy.mkdir()
        replace_folder(out, _writer())
        assert busy.is_dir() and capsys.readouterr().err == ""
    finally:
        sleeper.kill()
        sleeper.wait()


# --- the commands ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF model dir written by jaxjob, and a run imported from it."""
    from jobspec.families.model_config import ModelConfig
    from jobspec.run_config import MeshConfig
    from runtime.commands.hf import import_to_run
    from runtime.model.build import build_model
    from runtime.model.hf_weights import write_hf
    from runtime.model.sharding import build_mesh

    root = tmp_path_factory.mktemp("hf")
    cfg = ModelConfig(
        vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    write_hf(cfg, build_model(cfg, 0, build_mesh(MeshConfig())).params, root / "src")
    import_to_run(str(root / "src"), str(root / "runs" / "r"))
    return {"src": root / "src", "run": root / "runs" / "r"}


def test_cli_export_into_a_users_folder(tmp_path, hf_run):
    out = _users_folder(tmp_path / "hf")
    before = _tree(out)
    r = run_cli("export", "hf", str(hf_run["run"]), "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and "--overwrite" in lines[0] and "model_ema.safetensors" in lines[0]
    assert _tree(out) == before
    r = run_cli("export", "hf", str(hf_run["run"]), "--out", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert stderr_lines(r.stderr) == []
    after = _tree(out)
    for name in ("model_ema.safetensors", "tokenizer.json"):
        assert after[name] == before[name]
    for name in ("config.json", SINGLE):
        assert after[name] != before[name]
    assert sorted(read_safetensors(out)) == sorted(read_safetensors(hf_run["src"]))
    # Its own folder now: exported into again without --overwrite, the user's files still kept.
    r = run_cli("export", "hf", str(hf_run["run"]), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files"] == ["config.json", SINGLE]
    assert _tree(out)["model_ema.safetensors"] == before["model_ema.safetensors"]
    assert _leftovers(out) == []


def _damaged(src: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    bad = tmp_path / f"hf-{how}"
    bad.mkdir()
    (bad / "config.json").write_bytes((src / "config.json").read_bytes())
    data = (src / SINGLE).read_bytes()
    if how == "truncated":
        (bad / SINGLE).write_bytes(data[: len(data) // 2])
        return bad, f"{bad / SINGLE} cannot be read as safetensors"
    (bad / "model-00001-of-00002.safetensors").write_bytes(data)
    names = read_safetensors(src)
    shards = {n: f"model-0000{1 + k % 2}-of-00002.safetensors" for k, n in enumerate(names)}
    (bad / INDEX).write_text(json.dumps({"weight_map": shards}))
    return bad, f"lists the shard model-00002-of-00002.safetensors, which is not in {bad}"


@pytest.mark.parametrize("how", ["truncated", "missing shard"])
def test_cli_import_of_a_damaged_dir_is_one_sentence(tmp_path, hf_run, how):
    from runtime.commands.hf import import_to_run

    bad, said = _damaged(hf_run["src"], tmp_path, how)
    r = run_cli("import", "hf", str(bad), "--out", str(tmp_path / "new"))
    assert r.returncode == 2, r.stderr
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and said in lines[0], lines
    assert "Traceback" not in r.stderr
    # Into an empty folder: the same error (what the CLI prints as that one line), in this
    # process, since the command's boundary is checked above.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=re.escape(said)):
        import_to_run(str(bad), str(empty))
    assert not (tmp_path / "new").exists() and list(empty.iterdir()) == []


@pytest.mark.parametrize("how", ["truncated", "missing shard"])
def test_init_from_a_damaged_dir_is_one_sentence(tmp_path, hf_run, how):
    from jobspec.run_config import MeshConfig
    from runtime.hf.convert import model_config_from_hf
    from runtime.model.build import build_model
    from runtime.model.sharding import build_mesh

    bad, said = _damaged(hf_run["src"], tmp_path, how)
    cfg = model_config_from_hf(bad, init_from=f"hf:{bad}")
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_model(cfg, 0, build_mesh(MeshConfig()))


def test_cli_import_into_someone_elses_folder_is_refused(tmp_path, hf_run):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_text('{"not": "a run"}')
    r = run_cli("import", "hf", str(hf_run["src"]), "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and "not a jaxjob run (manifest.json)" in lines[0], lines
    assert sorted(os.listdir(out)) == ["manifest.json"]
    assert (out / "manifest.json").read_text() == '{"not": "a run"}'
