"""What every family's HF `config.json` translation shares: the keys that copy unchanged, the
parameter dtype, the RoPE base, the routed-experts keys and the one sentence for what cannot
load."""

from __future__ import annotations

from typing import Any, NoReturn

from jobspec.errors import ConfigError

#: Our key <- HF key, for keys whose values copy unchanged.
PLAIN: dict[str, str] = {
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
#: The shared routed-experts keys an HF config fills for the families that take them.
HF_MOE_KEYS: tuple[str, ...] = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
)
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def copy_plain(hf: dict[str, Any], out: dict[str, Any]) -> None:
    """The PLAIN keys the HF config sets, into `out` under our names."""
    for ours, theirs in PLAIN.items():
        if hf.get(theirs) is not None:
            out[ours] = hf[theirs]


def copy_dtype(hf: dict[str, Any], out: dict[str, Any]) -> None:
    """The stored dtype (`dtype`, or the older `torch_dtype`) as our param_dtype, if we have it."""
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in _HF_DTYPES:
        out["param_dtype"] = _HF_DTYPES[dtype]


def rope_theta(hf: dict[str, Any]) -> float | None:
    """The RoPE base of a default-RoPE config; ValueError naming any other rope type."""
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


def cannot_load(what: str, problems: list[str]) -> NoReturn:
    raise ConfigError(f"{what}: the HF config has {', '.join(problems)}, which jaxjob cannot load")
