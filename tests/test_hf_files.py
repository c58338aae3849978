"""`runtime export hf`'s files (runtime/hf/files.py) without torch: the mode every file gets, and
one sentence for a file that cannot be read."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jobspec.errors import ConfigError
from runtime.hf.export_dir import replace_folder
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
    """An export replacing a folder's model (--overwrite) gives the new files the umask's mode
    whatever the old ones had; the files it keeps keep theirs."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "config.json").chmod(0o600)
    (out / SINGLE).write_bytes(b"old")
    (out / SINGLE).chmod(0o640)
    (out / "tokenizer.json").write_text("{}")
    (out / "tokenizer.json").chmod(0o600)

    def write(folder: Path) -> list[str]:
        return write_safetensors(TENSORS, {"model_type": "qwen3"}, folder)

    files = replace_folder(out, write, overwrite=True)
    assert files == ["config.json", SINGLE]
    assert _modes(out, files) == dict.fromkeys(files, 0o666 & ~umask)
    assert _modes(out, ["tokenizer.json"]) == {"tokenizer.json": 0o600}


def test_a_truncated_file_is_one_sentence_naming_it(tmp_path):
    whole = tmp_path / "whole"
    write_safetensors(TENSORS, {"model_type": "qwen3"}, whole)
    data = (whole / SINGLE).read_bytes()
    for cut in (4, 40, len(data) - 8):
        bad = tmp_path / f"cut{cut}"
        bad.mkdir()
        (bad / SINGLE).write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=f"{bad / SINGLE} cannot be read as safetensors"):
            read_safetensors(bad)


def test_an_index_naming_a_missing_shard_is_one_sentence(tmp_path):
    out = tmp_path / "sharded"
    write_safetensors(TENSORS, {"model_type": "qwen3"}, out, max_shard_bytes=200)
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        ConfigError,
        match=r"lists the shard model-00002-of-00003\.safetensors, which is not in .*"
        r"\(1 of 3 shards missing\)",
    ):
        read_safetensors(out)
    (out / INDEX).write_text("{not json")
    with pytest.raises(ConfigError, match="is not a safetensors index"):
        read_safetensors(out)
