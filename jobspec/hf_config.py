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

# ---- Gemma 4 -----------------------------------------------------------------------------------

#: HF Gemma4TextConfig's defaults for the keys our [model.gemma4] reads (a config.json written by
#: transformers holds them all; other tools' may not).
_GEMMA4_HF_DEFAULTS: dict[str, Any] = {
    "sliding_window": 512,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "final_logit_softcapping": None,
}
_GEMMA4_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    },
}


def _gemma4_text_config(hf: dict[str, Any], what: str) -> dict[str, Any]:
    """The text config of a `gemma4_text` or multimodal `gemma4` config.json."""
    if hf.get("model_type") != "gemma4":
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{what}: a model_type 'gemma4' config.json needs a text_config object")
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    text = {**text, "model_type": "gemma4_text"}
    if dtype is not None:
        text.setdefault("dtype", dtype)
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return text


def _gemma4_layer_heads(
    hf: dict[str, Any], types: list[str], problems: list[str]
) -> tuple[int, int | None]:
    """(global head dim, global kv heads or None) from `per_layer_config` (transformers' form)
    or `global_head_dim` / `num_global_key_value_heads` (other tools')."""
    head_dim = hf.get("head_dim", 256)
    plc = hf.get("per_layer_config")
    if plc is None:
        kv = hf.get("num_global_key_value_heads")
        # As transformers: the global kv-head count applies only with attention_k_eq_v.
        kv = kv if hf.get("attention_k_eq_v", True) else None
        return hf.get("global_head_dim", 512), kv
    if not isinstance(plc, dict):
        problems.append("a per_layer_config that is not an object")
        return head_dim, None
    seen: set[tuple[int, int | None]] = set()
    for i, kind in enumerate(types):
        over = plc.get(str(i), plc.get(i, {})) or {}
        extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if extra:
            problems.append(f"per_layer_config[{i}] overriding {extra[0]!r}")
        if kind == "sliding_attention":
            if over:
                problems.append(f"per_layer_config overrides on sliding layer {i}")
            continue
        seen.add((over.get("head_dim", head_dim), over.get("num_key_value_heads")))
    if len(seen) > 1:
        problems.append("full-attention layers with different per_layer_config head shapes")
    return next(iter(seen)) if seen else (head_dim, None)


def _gemma4_fields(hf: dict[str, Any], what: str) -> dict[str, Any]:
    hf = _gemma4_text_config(hf, what)
    from jobspec.run_config import gemma4_default_layer_types

    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias = true")
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation = {act!r}")
    if hf.get("use_bidirectional_attention") is not None:
        problems.append(f"use_bidirectional_attention = {hf['use_bidirectional_attention']!r}")
    n = hf.get("num_hidden_layers", 30)
    types = hf.get("layer_types") or gemma4_default_layer_types(n)
    if isinstance(types, list) and types:
        types = [*types[:-1], "full_attention"]
    rope = {**_GEMMA4_ROPE_DEFAULTS, **(hf.get("rope_parameters") or {})}
    sliding, full = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
    if sliding.get("rope_type", "default") != "default":
        problems.append(f"sliding rope_type {sliding.get('rope_type')!r}")
    if full.get("rope_type", "proportional") not in ("proportional", "default"):
        problems.append(f"full_attention rope_type {full.get('rope_type')!r}")
    if any(r.get("factor", 1.0) != 1.0 for r in (sliding, full)):
        problems.append("a rope 'factor' other than 1")
    global_head_dim, global_kv = _gemma4_layer_heads(hf, list(types), problems)
    if problems:
        raise ConfigError(
            f"{what}: the HF config has {', '.join(problems)}, which jaxjob cannot load"
        )
    h = {**_GEMMA4_HF_DEFAULTS, **hf}
    partial = 1.0 if full.get("rope_type") == "default" else full.get("partial_rotary_factor", 1.0)
    g: dict[str, Any] = {
        "layer_types": list(types),
        "sliding_window": h["sliding_window"],
        "global_head_dim": global_head_dim,
        "num_global_kv_heads": global_kv,
        "sliding_rope_theta": float(sliding.get("rope_theta", 10_000.0)),
        "global_rope_theta": float(full.get("rope_theta", 1e6)),
        "global_partial_rotary_factor": float(partial),
        "attention_k_eq_v": bool(h["attention_k_eq_v"]),
        "num_kv_shared_layers": h["num_kv_shared_layers"],
        "hidden_size_per_layer_input": h["hidden_size_per_layer_input"] or 0,
        "vocab_size_per_layer_input": h["vocab_size_per_layer_input"],
        "enable_moe_block": bool(h["enable_moe_block"]),
        "use_double_wide_mlp": bool(h["use_double_wide_mlp"]),
        "final_logit_softcapping": h["final_logit_softcapping"],
    }
    if g["enable_moe_block"]:
        g |= {k: hf.get(k) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    out: dict[str, Any] = {"family": "gemma4_text", "gemma4": g, "scan_layers": False}
    for ours, theirs in _PLAIN.items():
        if hf.get(theirs) is not None:
            out[ours] = hf[theirs]
    out.setdefault("tie_word_embeddings", True)  # Gemma4TextConfig's default
    out.setdefault("head_dim", 256)
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in _HF_DTYPES:
        out["param_dtype"] = _HF_DTYPES[dtype]
    return out


def _gemma4_config(model: dict[str, Any]) -> dict[str, Any]:
    """config.json of `Gemma4ForCausalLM` for a resolved gemma4_text [model] section."""
    from jobspec.run_config import Gemma4Config

    g = Gemma4Config(**(model.get("gemma4") or {}))
    n = model["num_layers"]
    types = g.resolved_layer_types(n)
    full_heads: dict[str, Any] = {"head_dim": g.global_head_dim}
    full_heads["num_key_value_heads"] = g.num_global_kv_heads or model["num_kv_heads"]
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model.get("head_dim") or model["hidden_size"] // model["num_heads"],
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": model["max_position_embeddings"],
        "initializer_range": model.get("init_std", 0.02),
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": bool(model["tie_word_embeddings"]),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": g.sliding_window,
        "layer_types": types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": g.sliding_rope_theta},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": g.global_partial_rotary_factor,
                "rope_theta": g.global_rope_theta,
            },
        },
        "per_layer_config": {
            str(i): dict(full_heads) for i, t in enumerate(types) if t == "full_attention"
        },
        "final_logit_softcapping": g.final_logit_softcapping,
        "hidden_size_per_layer_input": g.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": g.vocab_size_per_layer_input or model["vocab_size"],
        "attention_k_eq_v": g.attention_k_eq_v,
        "num_kv_shared_layers": g.num_kv_shared_layers,
        "enable_moe_block": g.enable_moe_block,
        "use_double_wide_mlp": g.use_double_wide_mlp,
        "num_experts": g.num_experts,
        "top_k_experts": g.top_k_experts,
        "moe_intermediate_size": g.moe_intermediate_size,
        "use_cache": True,
        "dtype": model.get("param_dtype", "float32"),
    }


# ---- Qwen3-Next -------------------------------------------------------------------------------

#: HF Qwen3NextConfig's defaults for the keys our [model.qwen3_next] reads.
_QWEN3_NEXT_HF_DEFAULTS: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
}
_QWEN3_NEXT_MOE_DEFAULTS = {"num_experts": 512, "num_experts_per_tok": 10,
                            "moe_intermediate_size": 512, "norm_topk_prob": True}  # fmt: skip


def _qwen3_next_fields(hf: dict[str, Any], what: str) -> dict[str, Any]:
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias = true")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf.get('hidden_act')!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        problems.append(f"rope_type {kind!r} (only default RoPE)")
    if problems:
        raise ConfigError(
            f"{what}: the HF config has {', '.join(problems)}, which jaxjob cannot load"
        )
    h = {**_QWEN3_NEXT_HF_DEFAULTS, **_QWEN3_NEXT_MOE_DEFAULTS, **hf}
    n = h.get("num_hidden_layers", 48)
    types = hf.get("layer_types")
    if not types:
        interval = hf.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    q: dict[str, Any] = {k: h[k] for k in _QWEN3_NEXT_HF_DEFAULTS}
    q["layer_types"] = list(types)
    q["mlp_only_layers"] = list(h.get("mlp_only_layers") or [])
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    q["partial_rotary_factor"] = float(factor)
    out: dict[str, Any] = {"family": "qwen3_next", "qwen3_next": q, "scan_layers": False}
    for ours, theirs in _PLAIN.items():
        if hf.get(theirs) is not None:
            out[ours] = hf[theirs]
    out.setdefault("tie_word_embeddings", False)  # Qwen3NextConfig's default
    out.setdefault("head_dim", 256)
    out["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    if h["num_experts"]:  # 0: every layer dense, as in transformers
        out |= {k: h[k] for k in _QWEN3_NEXT_MOE_DEFAULTS}
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in _HF_DTYPES:
        out["param_dtype"] = _HF_DTYPES[dtype]
    return out


def _qwen3_next_config(model: dict[str, Any]) -> dict[str, Any]:
    """config.json of `Qwen3NextForCausalLM` for a resolved qwen3_next [model] section."""
    from jobspec.run_config import Qwen3NextConfig

    q = Qwen3NextConfig(**(model.get("qwen3_next") or {}))
    n = model["num_layers"]
    moe = model.get("num_experts") is not None
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model.get("head_dim") or model["hidden_size"] // model["num_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": model["max_position_embeddings"],
        "initializer_range": model.get("init_std", 0.02),
        "rms_norm_eps": model["rms_norm_eps"],
        "tie_word_embeddings": bool(model["tie_word_embeddings"]),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(model["rope_theta"]),
            "partial_rotary_factor": q.partial_rotary_factor,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": q.resolved_layer_types(n),
        "linear_conv_kernel_dim": q.linear_conv_kernel_dim,
        "linear_key_head_dim": q.linear_key_head_dim,
        "linear_value_head_dim": q.linear_value_head_dim,
        "linear_num_key_heads": q.linear_num_key_heads,
        "linear_num_value_heads": q.linear_num_value_heads,
        "decoder_sparse_step": q.decoder_sparse_step,
        "mlp_only_layers": list(q.mlp_only_layers),
        "num_experts": model["num_experts"] if moe else 0,
        "num_experts_per_tok": model["num_experts_per_tok"] if moe else 1,
        "moe_intermediate_size": model["moe_intermediate_size"] if moe else 1,
        "shared_expert_intermediate_size": q.shared_expert_intermediate_size,
        "norm_topk_prob": bool(model.get("norm_topk_prob", True)),
        "use_cache": True,
        "dtype": model.get("param_dtype", "float32"),
    }


#: HF model_type (= our ModelConfig.family) -> how that family's config.json reads and writes.
#: The runtime's side of a family (module, name map, counts) is runtime/model/registry.py.
HF_FAMILIES: dict[str, HFFamily] = {
    "qwen3": HFFamily(architecture="Qwen3ForCausalLM"),
    "qwen3_moe": _MOE,
    "gemma4_text": HFFamily(architecture="Gemma4ForCausalLM", keys=("gemma4",)),
    "qwen3_next": HFFamily(architecture="Qwen3NextForCausalLM", keys=("qwen3_next",)),
}
#: HF model_type -> our ModelConfig.family (the multimodal `gemma4` imports its text model).
FAMILIES: dict[str, str] = {t: t for t in HF_FAMILIES} | {"gemma4": "gemma4_text"}
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
    if family == "gemma4_text":
        from jobspec.run_config import Gemma4Config

        g = model.get("gemma4")
        if not isinstance(g, dict) or not set(Gemma4Config.model_fields) <= set(g):
            return False
    if family == "qwen3_next":
        from jobspec.run_config import Qwen3NextConfig

        q = model.get("qwen3_next")
        if not isinstance(q, dict) or not set(Qwen3NextConfig.model_fields) <= set(q):
            return False
        keys += HF_MOE_KEYS  # present (as null for a dense model) in a resolved table
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
    if FAMILIES[model_type] == "gemma4_text":
        return _gemma4_fields(hf, what)
    if FAMILIES[model_type] == "qwen3_next":
        return _qwen3_next_fields(hf, what)
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
    if family == "gemma4_text":
        return _gemma4_config(model)
    if family == "qwen3_next":
        return _qwen3_next_config(model)
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
