"""Hugging Face `config.json` <-> `[model]` fields, for `model.init_from = "hf:PATH"` and export.

No jax here: `jobspec/files/run_toml.py` fills a run config's missing model keys from a model dir with
`model_fields_from_hf`, and `runtime/model/hf_weights.py` writes `config.json` with
`hf_config_from_model`.
Each family's own translation is its class in `jobspec/families/<family>.py`; this module finds
the family (HF `model_type` on import, our `family` on export) and reads the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jobspec.errors import ConfigError
from jobspec.families import MODEL_CONFIGS
from jobspec.families.hf import PLAIN
from jobspec.families.model_config import DEFAULT_FAMILY, ModelConfig

#: Every [model] key an HF config can fill for any family (a family's `hf_keys` add more).
HF_KEYS: tuple[str, ...] = ("family", *PLAIN, "rope_theta", "param_dtype")
#: HF model_type -> the family class that reads its config.json.
HF_MODEL_TYPES: dict[str, type[ModelConfig]] = {
    name: cls for name, cls in MODEL_CONFIGS.items()
} | {alias: cls for cls in MODEL_CONFIGS.values() for alias in cls.hf_aliases}


def hf_dir(init_from: str, *, what: str = "model.init_from") -> Path:
    """The local directory named by 'hf:PATH'."""
    if not init_from.startswith("hf:"):
        raise ConfigError(f"{what}: {init_from!r} is not 'hf:PATH' (a local HF model dir)")
    return Path(init_from[3:]).expanduser()


def _own_tables(cls: type[ModelConfig]) -> dict[str, type[BaseModel]]:
    """The family's own tables (e.g. `gemma4`) and their classes."""
    return {
        key: field.annotation
        for key, field in cls.model_fields.items()
        if key not in ModelConfig.model_fields
        and isinstance(field.annotation, type)
        and issubclass(field.annotation, BaseModel)
    }


def fills_nothing(model: dict[str, Any]) -> bool:
    """True when the `[model]` table already holds every key an HF config could fill for its
    family (e.g. a resolved.json), so no lookup is needed; a family's `hf_keys` (e.g. the
    MoE sizes) and the whole of its own table count too, a table without `family` always needs
    the lookup."""
    family = model.get("family")
    cls = MODEL_CONFIGS.get(family) if isinstance(family, str) else None
    keys = HF_KEYS + (cls.hf_keys if cls else ())
    for key, table in (_own_tables(cls) if cls else {}).items():
        given = model.get(key)
        if not isinstance(given, dict) or not set(table.model_fields) <= set(given):
            return False
        keys += (key,)
    return all(k in model for k in keys)


def read_hf_config(path: str | Path, *, what: str = "model.init_from") -> dict[str, Any]:
    """config.json of a local HF model dir, or a one-sentence ConfigError naming `what`."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"{what}: {p} is not a directory (expected a local Hugging Face model dir)"
        )
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{what}: {p} has no config.json")
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what}: {cfg_path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {cfg_path} is not a JSON object")
    return data


def model_fields_from_hf(hf: dict[str, Any], *, what: str = "model.init_from") -> dict[str, Any]:
    """`[model]` keys (our names) that an HF config.json determines; ConfigError if unsupported."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(
            f"{what}: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(HF_MODEL_TYPES)})"
        )
    return HF_MODEL_TYPES[model_type].fields_from_hf(hf, what)


def hf_config_from_model(model: dict[str, Any]) -> dict[str, Any]:
    """An HF config.json dict for a resolved `[model]` section (our names, as in resolved.json)."""
    return MODEL_CONFIGS[model.get("family", DEFAULT_FAMILY)].hf_config(model)
