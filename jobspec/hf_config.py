"""Hugging Face `config.json` <-> `[model]` fields, for `model.init_from = "hf:PATH"` and export.

No jax here: `jobspec/load.py` fills a run config's missing model keys from a model dir with
`model_fields_from_hf`, and `runtime/hf/io.py` writes `config.json` with `hf_config_from_model`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError

#: HF model_type -> our ModelConfig.family.
FAMILIES: dict[str, str] = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
ARCHITECTURES: dict[str, str] = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

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
_MOE_PLAIN: dict[str, str] = {
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
}
#: Every [model] key an HF config can fill for any family (for qwen3_moe add HF_MOE_KEYS).
HF_KEYS: tuple[str, ...] = ("family", *_PLAIN, "rope_theta", "param_dtype")
#: The further keys an HF config fills for family "qwen3_moe".
HF_MOE_KEYS: tuple[str, ...] = ("num_experts", *_MOE_PLAIN)
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def hf_dir(init_from: str, *, what: str = "model.init_from") -> Path:
    """The local directory named by 'hf:PATH'."""
    if not init_from.startswith("hf:"):
        raise ConfigError(f"{what}: {init_from!r} is not 'hf:PATH' (a local HF model dir)")
    return Path(init_from[3:]).expanduser()


def fills_nothing(model: dict[str, Any]) -> bool:
    """True when the `[model]` table already holds every key an HF config could fill for its
    family (e.g. a resolved.json), so no lookup is needed; a qwen3_moe table also needs the MoE
    keys, a table without `family` always needs the lookup."""
    keys = HF_KEYS + (HF_MOE_KEYS if model.get("family") == "qwen3_moe" else ())
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
    if model_type not in FAMILIES:
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
    if model_type == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1:
            problems.append("decoder_sparse_step != 1")
        if hf.get("mlp_only_layers"):
            problems.append("non-empty mlp_only_layers")
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
    table = {**_PLAIN, **(_MOE_PLAIN if model_type == "qwen3_moe" else {})}
    for ours, theirs in table.items():
        if hf.get(theirs) is not None:
            out[ours] = hf[theirs]
    if model_type == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is not None:
            out["num_experts"] = experts
        out.setdefault("norm_topk_prob", False)  # HF Qwen3MoeConfig's default; ours is true
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
        "architectures": [ARCHITECTURES[family]],
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
    if family == "qwen3_moe":
        out.update(
            num_experts=model["num_experts"],
            num_experts_per_tok=model["num_experts_per_tok"],
            moe_intermediate_size=model["moe_intermediate_size"],
            norm_topk_prob=bool(model.get("norm_topk_prob", True)),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out
