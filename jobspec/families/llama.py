"""The "llama" and "mistral" families' contract: Llama 3's decoder (`LlamaForCausalLM`: llama3
RoPE scaling, optional attention and MLP biases, tied or untied head) with its `[model.llama]`
table, and Mistral's (`MistralForCausalLM`: Llama with a sliding window) with `[model.mistral]`;
their HF config.json both ways. Both build the decoder of runtime/model/llama/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from jobspec.families.hf import (
    cannot_load,
    copy_dtype,
    copy_plain,
    rope_parameters,
    rope_theta,
    shared_hf_config,
)
from jobspec.families.model_config import ModelConfig
from jobspec.section import PositiveFloat, PositiveInt, Section

#: The RoPE base HF LlamaConfig/MistralConfig take when a config.json gives none.
_HF_DEFAULT_THETA = 10_000.0
#: The llama3 RoPE scaling keys, HF's names and ours.
LLAMA3_KEYS: tuple[str, ...] = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


class Llama3RopeScaling(Section):
    """Llama 3.1's RoPE frequency scaling (HF `rope_type = "llama3"`): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, shorter than
    original_max_position_embeddings / high_freq_factor kept, those between interpolated."""

    rope_type: Literal["llama3"] = Field("llama3", description="The scaling rule (HF rope_type).")
    factor: PositiveFloat = Field(8.0, description="How much the low frequencies are stretched.")
    low_freq_factor: PositiveFloat = Field(
        1.0, description="Wavelengths above original / low_freq_factor are divided by factor."
    )
    high_freq_factor: PositiveFloat = Field(
        4.0, description="Wavelengths below original / high_freq_factor are kept as they are."
    )
    original_max_position_embeddings: PositiveInt = Field(
        8192, description="The context length the model was pretrained at."
    )


class LlamaConfig(Section):
    """The `llama` family's own settings (HF `LlamaConfig`)."""

    rope_scaling: Llama3RopeScaling | None = Field(
        None,
        description="Llama 3.1-style RoPE scaling ([model.llama.rope_scaling]); null: plain RoPE.",
    )
    attention_bias: bool = Field(
        False, description="The q, k, v and o projections carry a bias (HF attention_bias)."
    )
    mlp_bias: bool = Field(
        False, description="The gate, up and down projections carry a bias (HF mlp_bias)."
    )


class MistralConfig(Section):
    """The `mistral` family's own settings (HF `MistralConfig`)."""

    sliding_window: PositiveInt | None = Field(
        None,
        description=(
            "Every layer's token sees itself and the sliding_window-1 tokens before it; null: "
            "full causal attention."
        ),
    )


@dataclass(frozen=True)
class DecoderOptions:
    """What runtime/model/llama/ reads of either family's config."""

    rope_scaling: Llama3RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None


def _problems(hf: dict[str, Any]) -> list[str]:
    """Settings of a Llama or Mistral HF config that jaxjob cannot load (nothing it would
    approximate: dropout is never trained here)."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf.get('hidden_act')!r}")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        problems.append(f"attention_dropout = {hf['attention_dropout']!r}")
    return problems


def _shared_fields(hf: dict[str, Any], family: str, theta: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"family": family}
    copy_plain(hf, out)
    out.setdefault("tie_word_embeddings", False)  # HF LlamaConfig's and MistralConfig's default
    out["rope_theta"] = theta if theta is not None else _HF_DEFAULT_THETA
    copy_dtype(hf, out)
    return out


def _llama_rope(hf: dict[str, Any], problems: list[str]) -> tuple[float | None, dict | None]:
    """(RoPE base, llama3 scaling table or None) of an HF Llama config; what it cannot load
    (another rope type, llama3 without its keys) goes to `problems`."""
    rope = rope_parameters(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default", "llama3"):
        problems.append(f"rope_type {kind!r} is not supported (only default and llama3 RoPE)")
        return None, None
    plain = {**hf, "rope_parameters": {**rope, "rope_type": "default"}, "rope_scaling": None}
    theta = rope_theta(plain, problems)
    if kind != "llama3":
        return theta, None
    missing = [k for k in LLAMA3_KEYS if rope.get(k) is None]
    if missing:
        problems.append(f"rope_type 'llama3' without {', '.join(missing)}")
        return theta, None
    return theta, {k: rope[k] for k in LLAMA3_KEYS}


class LlamaModelConfig(ModelConfig):
    family: Literal["llama"] = Field(description="Architecture family.")
    llama: LlamaConfig = Field(
        default_factory=LlamaConfig, description="llama: the family's own settings ([model.llama])."
    )

    def decoder_options(self) -> DecoderOptions:
        own = self.llama
        return DecoderOptions(own.rope_scaling, own.attention_bias, own.mlp_bias)

    def family_problem(self) -> str | None:
        scaling = self.llama.rope_scaling
        if scaling is not None and scaling.high_freq_factor <= scaling.low_freq_factor:
            return (
                f"model.llama.rope_scaling.high_freq_factor ({scaling.high_freq_factor}) must "
                f"exceed model.llama.rope_scaling.low_freq_factor ({scaling.low_freq_factor})"
            )
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        problems = _problems(hf)
        theta, scaling = _llama_rope(hf, problems)
        if problems:
            cannot_load(what, problems)
        out = _shared_fields(hf, "llama", theta)
        out["llama"] = {
            "rope_scaling": scaling,
            "attention_bias": bool(hf.get("attention_bias", False)),
            "mlp_bias": bool(hf.get("mlp_bias", False)),
        }
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        own = LlamaConfig(**(model.get("llama") or {}))
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model["rope_theta"])}
        if own.rope_scaling is not None:
            rope = {**rope, **own.rope_scaling.model_dump()}
        return shared_hf_config(
            model,
            architecture="LlamaForCausalLM",
            model_type="llama",
            rope=rope,
            own={"attention_bias": own.attention_bias, "mlp_bias": own.mlp_bias},
        )


class MistralModelConfig(ModelConfig):
    family: Literal["mistral"] = Field(description="Architecture family.")
    mistral: MistralConfig = Field(
        default_factory=MistralConfig,
        description="mistral: the family's own settings ([model.mistral]).",
    )

    def decoder_options(self) -> DecoderOptions:
        return DecoderOptions(sliding_window=self.mistral.sliding_window)

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        problems = _problems(hf)
        theta = rope_theta(hf, problems)  # Mistral: default RoPE only
        if problems:
            cannot_load(what, problems)
        out = _shared_fields(hf, "mistral", theta)
        out["mistral"] = {"sliding_window": hf.get("sliding_window")}
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        own = MistralConfig(**(model.get("mistral") or {}))
        out = shared_hf_config(
            model,
            architecture="MistralForCausalLM",
            model_type="mistral",
            rope={"rope_type": "default", "rope_theta": float(model["rope_theta"])},
            own={"sliding_window": own.sliding_window},
        )
        del out["attention_bias"]  # MistralConfig has none: its projections never carry one
        return out
