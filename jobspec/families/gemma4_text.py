"""The "gemma4_text" family's contract: Gemma 4's text decoder, its `[model.gemma4]` table and
checks, and its HF config.json (`Gemma4ForCausalLM`; the multimodal `gemma4` imports its text
model)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from jobspec.errors import ConfigError
from jobspec.families.hf import cannot_load, copy_dtype, copy_plain, shared_hf_config
from jobspec.families.model_config import ModelConfig
from jobspec.section import NonNegativeInt, PositiveFloat, PositiveInt, Section


def gemma4_default_layer_types(num_layers: int) -> list[str]:
    """HF Gemma4TextConfig's default pattern: 5 sliding layers then 1 full, the last forced full."""
    types = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    types[-1] = "full_attention"
    return types


class Gemma4Config(Section):
    """The `gemma4_text` family's own settings (HF `Gemma4TextConfig`). The shared `[model]` keys
    describe its sliding-attention layers: `head_dim`, `num_kv_heads`; `intermediate_size` is the
    dense MLP width of every layer; `rope_theta` is not used (see the two thetas here)."""

    # A tuple, so the config (a static attribute of the model's graph) stays hashable.
    layer_types: tuple[Literal["sliding_attention", "full_attention"], ...] | None = Field(
        None,
        description=(
            "Attention type per layer; default 5 sliding : 1 full. A last layer that is not "
            "full_attention is made full, as transformers does."
        ),
    )
    sliding_window: PositiveInt = Field(
        512, description="Keys a sliding-attention token sees: itself and the window-1 before it."
    )
    global_head_dim: PositiveInt = Field(512, description="Head dim of the full-attention layers.")
    num_global_kv_heads: PositiveInt | None = Field(
        None, description="KV heads of the full-attention layers; default num_kv_heads."
    )
    sliding_rope_theta: PositiveFloat = Field(
        10_000.0, description="RoPE base of the sliding layers (full rotary)."
    )
    global_rope_theta: PositiveFloat = Field(
        1_000_000.0, description="RoPE base of the full layers (proportional partial RoPE)."
    )
    global_partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] = Field(
        0.25, description="Fraction of the full layers' head dim that is rotated."
    )
    attention_k_eq_v: bool = Field(
        False, description="Full layers use the key projection as values too (no v_proj there)."
    )
    num_kv_shared_layers: NonNegativeInt = Field(
        0,
        description=(
            "The last N layers have no K/V weights and reuse the keys/values of the last earlier "
            "layer of their own attention type."
        ),
    )
    hidden_size_per_layer_input: NonNegativeInt = Field(
        0, description="Per-layer input embedding width (0 = no per-layer inputs)."
    )
    vocab_size_per_layer_input: PositiveInt | None = Field(
        None, description="Rows of the per-layer embedding table; default vocab_size."
    )
    enable_moe_block: bool = Field(
        False, description="Every layer adds a routed MoE beside its dense MLP."
    )
    num_experts: PositiveInt | None = Field(None, description="MoE experts per layer.")
    top_k_experts: PositiveInt | None = Field(None, description="Experts each token uses.")
    moe_intermediate_size: PositiveInt | None = Field(None, description="Width of each expert.")
    use_double_wide_mlp: bool = Field(
        False, description="The KV-shared layers' dense MLP is twice intermediate_size wide."
    )
    final_logit_softcapping: PositiveFloat | None = Field(
        None, description="Logits become c * tanh(logits / c) (none = no capping)."
    )

    def resolved_layer_types(self, num_layers: int) -> list[str]:
        """layer_types, or the default pattern, with the last layer full (as transformers)."""
        if self.layer_types is None:
            return gemma4_default_layer_types(num_layers)
        types = list(self.layer_types)
        if types:
            types[-1] = "full_attention"
        return types


def gemma4_kv_sources(layer_types: list[str], num_kv_shared_layers: int) -> list[int]:
    """For each layer, the layer whose keys/values it attends to (itself when it owns K/V): a
    shared layer reads the last non-shared layer of its own type, -1 when there is none."""
    n = len(layer_types)
    first_shared = n - num_kv_shared_layers
    out = []
    for i, kind in enumerate(layer_types):
        if i < first_shared:
            out.append(i)
        else:
            owners = [j for j in range(first_shared) if layer_types[j] == kind]
            out.append(owners[-1] if owners else -1)
    return out


class Gemma4TextModelConfig(ModelConfig):
    family: Literal["gemma4_text"] = Field(description="Architecture family.")
    gemma4: Gemma4Config = Field(
        default_factory=Gemma4Config,
        description="gemma4_text: the family's own settings ([model.gemma4]).",
    )

    hf_aliases: ClassVar[tuple[str, ...]] = ("gemma4",)

    # The layers differ from each other (head dim, K/V ownership, MLP width), so they cannot stack.
    scanned_by_default: ClassVar[bool] = False

    @property
    def routed_experts(self) -> int | None:
        g = self.gemma4
        return g.num_experts if g.enable_moe_block else None

    def family_problem(self) -> str | None:
        g, n = self.gemma4, self.num_layers
        if g.layer_types is not None and len(g.layer_types) != n:
            return (
                f"model.gemma4.layer_types has {len(g.layer_types)} entries but model.num_layers is "
                f"{n}; give one type per layer"
            )
        types = g.resolved_layer_types(n)
        if g.num_kv_shared_layers >= n:
            return (
                f"model.gemma4.num_kv_shared_layers = {g.num_kv_shared_layers} leaves no layer that "
                f"computes keys/values (model.num_layers = {n}); lower it"
            )
        for i, src in enumerate(gemma4_kv_sources(types, g.num_kv_shared_layers)):
            if src < 0:
                return (
                    f"model.gemma4.num_kv_shared_layers = {g.num_kv_shared_layers} makes layer {i} "
                    f"({types[i]}) reuse keys/values, but no earlier non-shared layer is {types[i]}; "
                    "lower it or change model.gemma4.layer_types"
                )
        kv_global = g.num_global_kv_heads or self.num_kv_heads
        if self.num_heads % kv_global:
            return (
                f"model.gemma4.num_global_kv_heads ({kv_global}) must divide model.num_heads "
                f"({self.num_heads})"
            )
        moe = {"num_experts": g.num_experts, "top_k_experts": g.top_k_experts,
               "moe_intermediate_size": g.moe_intermediate_size}  # fmt: skip
        if g.enable_moe_block:
            missing = [k for k, v in moe.items() if v is None]
            if missing:
                return f"model.gemma4.enable_moe_block needs model.gemma4.{', model.gemma4.'.join(missing)}"
            assert g.top_k_experts is not None and g.num_experts is not None
            if g.top_k_experts > g.num_experts:
                return (
                    f"model.gemma4.top_k_experts ({g.top_k_experts}) exceeds model.gemma4.num_experts "
                    f"({g.num_experts})"
                )
        elif any(v is not None for v in moe.values()):
            return "model.gemma4.num_experts/top_k_experts/moe_intermediate_size need model.gemma4.enable_moe_block = true"
        if 2 * int(g.global_partial_rotary_factor * g.global_head_dim // 2) == 0:
            return (
                f"model.gemma4.global_partial_rotary_factor = {g.global_partial_rotary_factor} rotates "
                f"no dimension of model.gemma4.global_head_dim = {g.global_head_dim}; raise it"
            )
        if self.scan_layers:
            return (
                "model.scan_layers = true is not available for gemma4_text (its layers differ in "
                "head dim, K/V ownership and MLP width); set it to false"
            )
        if self.router_bias_update_rate:
            return "model.router_bias_update_rate is a qwen3_moe setting; gemma4_text's router has no selection bias"
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        hf = _text_config(hf, what)
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
        rope = {**_HF_ROPE_DEFAULTS, **(hf.get("rope_parameters") or {})}
        sliding, full = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            problems.append(f"sliding rope_type {sliding.get('rope_type')!r}")
        if full.get("rope_type", "proportional") not in ("proportional", "default"):
            problems.append(f"full_attention rope_type {full.get('rope_type')!r}")
        if any(r.get("factor", 1.0) != 1.0 for r in (sliding, full)):
            problems.append("a rope 'factor' other than 1")
        global_head_dim, global_kv = _layer_heads(hf, list(types), problems)
        if problems:
            cannot_load(what, problems)
        h = {**_HF_DEFAULTS, **hf}
        partial = (
            1.0 if full.get("rope_type") == "default" else full.get("partial_rotary_factor", 1.0)
        )
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
        copy_plain(hf, out)
        out.setdefault("tie_word_embeddings", True)  # Gemma4TextConfig's default
        out.setdefault("head_dim", 256)
        copy_dtype(hf, out)
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        g = Gemma4Config(**(model.get("gemma4") or {}))
        n = model["num_layers"]
        types = g.resolved_layer_types(n)
        full_heads: dict[str, Any] = {"head_dim": g.global_head_dim}
        full_heads["num_key_value_heads"] = g.num_global_kv_heads or model["num_kv_heads"]
        return shared_hf_config(
            model,
            architecture="Gemma4ForCausalLM",
            model_type="gemma4_text",
            activation=("hidden_activation", "gelu_pytorch_tanh"),
            own={
                "sliding_window": g.sliding_window,
                "layer_types": types,
                "rope_parameters": {
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": g.sliding_rope_theta,
                    },
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
            },
        )


# ---- HF config.json ---------------------------------------------------------------------------

#: HF Gemma4TextConfig's defaults for the keys our [model.gemma4] reads (a config.json written by
#: transformers holds them all; other tools' may not).
_HF_DEFAULTS: dict[str, Any] = {
    "sliding_window": 512,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "final_logit_softcapping": None,
}
_HF_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    },
}


def _text_config(hf: dict[str, Any], what: str) -> dict[str, Any]:
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


def _layer_heads(
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
