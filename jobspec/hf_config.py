"""Hugging Face `config.json` <-> `[model]` fields, for `model.init_from = "hf:PATH"` and export.

No jax here: `jobspec/load.py` fills a run config's missing model keys from a model dir with
`model_fields_from_hf`, and `runtime/hf/convert.py` writes `config.json` with `hf_config_from_model`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError

# Our key <- HF key, for keys whose values copy unchanged.
_PLAIN: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}
#: Every [model] key an HF config can fill for any family (a family's `HFFamily.keys` add more).
HF_KEYS: tuple[str, ...] = ("family", *_PLAIN, "rope_theta", "param_dtype")
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class HFFamily:
    """How one family's HF config.json differs from the shared Qwen3 keys, both directions."""

    architecture: str  # HF `architectures[0]`
    #: Further [model] keys an HF config fills (our names), beyond HF_KEYS.
    keys: tuple[str, ...] = ()
    #: Our key <- HF key candidates (first present wins), for further keys copied unchanged.
    plain: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Values our key takes on import when the HF config omits it (HF's default differs from ours).
    import_defaults: dict[str, Any] = field(default_factory=dict)
    #: (problem text, test on the HF config) for settings this family cannot load.
    unsupported: tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...] = ()
    #: The further config.json entries written on export, from a resolved [model] section.
    export: Callable[[dict[str, Any]], dict[str, Any]] = lambda model: {}


def _moe_export(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_experts": model["num_experts"],
        "num_experts_per_tok": model["num_experts_per_tok"],
        "moe_intermediate_size": model["moe_intermediate_size"],
        "norm_topk_prob": bool(model.get("norm_topk_prob", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


_MOE = HFFamily(
    architecture="Qwen3MoeForCausalLM",
    keys=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
    plain={
        "num_experts_per_tok": ("num_experts_per_tok",),
        "moe_intermediate_size": ("moe_intermediate_size",),
        "norm_topk_prob": ("norm_topk_prob",),
        "num_experts": ("num_experts", "num_local_experts"),
    },
    import_defaults={"norm_topk_prob": False},  # HF Qwen3MoeConfig's default; ours is true
    unsupported=(
        ("decoder_sparse_step != 1", lambda hf: hf.get("decoder_sparse_step", 1) != 1),
        ("non-empty mlp_only_layers", lambda hf: bool(hf.get("mlp_only_layers"))),
    ),
    export=_moe_export,
)

#: HF model_type (= our ModelConfig.family) -> how that family's config.json reads and writes.
#: The runtime's side of a family (module, name map, counts) is runtime/model/registry.py.
HF_FAMILIES: dict[str, HFFamily] = {
    "qwen3": HFFamily(architecture="Qwen3ForCausalLM"),
    "qwen3_moe": _MOE,
}
#: HF model_type -> our ModelConfig.family.
FAMILIES: dict[str, str] = {t: t for t in HF_FAMILIES}
ARCHITECTURES: dict[str, str] = {t: f.architecture for t, f in HF_FAMILIES.items()}
#: The further keys an HF config fills for the MoE family.
HF_MOE_KEYS: tuple[str, ...] = _MOE.keys


def hf_dir(init_from: str, *, what: str = "model.init_from") -> Path:
    """The local directory named by 'hf:PATH'."""
    if not init_from.startswith("hf:"):
        raise ConfigError(f"{what}: {init_from!r} is not 'hf:PATH' (a local HF model dir)")
    return Path(init_from[3:]).expanduser()


def fills_nothing(model: dict[str, Any]) -> bool:
    """True when the `[model]` table already holds every key an HF config could fill for its
    family (e.g. a resolved.json), so no lookup is needed; a family's `HFFamily.keys` (e.g. the
    MoE sizes) count too, a table without `family` always needs the lookup."""
    family = model.get("family")
    fam = HF_FAMILIES.get(family) if isinstance(family, str) else None
    keys = HF_KEYS + (fam.keys if fam else ())
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


def _rope_theta(hf: dict[str, Any]) -> float | None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"rope_type {kind!r} is not supported (only default RoPE)")
        if "rope_theta" in rope:
            return float(rope["rope_theta"])
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    return None


def model_fields_from_hf(hf: dict[str, Any], *, what: str = "model.init_from") -> dict[str, Any]:
    """`[model]` keys (our names) that an HF config.json determines; ConfigError if unsupported."""
    model_type = hf.get("model_type")
    if model_type not in HF_FAMILIES:
        raise ConfigError(
            f"{what}: model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias = true")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window = true")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf.get('hidden_act')!r}")
    fam = HF_FAMILIES[model_type]
    problems += [text for text, bad in fam.unsupported if bad(hf)]
    try:
        theta = _rope_theta(hf)
    except ValueError as e:
        problems.append(str(e))
        theta = None
    if problems:
        raise ConfigError(
            f"{what}: the HF config has {', '.join(problems)}, which jaxjob cannot load"
        )

    out: dict[str, Any] = {"family": FAMILIES[model_type]}
    for ours, theirs in _PLAIN.items():
        if hf.get(theirs) is not None:
            out[ours] = hf[theirs]
    for ours, candidates in fam.plain.items():
        value = next((hf[c] for c in candidates if c in hf), None)
        if value is not None:
            out[ours] = value
    for ours, default in fam.import_defaults.items():
        out.setdefault(ours, default)
    if theta is not None:
        out["rope_theta"] = theta
    # HF Qwen3Config defaults tie_word_embeddings to false; ours defaults to true.
    out.setdefault("tie_word_embeddings", False)
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in _HF_DTYPES:
        out["param_dtype"] = _HF_DTYPES[dtype]
    return out


def hf_config_from_model(model: dict[str, Any]) -> dict[str, Any]:
    """An HF config.json dict for a resolved `[model]` section (our names, as in resolved.json)."""
    family = model.get("family", "qwen3")
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_heads"]
    out: dict[str, Any] = {
        "architectures": [HF_FAMILIES[family].architecture],
        "model_type": family,
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model["max_position_embeddings"],
        "initializer_range": model.get("init_std", 0.02),
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": bool(model["tie_word_embeddings"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model["rope_theta"])},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "use_cache": True,
        "dtype": model.get("param_dtype", "float32"),
    }
    out.update(HF_FAMILIES[family].export(model))
    return out
