"""Issue 28, item 9: a token dataset whose files changed behind its manifest is refused at open.

A shard overwritten in place with the same size (a bad copy, another prepare's file) used to
pass the size checks and train on garbage; a damaged offsets file was an IndexError traceback.
Now every load compares sampled blocks of each file with the checksums the prepare recorded,
plain `runtime data check` also reads the offsets whole, and a bad file is one sentence naming
it: exit 2 for `data check` and for a run. Manifests made before the sampled checksums still
load; their offsets are still checked whole wherever they are read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jobspec.errors import DataError
from runtime.data.manifest import check_manifest, load_manifest
from runtime.data.samples import SAMPLE_BYTES, Sampler, read_digests, sample_digest, sample_ranges

from runs import run_cli, stderr_lines, tiny_config, write_config


def _copy(prepared: str, dest: Path) -> Path:
    shutil.copytree(Path(prepared).parent, dest)
    return dest / "manifest.json"


def _doc(man: Path) -> dict:
    return json.loads(man.read_text())


def _one_sentence(res, rc: int = 2) -> str:
    lines = stderr_lines(res.stderr)
    assert res.returncode == rc and len(lines) == 1, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    return lines[0]


def _check(man: Path, *extra: str):
    return run_cli("data", "check", *extra, str(man), timeout=120)


def _run(tmp_path: Path, man: Path, name: str, order: str = "shuffle"):
    # A run that gets as far as compiling (an old manifest's offsets are read by the loader)
    # compiles the suite's 20-step schedule, which XLA has cached, not one of 3 steps.
    cfg = tiny_config(str(man), str(tmp_path), run_id=name, data={"order": order},
                      training={"target_tokens": 16 * 8 * 3},
                      optimizer={"schedule": {"decay_steps": 20}})  # fmt: skip
    return run_cli("local", str(write_config(tmp_path / f"{name}.toml", cfg)), timeout=300)


def _break_offsets(man: Path) -> str:
    """Entry 5 of the train offsets made far too large, in place (same size); its path."""
    rel = _doc(man)["splits"]["train"]["offsets"]
    path = man.parent / rel
    offsets = np.fromfile(path, dtype="<i8")
    offsets[5] = 10**12
    offsets.tofile(path)
    return rel


def _as_old(man: Path) -> None:
    """The manifest as a prepare before the sampled checksums wrote it (they are not part of
    the fingerprint, so it stays valid)."""

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if "sample" not in k}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    man.write_text(json.dumps(strip(_doc(man)), indent=2))


def test_a_shard_overwritten_in_place_is_refused(tmp_path, prepared):
    man = _copy(prepared, tmp_path / "ds")
    rel = _doc(man)["splits"]["train"]["shards"][0]["path"]
    shard = man.parent / rel
    shard.write_bytes(b"\xff" * shard.stat().st_size)  # ids past the vocabulary: NaN if trained
    for res in (_check(man), _check(man, "--deep")):
        msg = _one_sentence(res)
        assert f"shard {rel} " in msg and "re-run `runtime data prepare`" in msg, msg
    msg = _one_sentence(_run(tmp_path, man, "garbage"))
    assert msg.startswith("error: ") and f"shard {rel} " in msg, msg
    assert not (tmp_path / "garbage" / "checkpoints").exists()  # it never trained


def test_a_damaged_offsets_file_is_one_sentence(tmp_path, prepared):
    man = _copy(prepared, tmp_path / "ds")
    rel = _break_offsets(man)
    msg = _one_sentence(_check(man))
    assert f"document offsets file {rel} " in msg, msg
    # document_buffer reads the offsets to pack documents: the run stops before training.
    msg = _one_sentence(_run(tmp_path, man, "offsets", order="document_buffer"))
    assert msg.startswith("error: ") and rel in msg and "IndexError" not in msg, msg


def test_old_manifests_still_load_and_their_offsets_are_checked(tmp_path, prepared):
    man = _copy(prepared, tmp_path / "ds")
    _as_old(man)
    assert load_manifest(str(man)).fingerprint == load_manifest(prepared).fingerprint
    summary = check_manifest(str(man))
    assert summary["ok"]
    rel = _break_offsets(man)
    msg = _one_sentence(_check(man))
    assert f"{rel} does not match" in msg, msg
    msg = _one_sentence(_run(tmp_path, man, "old", order="document_buffer"))
    assert msg.startswith("error: ") and rel in msg, msg
    # `data check` says how much it could sample: nothing in an old manifest.
    assert summary["files_sampled"] == 0 and check_manifest(prepared)["files_sampled"] > 0
    # Its shards are checked by size only: a same-size overwrite needs --deep (the sha256).
    man = _copy(prepared, tmp_path / "ds2")
    _as_old(man)
    shard = man.parent / _doc(man)["splits"]["train"]["shards"][0]["path"]
    shard.write_bytes(shard.read_bytes()[::-1])
    assert check_manifest(str(man))["ok"]
    with pytest.raises(DataError, match=r"train-00000.bin has sha256 \w+… but the manifest"):
        check_manifest(str(man), deep=True)


def test_sampled_checksums_agree_however_the_bytes_arrive(tmp_path):
    """The writer's checksum (bytes in memory, or streamed in any chunks: merged offsets) is
    the one a load computes from range reads; a byte in a sampled block changes it."""
    from runfolder.storage import url_to_fs

    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    want = sample_digest(data)
    for chunk in (1, 999, 4096, 70_000):
        s = Sampler(len(data))
        for i in range(0, len(data), chunk):
            s.update(data[i : i + chunk])
        assert s.hexdigest() == want, chunk
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fs, p = url_to_fs(str(path))
    assert read_digests(fs, {p: len(data)}) == {p: want}
    (a, b), (c, _) = sample_ranges(len(data))[3:5]
    assert b - a == SAMPLE_BYTES and c > b
    changed = bytearray(data)
    changed[a + 7] ^= 1
    assert sample_digest(bytes(changed)) != want
    changed[a + 7] ^= 1
    changed[b] ^= 1  # between two blocks: only the sha256 (--deep) sees it
    assert sample_digest(bytes(changed)) == want


@pytest.mark.gcs
def test_gcs_shard_overwritten_in_place_is_refused(gs_run_uri, corpus_dir):
    from runfolder.storage import url_to_fs
    from runtime.data.prepare.build import prepare_dataset

    m = prepare_dataset([str(corpus_dir / "*.txt")], "byte", gs_run_uri, val_fraction=0.1)
    uri = f"{gs_run_uri}/manifest.json"
    assert check_manifest(uri)["files_sampled"] == 4  # two splits: a shard and offsets each
    rel = m.split("validation").shards[0].path
    fs, path = url_to_fs(f"{gs_run_uri}/{rel}")
    data = bytes(fs.cat_file(path))
    fs.pipe_file(path, data[::-1])  # same size, other bytes
    with pytest.raises(DataError, match=f"shard {rel} does not hold"):
        load_manifest(uri)
