"""A model config's parameters <-> Hugging Face tensors and files, through its family's name map
(`spec_for(cfg).hf_names`; the conversion itself is runtime/hf/convert.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jobspec.errors import ConfigError
from jobspec.families.model_config import ModelConfig
from jobspec.hf_config import hf_config_from_model
from runtime.hf.convert import (
    Path_,
    flat_params,
    params_from_tensors,
    read_hf_tensors,
    tensors_from_params,
)
from runtime.hf.files import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from runtime.hf.mxfp4 import dequantize_checkpoint
from runtime.model.registry import spec_for


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[Path_, np.ndarray]:
    """Our parameters (flat: NNX path -> array) from an HF state dict; a tensor the family's map
    neither maps nor ignores is a ConfigError. MXFP4 tensors (`X_blocks` + `X_scales`, gpt-oss's
    experts on the Hub) are dequantized to the config's param_dtype first (runtime/hf/mxfp4.py),
    then the family's `hf_read` gives the names its map uses (e.g. fused expert stacks split)."""
    spec = spec_for(cfg)
    tensors = spec.hf_read(dequantize_checkpoint(tensors, cfg.param_dtype))
    table = spec.hf_names(cfg)
    known = {e.name for e in table} | spec.hf_ignored(cfg)
    if cfg.tie_word_embeddings:
        known.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    extra = sorted(n for n in set(tensors) - known if not n.startswith(spec.hf_ignored_prefixes))
    if extra:
        raise ConfigError(
            f"HF checkpoint has tensors jaxjob does not map, e.g. {extra[0]!r} ({len(extra)} in all)"
        )
    return params_from_tensors(table, tensors)


def hf_from_params(cfg: ModelConfig, flat: dict[Path_, Any]) -> dict[str, np.ndarray]:
    """An HF state dict from our flat parameters (NNX path -> array-like), in the layout the
    family writes (`ModelSpec.hf_write`)."""
    spec = spec_for(cfg)
    return spec.hf_write(tensors_from_params(spec.hf_names(cfg), flat))


def load_hf_params(path: str | Path, cfg: ModelConfig) -> dict[Path_, np.ndarray]:
    """Flat parameters for `cfg` from the HF dir at `path` (a multimodal checkpoint, Gemma 4's or
    Qwen3.5's, gives its text model)."""
    return params_from_hf(cfg, read_hf_tensors(path))


def _host(x: Any) -> np.ndarray:
    import jax

    return np.asarray(jax.device_get(x))


def write_hf(
    cfg: ModelConfig,
    params: Any,
    out_dir: str | Path,
    *,
    others: tuple = (),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """config.json + safetensors for `params` (nnx.State or pure nested dict); the file names.
    `others`: the model's non-Param states, for a name map that gives some an HF tensor
    (deepseek_v3's router bias)."""
    flat = {k: v for state in (*others, params) for k, v in flat_params(state).items()}
    tensors = hf_from_params(cfg, {k: _host(v) for k, v in flat.items()})
    hf_cfg = hf_config_from_model(cfg.model_dump())
    return write_safetensors(tensors, hf_cfg, out_dir, max_shard_bytes=max_shard_bytes)
