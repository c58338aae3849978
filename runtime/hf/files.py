"""Hugging Face safetensors files: read every tensor of a model dir, write tensors as one file or
index-listed shards. Names and dtypes pass through untouched; conversion is convert.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jobspec.errors import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _shard_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise ConfigError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF dir (single file or sharded), by HF name, as stored."""
    out: dict[str, np.ndarray] = {}
    for f in _shard_files(Path(path)):
        with safe_open(str(f), framework="numpy") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = fh.get_tensor(name)
    return out


def new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask: 0644 under umask 022."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(ln.split()[1], 8) for ln in f if ln.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)  # no /proc (macOS): read it by setting it, then put it back
        os.umask(umask)
    return 0o666 & ~umask


def write_safetensors(
    tensors: dict[str, np.ndarray],
    hf_config: dict[str, Any],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """config.json + the tensors, sharded above `max_shard_bytes`; the file names written.

    Every file gets the mode the umask gives a new file (0644 under umask 022): the safetensors
    writer goes through a 0600 temp file, and a config.json written over keeps its old mode."""
    files = _write_safetensors(tensors, hf_config, Path(out_dir), max_shard_bytes)
    mode = new_file_mode()
    for f in files:
        os.chmod(Path(out_dir) / f, mode)
    return files


def _write_safetensors(
    tensors: dict[str, np.ndarray], hf_config: dict[str, Any], out: Path, max_shard_bytes: int
) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        if stale.exists():
            os.remove(stale)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=meta)
        return ["config.json", SINGLE]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for f, shard in zip(files, shards, strict=True):
        save_file(shard, str(out / f), metadata=meta)
        weight_map.update(dict.fromkeys(shard, f))
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": weight_map,
    }
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return ["config.json", *files, INDEX]
