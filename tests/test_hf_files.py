"""`runtime export hf`'s files (runtime/hf/files.py) without torch: the mode every file gets."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from runtime.hf.files import INDEX, SINGLE, read_safetensors, write_safetensors

TENSORS = {f"w{i}": np.full((4, 8), i, np.float32) for i in range(3)}  # 128 bytes each


@pytest.fixture(params=[0o022, 0o027, 0o002], ids=lambda m: f"umask{m:03o}")
def umask(request) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _plain_mode(folder: Path) -> int:
    """The mode open() gives a new file here: what every exported file should have."""
    probe = folder / "probe"
    probe.write_text("")
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def _modes(out: Path, files: list[str]) -> dict[str, int]:
    return {f: stat.S_IMODE((out / f).stat().st_mode) for f in files}


@pytest.mark.parametrize("max_shard_bytes", [1 << 20, 200], ids=["single", "sharded"])
def test_every_file_gets_the_umask_mode(tmp_path, umask, max_shard_bytes):
    out = tmp_path / "hf"
    files = write_safetensors(
        TENSORS, {"model_type": "qwen3"}, out, max_shard_bytes=max_shard_bytes
    )
    sharded = max_shard_bytes == 200
    assert (INDEX in files) == sharded and (SINGLE in files) != sharded
    assert sorted(files) == sorted(p.name for p in out.iterdir())
    want = 0o666 & ~umask
    assert _plain_mode(tmp_path) == want
    assert _modes(out, files) == dict.fromkeys(files, want)
    assert {k: v.tolist() for k, v in read_safetensors(out).items()} == {
        k: v.tolist() for k, v in TENSORS.items()
    }
    if sharded:
        assert set(json.loads((out / INDEX).read_text())["weight_map"]) == set(TENSORS)


def test_an_export_over_old_files_gives_them_the_same_mode(tmp_path, umask):
    """A config.json written over keeps its inode's mode; the export sets it like the others."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "config.json").chmod(0o600)
    (out / SINGLE).write_bytes(b"old")
    (out / SINGLE).chmod(0o640)
    files = write_safetensors(TENSORS, {"model_type": "qwen3"}, out)
    assert files == ["config.json", SINGLE]
    assert _modes(out, files) == dict.fromkeys(files, 0o666 & ~umask)
