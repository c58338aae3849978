"""The "qwen3_5_text" and "qwen3_5_moe_text" families' contract: Qwen3.5's hybrid decoder, dense
(`[model.qwen3_5]`, HF `Qwen3_5ForCausalLM`) and MoE (`[model.qwen3_5_moe]`,
`Qwen3_5MoeForCausalLM`), their checks and their HF config.json both ways (the released
multimodal `qwen3_5` / `qwen3_5_moe` configs read through their `text_config`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from jobspec.errors import ConfigError
from jobspec.families.hf import (
    HF_MOE_KEYS,
    cannot_load,
    copy_dtype,
    copy_plain,
    qwen_problems,
    rope_parameters,
    rope_theta,
    shared_hf_config,
)
from jobspec.families.model_config import EXPERT_KEYS, ModelConfig
from jobspec.families.qwen3_next import HybridMixerConfig, mixer_problem
from jobspec.section import PositiveInt


class Qwen3_5Config(HybridMixerConfig):
    """The `qwen3_5_text` family's own settings (HF `Qwen3_5TextConfig`). The shared `[model]`
    keys describe its gated full-attention layers (`num_heads`, `num_kv_heads`, `head_dim`,
    `rope_theta`) and the SwiGLU MLP every layer has (`intermediate_size`)."""

    mrope_section: tuple[PositiveInt, PositiveInt, PositiveInt] | None = Field(
        None,
        description=(
            "HF's M-RoPE split of the rotated frequencies over (time, height, width), kept for "
            "the exported config.json; text positions are equal on all three, so it is plain RoPE."
        ),
    )
    mrope_interleaved: bool | None = Field(
        None, description="HF's mrope_interleaved, kept for the exported config.json."
    )


class Qwen3_5MoeConfig(Qwen3_5Config):
    """The `qwen3_5_moe_text` family's own settings (HF `Qwen3_5MoeTextConfig`): the dense ones
    plus the shared expert. Every layer is an MoE layer: the routed experts are the shared
    `[model]` keys (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `router_bias_update_rate`)."""

    shared_expert_intermediate_size: PositiveInt = Field(
        512, description="Width of the SwiGLU shared expert beside the routed experts."
    )


def _mixer_problem(cfg: ModelConfig, q: Qwen3_5Config, table: str) -> str | None:
    """What both families check of their layers and heads (`table`: model.<their table>)."""
    return mixer_problem(cfg, q, table)


class Qwen3_5TextModelConfig(ModelConfig):
    family: Literal["qwen3_5_text"] = Field(description="Architecture family.")
    qwen3_5: Qwen3_5Config = Field(
        default_factory=Qwen3_5Config,
        description="qwen3_5_text: the family's own settings ([model.qwen3_5]).",
    )

    hf_aliases: ClassVar[tuple[str, ...]] = ("qwen3_5",)
    # The layers differ in token mixer, so they cannot stack.
    scanned_by_default: ClassVar[bool] = False

    def family_problem(self) -> str | None:
        problem = _mixer_problem(self, self.qwen3_5, "model.qwen3_5")
        if problem:
            return problem
        if self.router_bias_update_rate:
            return (
                "model.router_bias_update_rate needs MoE layers, but qwen3_5_text has none (the "
                "MoE model is family qwen3_5_moe_text)"
            )
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        hf = _text_config(hf, what, "qwen3_5", "qwen3_5_text")
        return _shared_fields(hf, what, "qwen3_5_text", "qwen3_5")

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        q = Qwen3_5Config(**(model.get("qwen3_5") or {}))
        return _hf_config(model, q, "Qwen3_5ForCausalLM", "qwen3_5_text", {})


class Qwen3_5MoeTextModelConfig(ModelConfig):
    family: Literal["qwen3_5_moe_text"] = Field(description="Architecture family.")
    qwen3_5_moe: Qwen3_5MoeConfig = Field(
        default_factory=Qwen3_5MoeConfig,
        description="qwen3_5_moe_text: the family's own settings ([model.qwen3_5_moe]).",
    )
    intermediate_size: PositiveInt | None = Field(
        None,
        description=(
            "SwiGLU hidden width (qwen3_5_moe_text has no dense MLP: leave it unset, the "
            "experts' width is moe_intermediate_size)."
        ),
    )

    takes_expert_keys: ClassVar[bool] = True
    hf_aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_moe",)
    # Present in a resolved table.
    hf_keys: ClassVar[tuple[str, ...]] = HF_MOE_KEYS
    scanned_by_default: ClassVar[bool] = False

    def family_problem(self) -> str | None:
        problem = _mixer_problem(self, self.qwen3_5_moe, "model.qwen3_5_moe")
        if problem:
            return problem
        missing = [k for k in EXPERT_KEYS if getattr(self, k) is None]
        if missing:
            return (
                f"qwen3_5_moe_text routes every layer through experts: set "
                f"model.{', model.'.join(missing)}"
            )
        assert self.num_experts is not None and self.num_experts_per_tok is not None
        if self.num_experts_per_tok > self.num_experts:
            return (
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"model.num_experts ({self.num_experts})"
            )
        if not self.norm_topk_prob:
            return (
                "model.norm_topk_prob = false is not available for qwen3_5_moe_text (its router "
                "always renormalises the top-k weights, as transformers' does); set it to true"
            )
        if self.intermediate_size is not None:
            return (
                "model.intermediate_size is not used by qwen3_5_moe_text (every layer is an MoE: "
                "the experts' width is model.moe_intermediate_size, the shared expert's "
                "model.qwen3_5_moe.shared_expert_intermediate_size); remove it"
            )
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        hf = _text_config(hf, what, "qwen3_5_moe", "qwen3_5_moe_text")
        if hf.get("output_router_logits"):
            cannot_load(what, ["output_router_logits = true (an auxiliary router loss)"])
        # Transformers' Qwen3_5MoeTextConfig has no dense width; one a file carries is unused.
        out = _shared_fields(
            {k: v for k, v in hf.items() if k != "intermediate_size"},
            what,
            "qwen3_5_moe_text",
            "qwen3_5_moe",
        )
        h = {**_HF_MOE_DEFAULTS, **hf}
        out["qwen3_5_moe"]["shared_expert_intermediate_size"] = h["shared_expert_intermediate_size"]
        out |= {k: h[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
        out["norm_topk_prob"] = True  # transformers' router always renormalises
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        q = Qwen3_5MoeConfig(**(model.get("qwen3_5_moe") or {}))
        experts = {
            "num_experts": model["num_experts"],
            "num_experts_per_tok": model["num_experts_per_tok"],
            "moe_intermediate_size": model["moe_intermediate_size"],
            "shared_expert_intermediate_size": q.shared_expert_intermediate_size,
        }
        return _hf_config(model, q, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", experts)


# ---- HF config.json ---------------------------------------------------------------------------

#: HF Qwen3_5TextConfig's defaults for the keys our table reads.
_HF_DEFAULTS: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
#: HF Qwen3_5MoeTextConfig's defaults for its MoE keys.
_HF_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


def _text_config(hf: dict[str, Any], what: str, multimodal: str, text: str) -> dict[str, Any]:
    """The text config of a text-only config.json, or of a released multimodal one (model_type
    `multimodal`, the language model's keys under `text_config`, the head's tying at the top;
    its vision keys are not read)."""
    if hf.get("model_type") != multimodal:
        return hf
    inner = hf.get("text_config")
    if not isinstance(inner, dict):
        raise ConfigError(
            f"{what}: a model_type {multimodal!r} config.json needs a text_config object"
        )
    out = {**inner, "model_type": text}
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype is not None:
        out.setdefault("dtype", dtype)
    # transformers' multimodal class ties the head by its own key (default false), not the
    # text_config's.
    out["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    return out


def _shared_fields(hf: dict[str, Any], what: str, family: str, table: str) -> dict[str, Any]:
    """Both families' [model] keys and own table from a text config, or one sentence naming
    what jaxjob cannot load."""
    problems = qwen_problems(hf, sliding_window=False)
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        problems.append(f"attention_dropout = {hf['attention_dropout']!r}")
    theta = rope_theta(hf, problems, terse=True)
    if problems:
        cannot_load(what, problems)
    h = {**_HF_DEFAULTS, **hf}
    q: dict[str, Any] = {k: h[k] for k in _HF_DEFAULTS}
    # transformers writes layer_types out; the default pattern reads back as the interval alone.
    q["full_attention_interval"] = hf.get("full_attention_interval", 4)
    default = Qwen3_5Config(**q).resolved_layer_types(hf.get("num_hidden_layers", 32))
    types = hf.get("layer_types")
    if types and list(types) != default:
        q["layer_types"] = list(types)
    rope = rope_parameters(hf)
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    q["partial_rotary_factor"] = float(factor)
    if rope.get("mrope_section") is not None:
        q["mrope_section"] = list(rope["mrope_section"])
    if rope.get("mrope_interleaved") is not None:
        q["mrope_interleaved"] = bool(rope["mrope_interleaved"])
    out: dict[str, Any] = {"family": family, table: q}
    copy_plain(hf, out)
    out.setdefault("tie_word_embeddings", False)  # Qwen3_5TextConfig's default
    out.setdefault("head_dim", 256)
    out["rope_theta"] = theta if theta is not None else 10_000.0  # transformers' default
    copy_dtype(hf, out)
    return out


def _hf_config(
    model: dict[str, Any], q: Qwen3_5Config, architecture: str, model_type: str, own: dict
) -> dict[str, Any]:
    """The text-only config.json (`architecture`, `model_type`) both families write."""
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(model["rope_theta"]),
        "partial_rotary_factor": q.partial_rotary_factor,
    }
    if q.mrope_section is not None:
        rope["mrope_section"] = list(q.mrope_section)
    if q.mrope_interleaved is not None:
        rope["mrope_interleaved"] = q.mrope_interleaved
    out = shared_hf_config(
        # The MoE family has no dense width; the shared keys' slot is dropped below.
        {**model, "intermediate_size": model.get("intermediate_size")},
        architecture=architecture,
        model_type=model_type,
        rope=rope,
        own={
            "layer_types": q.resolved_layer_types(model["num_layers"]),
            "linear_conv_kernel_dim": q.linear_conv_kernel_dim,
            "linear_key_head_dim": q.linear_key_head_dim,
            "linear_value_head_dim": q.linear_value_head_dim,
            "linear_num_key_heads": q.linear_num_key_heads,
            "linear_num_value_heads": q.linear_num_value_heads,
            **own,
        },
    )
    if out["intermediate_size"] is None:
        del out["intermediate_size"]
    return out
