"""Hugging Face safetensors files: read every tensor of a model dir, write tensors as one file or
index-listed shards. Names and dtypes pass through untouched; conversion is convert.py's.

A file that cannot be read (truncated, not safetensors) or an index naming a shard that is not
there is a ConfigError naming the file; the writer fills a new or empty folder only (replacing
an existing folder is export_dir.py's)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jobspec.errors import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _index_files(path: Path) -> list[Path]:
    """The shard files the index lists, each checked to be there."""
    index = path / INDEX
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{index} is not a safetensors index ({type(e).__name__}: {e}); it needs a "
            '"weight_map" of tensor name -> shard file: copy it again from the model\'s source'
        ) from None
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{index}: its weight_map values must be shard file names")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ConfigError(
            f"{index} lists the shard {missing[0]}, which is not in {path} ({len(missing)} of "
            f"{len(names)} shards missing); copy every shard the index lists into {path}"
        )
    return [path / n for n in names]


def _shard_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        return _index_files(path)
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise ConfigError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def _unreadable(f: Path, e: Exception) -> ConfigError:
    return ConfigError(
        f"{f} cannot be read as safetensors ({e}); it is truncated or damaged: download or copy "
        "it again"
    )


def check_safetensors(path: str | Path) -> list[Path]:
    """The safetensors files of an HF dir, each header read and checked against the file's size
    (a truncated file fails here), before any tensor is."""
    files = _shard_files(Path(path))
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as fh:
                fh.keys()
        except (SafetensorError, OSError) as e:
            raise _unreadable(f, e) from None
    return files


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF dir (single file or sharded), by HF name, as stored."""
    out: dict[str, np.ndarray] = {}
    for f in check_safetensors(path):
        try:
            with safe_open(str(f), framework="numpy") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[name] = fh.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise _unreadable(f, e) from None
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
    """config.json + the tensors, sharded above `max_shard_bytes`, into a new or empty folder;
    the file names written.

    Every file gets the mode the umask gives a new file (0644 under umask 022): the safetensors
    writer goes through a 0600 temp file."""
    files = _write_safetensors(tensors, hf_config, Path(out_dir), max_shard_bytes)
    mode = new_file_mode()
    for f in files:
        os.chmod(Path(out_dir) / f, mode)
    return files


def _write_safetensors(
    tensors: dict[str, np.ndarray], hf_config: dict[str, Any], out: Path, max_shard_bytes: int
) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):  # never over someone's files: export_dir.py replaces a folder
        raise ConfigError(
            f"{out} is not empty; write the safetensors into a new or empty folder "
            "(`runtime export hf --out` replaces an existing one)"
        )
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
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
