"""Hugging Face safetensors <-> NNX parameters through a name map, bit-exact in both directions
(a config's own map is its family's: runtime/model/hf_weights.py reads and writes by config).

Import reads `config.json` plus `model.safetensors`, or the shards a `model.safetensors.index.json`
lists, with `safetensors.numpy` (no torch). Export writes `config.json` and `model.safetensors`,
split into `model-0000k-of-0000n.safetensors` shards with an index above `max_shard_bytes`.
Tensors keep their stored dtype both ways (a bf16 parameter is written as bf16); only an
explicit `param_dtype` that differs from the checkpoint's casts on import.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from jobspec.errors import ConfigError
from jobspec.families.model_config import ModelConfig
from jobspec.hf_config import model_fields_from_hf, read_hf_config
from runtime.hf.files import read_safetensors
from runtime.hf.names import Entry

Path_ = tuple[str | int, ...]


def model_config_from_hf(path: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig an HF dir's config.json describes (`overrides` are our key names; a dict
    for a family's own table, e.g. `qwen3_next={"chunk_size": 16}`, overrides inside it)."""
    fields = model_fields_from_hf(read_hf_config(path, what=str(path)), what=str(path))
    merged = {**fields, **overrides}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(fields.get(key), dict):
            merged[key] = {**fields[key], **value}
    return ModelConfig(**merged)


def params_from_tensors(
    entries: list[Entry], tensors: dict[str, np.ndarray]
) -> dict[Path_, np.ndarray]:
    """Our parameters (flat: NNX path -> array) from an HF state dict, by the name map `entries`."""
    out: dict[Path_, np.ndarray] = {}
    stacks: dict[Path_, dict[tuple[int, ...], np.ndarray]] = {}
    for e in entries:
        if e.name not in tensors:
            raise ConfigError(f"HF checkpoint lacks tensor {e.name!r}")
        a = tensors[e.name]
        if e.hf_unit_axis is not None:
            a = np.squeeze(a, axis=e.hf_unit_axis)
        a = np.ascontiguousarray(a.T) if e.transpose else a
        if not e.index:
            out[e.path] = a
        else:
            stacks.setdefault(e.path, {})[e.index] = a
    for path, parts in stacks.items():
        out[path] = _stack(path, parts)
    return out


def _stack(path: Path_, parts: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """One array from the HF tensors at each index ([layer], [expert] or [layer, expert]) of a
    stacked parameter; every index of the grid must be there, with one shape."""
    shape = tuple(max(i[d] for i in parts) + 1 for d in range(len(next(iter(parts)))))
    tensors = list(parts.values())
    if len(parts) != int(np.prod(shape)) or len({a.shape for a in tensors}) != 1:
        raise ConfigError(
            f"HF tensors for {_fmt(path)} do not form a full {shape} stack of one shape"
        )
    out = np.empty(shape + tensors[0].shape, np.result_type(*{a.dtype for a in tensors}))
    for index, a in parts.items():
        out[index] = a
    return out


def tensors_from_params(entries: list[Entry], flat: dict[Path_, Any]) -> dict[str, np.ndarray]:
    """An HF state dict from our flat parameters (NNX path -> array-like), by the name map."""
    out: dict[str, np.ndarray] = {}
    for e in entries:
        a = np.asarray(flat[e.path])
        if e.index:
            a = a[e.index]
        a = a.T if e.transpose else a
        if e.hf_unit_axis is not None:
            a = np.expand_dims(a, e.hf_unit_axis)
        out[e.name] = np.ascontiguousarray(a)
    return out


def flat_params(params: Any) -> dict[Path_, Any]:
    """nnx.State (or a pure nested dict) of parameters -> {path: array}."""
    from flax import nnx, traverse_util

    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return traverse_util.flatten_dict(params)


def text_model_tensors(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """A multimodal checkpoint's text model (Gemma 4's, Qwen3.5's) under the text-only names
    (`model.language_model.X` -> `model.X`; `lm_head.*` as it is), and the names left out (the
    vision and audio towers and their embedders, a multi-token-prediction head)."""
    prefix = "model.language_model."
    out, left = {}, []
    for name, a in tensors.items():
        if name.startswith(prefix):
            out["model." + name[len(prefix) :]] = a
        elif name.startswith("lm_head."):
            out[name] = a
        else:
            left.append(name)
    return out, sorted(left)


def read_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """The HF dir's tensors. A multimodal checkpoint (tensors under `model.language_model.*`)
    gives its text model; one note on stderr says what was left out."""
    tensors = read_safetensors(path)
    if any(n.startswith("model.language_model.") for n in tensors):
        tensors, left = text_model_tensors(tensors)
        if left:
            # model.visual, model.audio_tower, ...; a top-level head (mtp) as one group.
            groups = sorted(
                {".".join(n.split(".")[: 2 if n.startswith("model.") else 1]) for n in left}
            )
            arch = (read_hf_config(path).get("architectures") or ["?"])[0]
            print(
                f"note: {path} is a multimodal {arch} checkpoint; imported its text model and "
                f"left out {len(left)} tensors of {', '.join(groups)} (vision tower and others: "
                "not imported)",
                file=sys.stderr,
            )
    return tensors


def place_params(flat: dict[Path_, np.ndarray], abstract_params: Any, shardings: Any) -> Any:
    """Device arrays laid out with `shardings`, in the structure of `abstract_params` (nnx.State).

    Each host builds only its own shards from the full host copy (multi-host safe). A shape that
    differs from the model's is a ConfigError; a dtype that differs is cast to the model's.
    """
    import jax
    from flax import nnx, traverse_util

    abs_flat = flat_params(abstract_params)
    sh_flat = flat_params(shardings)
    missing = sorted(set(abs_flat) - set(flat), key=str)
    if missing:
        raise ConfigError(f"HF weights lack parameter {_fmt(missing[0])}")
    placed = {}
    for path, ab in abs_flat.items():
        a = flat[path]
        if tuple(a.shape) != tuple(ab.shape):
            raise ConfigError(
                f"HF weight for {_fmt(path)} has shape {tuple(a.shape)}, the model needs "
                f"{tuple(ab.shape)}"
            )
        if a.dtype != ab.dtype:
            a = a.astype(ab.dtype)
        placed[path] = jax.make_array_from_callback(a.shape, sh_flat[path], lambda i, a=a: a[i])
    new = jax.tree.map(lambda x: x, abstract_params)  # a copy; the target stays abstract
    nnx.replace_by_pure_dict(new, traverse_util.unflatten_dict(placed))
    return new


def place_state(flat: dict[Path_, np.ndarray], state: Any, shardings: Any) -> Any:
    """The non-Param model state `state` (concrete, e.g. MoE router biases) with the arrays
    `flat` holds for its paths, laid out with `shardings`; paths `flat` lacks keep their value.
    A family's name map may give such state an HF tensor (deepseek_v3's router bias)."""
    import jax
    from flax import nnx, traverse_util

    own, sh_flat = flat_params(state), flat_params(shardings)
    placed = {}
    for path in own.keys() & flat.keys():
        a, ref = flat[path], own[path]
        if tuple(a.shape) != tuple(ref.shape):
            raise ConfigError(
                f"HF weight for {_fmt(path)} has shape {tuple(a.shape)}, the model needs "
                f"{tuple(ref.shape)}"
            )
        a = a.astype(ref.dtype)
        placed[path] = jax.make_array_from_callback(a.shape, sh_flat[path], lambda i, a=a: a[i])
    if not placed:
        return state
    new = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(new, traverse_util.unflatten_dict(placed))
    return new


def _fmt(path: Path_) -> str:
    return ".".join(str(p) for p in path)
