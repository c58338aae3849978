"""What every family's HF `config.json` translation shares: the keys that copy unchanged, the
parameter dtype, the RoPE base, the Qwen decoders' unsupported settings, the routed-experts keys,
the one sentence for what cannot load, and the keys every export writes alike."""

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


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The config's RoPE table (`rope_parameters`, or the older `rope_scaling`); {} if none."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    return rope if isinstance(rope, dict) else {}


def rope_theta(hf: dict[str, Any], problems: list[str], *, terse: bool = False) -> float | None:
    """The RoPE base of a default-RoPE config, or None: where it gives none, or with why not
    added to `problems` (another rope type, a base that is not a number). `terse`: qwen3_next's
    wording of the rope type, which its users see."""
    rope = rope_parameters(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        why = "(only default RoPE)" if terse else "is not supported (only default RoPE)"
        problems.append(f"rope_type {kind!r} {why}")
        return None
    if "rope_theta" in rope:
        theta = rope["rope_theta"]
    elif "rope_theta" in hf:
        theta = hf["rope_theta"]
    else:
        return None
    try:
        return float(theta)
    except ValueError as e:  # a string that is not a number: one more thing it cannot load
        problems.append(str(e))
        return None


def qwen_problems(hf: dict[str, Any], *, sliding_window: bool = True) -> list[str]:
    """Settings of a Qwen decoder's HF config that jaxjob cannot load. `sliding_window`: check
    `use_sliding_window` too (HF Qwen3Config has it; Qwen3NextConfig does not, and never read it)."""
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias = true")
    if sliding_window and hf.get("use_sliding_window"):
        problems.append("use_sliding_window = true")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf.get('hidden_act')!r}")
    return problems


def cannot_load(what: str, problems: list[str]) -> NoReturn:
    raise ConfigError(f"{what}: the HF config has {', '.join(problems)}, which jaxjob cannot load")


def shared_hf_config(
    model: dict[str, Any],
    *,
    architecture: str,
    model_type: str,
    activation: tuple[str, str] = ("hidden_act", "silu"),
    rope: dict[str, Any] | None = None,
    own: dict[str, Any],
) -> dict[str, Any]:
    """A config.json for a resolved `[model]` section (our names): the keys every family writes
    alike, the `activation` key and value, `rope_parameters` (a family with one RoPE table; a
    family with another layout puts it among its `own` keys), then the family's `own` keys. The
    keys keep the order the families always wrote them in."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model.get("head_dim") or model["hidden_size"] // model["num_heads"],
        activation[0]: activation[1],
        "max_position_embeddings": model["max_position_embeddings"],
        "initializer_range": model.get("init_std", 0.02),
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": bool(model["tie_word_embeddings"]),
        **({"rope_parameters": rope} if rope is not None else {}),
        "attention_bias": False,
        "attention_dropout": 0.0,
        **own,
        "use_cache": True,
        "dtype": model.get("param_dtype", "float32"),
    }
