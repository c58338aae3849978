"""The "gpt_oss" family's contract: OpenAI's gpt-oss decoder (`GptOssForCausalLM`), its
`[model.gpt_oss]` table and checks, and its HF config.json both ways (an MXFP4-quantized
checkpoint's `quantization_config` included)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from jobspec.families.hf import (
    cannot_load,
    copy_dtype,
    copy_plain,
    rope_parameters,
    shared_hf_config,
)
from jobspec.families.model_config import ModelConfig
from jobspec.section import PositiveFloat, PositiveInt, Section


def gpt_oss_default_layer_types(num_layers: int) -> list[str]:
    """HF GptOssConfig's default pattern: sliding, full, sliding, full, ... (layer 0 sliding)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


class YarnRopeScaling(Section):
    """YaRN RoPE scaling (HF `rope_type = "yarn"`, `_compute_yarn_parameters`): frequencies
    whose wavelength fits beta_fast rotations in the original context are kept, those below
    beta_slow rotations divided by `factor`, a linear ramp between; cos and sin are scaled by
    0.1 ln(factor) + 1."""

    rope_type: Literal["yarn"] = Field("yarn", description="The scaling rule (HF rope_type).")
    factor: PositiveFloat = Field(32.0, description="How much the low frequencies are stretched.")
    beta_fast: PositiveFloat = Field(
        32.0, description="Rotations in the original context above which a frequency is kept."
    )
    beta_slow: PositiveFloat = Field(
        1.0, description="Rotations below which a frequency is divided by factor."
    )
    original_max_position_embeddings: PositiveInt = Field(
        4096, description="The context length the model was pretrained at."
    )
    truncate: bool = Field(
        False, description="Round the ramp's ends to whole dimensions (HF truncate)."
    )


class GptOssConfig(Section):
    """The `gpt_oss` family's own settings (HF `GptOssConfig`). The shared `[model]` keys give
    the attention shapes (`num_heads`, `num_kv_heads`, `head_dim`), `rope_theta`, and
    `intermediate_size`, the width of every expert (there is no dense MLP)."""

    # A tuple, so the config (a static attribute of the model's graph) stays hashable.
    layer_types: tuple[Literal["sliding_attention", "full_attention"], ...] | None = Field(
        None,
        description="Attention type per layer; default sliding and full alternating, from sliding.",
    )
    sliding_window: PositiveInt = Field(
        128, description="Keys a sliding-attention token sees: itself and the window-1 before it."
    )
    num_local_experts: PositiveInt = Field(128, description="Routed experts per layer.")
    num_experts_per_tok: PositiveInt = Field(4, description="Experts each token uses (top-k).")
    swiglu_limit: PositiveFloat = Field(
        7.0, description="Experts clamp the gate above and up to [-limit, limit] (HF swiglu_limit)."
    )
    swiglu_alpha: PositiveFloat = Field(
        1.702, description="Sigmoid gain of the experts' SwiGLU: gate * sigmoid(alpha * gate)."
    )
    attention_bias: bool = Field(
        True, description="The q, k, v and o projections carry a bias (HF attention_bias)."
    )
    rope_scaling: YarnRopeScaling | None = Field(
        default_factory=YarnRopeScaling,
        description="YaRN RoPE scaling ([model.gpt_oss.rope_scaling]); null: plain RoPE.",
    )

    def resolved_layer_types(self, num_layers: int) -> list[str]:
        """layer_types, or transformers' default alternating pattern."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return gpt_oss_default_layer_types(num_layers)


class GptOssModelConfig(ModelConfig):
    family: Literal["gpt_oss"] = Field(description="Architecture family.")
    gpt_oss: GptOssConfig = Field(
        default_factory=GptOssConfig,
        description="gpt_oss: the family's own settings ([model.gpt_oss]).",
    )

    # Unrolled unless asked: the sliding and full layers take different attention masks, so
    # they scan in periods (paths `layers.blocks.{j}`), not as one stack.
    scanned_by_default: ClassVar[bool] = False

    @property
    def routed_experts(self) -> int | None:
        return self.gpt_oss.num_local_experts

    def family_problem(self) -> str | None:
        g, n = self.gpt_oss, self.num_layers
        if g.layer_types is not None and len(g.layer_types) != n:
            return (
                f"model.gpt_oss.layer_types has {len(g.layer_types)} entries but model.num_layers "
                f"is {n}; give one type per layer"
            )
        if g.num_experts_per_tok > g.num_local_experts:
            return (
                f"model.gpt_oss.num_experts_per_tok ({g.num_experts_per_tok}) exceeds "
                f"model.gpt_oss.num_local_experts ({g.num_local_experts})"
            )
        if self.resolved_head_dim % 2:
            return f"model.head_dim ({self.resolved_head_dim}) must be even for gpt_oss's RoPE"
        return self._setting_problem()

    def _setting_problem(self) -> str | None:
        """A shared `[model]` setting gpt_oss does not take, as one sentence."""
        if self.attention == "cudnn":
            return (
                "model.attention = 'cudnn' cannot honour gpt_oss's attention sinks (a learned "
                "logit per head in the softmax); set it to 'auto', 'splash' or 'xla'"
            )
        if not self.norm_topk_prob:
            return (
                "model.norm_topk_prob = false is not available for gpt_oss (its router weights "
                "are the softmax over the chosen experts' logits); remove it"
            )
        if self.router_bias_update_rate:
            return (
                "model.router_bias_update_rate is not available for gpt_oss (its router has a "
                "learned bias, not a selection bias); remove it"
            )
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        problems = _hf_problems(hf)
        rope = {**_HF_ROPE_DEFAULT, **rope_parameters(hf)} if _no_rope(hf) else rope_parameters(hf)
        scaling, theta = _rope_from_hf(hf, rope, problems)
        if problems:
            cannot_load(what, problems)
        h = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        n = h["num_hidden_layers"]
        g: dict[str, Any] = {
            "layer_types": list(hf.get("layer_types") or gpt_oss_default_layer_types(n)),
            **{k: h[k] for k in _OWN_KEYS},
            "rope_scaling": scaling,
        }
        out: dict[str, Any] = {"family": "gpt_oss", "gpt_oss": g}
        copy_plain(h, out)
        out["rope_theta"] = theta
        copy_dtype(hf, out)
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        g = GptOssConfig(**(model.get("gpt_oss") or {}))
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model["rope_theta"])}
        if g.rope_scaling is not None:
            rope = {**g.rope_scaling.model_dump(), "rope_theta": float(model["rope_theta"])}
        out = shared_hf_config(
            model,
            architecture="GptOssForCausalLM",
            model_type="gpt_oss",
            rope=rope,
            own={
                "attention_bias": g.attention_bias,
                "layer_types": g.resolved_layer_types(model["num_layers"]),
                "sliding_window": g.sliding_window,
                "num_local_experts": g.num_local_experts,
                "num_experts_per_tok": g.num_experts_per_tok,
                "swiglu_limit": g.swiglu_limit,
                "swiglu_alpha": g.swiglu_alpha,
                "output_router_logits": False,
            },
        )
        out["attention_bias"] = g.attention_bias  # shared_hf_config writes false first
        return out


# ---- HF config.json ---------------------------------------------------------------------------

#: HF GptOssConfig's defaults for the keys a config.json may leave out (transformers writes them
#: all; the released checkpoints' files do too).
_HF_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
#: Our [model.gpt_oss] keys that copy from the HF config unchanged.
_OWN_KEYS = (
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "swiglu_limit",
    "swiglu_alpha",
    "attention_bias",
)
#: HF GptOssConfig's RoPE when a config.json gives none, and its default base.
_HF_ROPE_DEFAULT: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_HF_DEFAULT_THETA = 150_000.0
#: YaRN keys transformers reads that gpt-oss's checkpoints never set; refused when set.
_YARN_UNSUPPORTED = ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor")


def _no_rope(hf: dict[str, Any]) -> bool:
    """No RoPE type given (GptOssConfig then takes its own yarn default)."""
    rope = rope_parameters(hf)
    return rope.get("rope_type", rope.get("type")) is None


def _hf_problems(hf: dict[str, Any]) -> list[str]:
    """Settings of a GptOss config.json jaxjob cannot load (the RoPE's are _rope_from_hf's)."""
    problems = []
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method != "mxfp4":
            problems.append(f"quantization_config.quant_method = {method!r} (only 'mxfp4')")
    if hf.get("output_router_logits"):
        problems.append("output_router_logits = true (an auxiliary router loss)")
    if "sliding_window" in hf and hf["sliding_window"] is None:
        problems.append("sliding_window = null")
    if hf.get("attention_dropout"):  # transformers drops attention probabilities in training
        problems.append(f"attention_dropout = {hf['attention_dropout']!r}")
    return problems


def _rope_from_hf(
    hf: dict[str, Any], rope: dict[str, Any], problems: list[str]
) -> tuple[dict[str, Any] | None, float]:
    """(our rope_scaling table or None for plain RoPE, the base) from the config's RoPE table;
    what cannot load goes to `problems`."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", _HF_DEFAULT_THETA)))
    if kind == "default":
        return None, theta
    if kind != "yarn":
        problems.append(f"rope_type {kind!r} (only 'yarn' and 'default')")
        return None, theta
    for key in _YARN_UNSUPPORTED:
        value = rope.get(key)
        if value is not None and not (key == "partial_rotary_factor" and value == 1.0):
            problems.append(f"rope_parameters.{key} = {value!r}")
    if rope.get("factor") is None:
        problems.append("a yarn rope without a factor")
        return None, theta
    fields = YarnRopeScaling.model_fields
    scaling = {k: rope[k] for k in fields if k != "rope_type" and rope.get(k) is not None}
    # transformers' own defaults where the table leaves a key out (its yarn truncates unless
    # told not to; the original length defaults to max_position_embeddings).
    scaling.setdefault("truncate", True)
    original = hf.get("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"])
    scaling.setdefault("original_max_position_embeddings", original)
    return {"rope_type": "yarn", **scaling}, theta
