"""The "deepseek_v3" family's contract: DeepSeek-V3's decoder (multi-head latent attention, a
sigmoid-routed MoE with shared experts), its `[model.deepseek_v3]` table and checks, and its HF
config.json (`DeepseekV3ForCausalLM`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from jobspec.families.hf import (
    HF_MOE_KEYS,
    cannot_load,
    copy_dtype,
    copy_plain,
    qwen_problems,
    rope_parameters,
    shared_hf_config,
)
from jobspec.families.model_config import EXPERT_KEYS, ModelConfig
from jobspec.section import NonNegativeInt, PositiveFloat, PositiveInt, Section

_NonNegativeFloat = Annotated[float, Field(ge=0)]


class YarnConfig(Section):
    """YaRN RoPE scaling (HF `rope_parameters` with rope_type "yarn"), as transformers computes it:
    interpolated frequencies blended with the original ones by a linear ramp, cos/sin times the
    attention factor, and the softmax scale times mscale(factor, mscale_all_dim)^2."""

    factor: PositiveFloat = Field(
        description="Context extension factor (the whole table unset: plain RoPE)."
    )
    original_max_position_embeddings: PositiveInt = Field(
        description="Context length the model was pretrained at (the ramp's reference)."
    )
    beta_fast: PositiveFloat = Field(
        32.0, description="Ramp boundary (rotations) of extrapolation."
    )
    beta_slow: PositiveFloat = Field(1.0, description="Ramp boundary (rotations) of interpolation.")
    mscale: _NonNegativeFloat | None = Field(
        None, description="Numerator's mscale of the cos/sin factor (with mscale_all_dim)."
    )
    mscale_all_dim: _NonNegativeFloat | None = Field(
        None,
        description=(
            "Denominator's mscale of the cos/sin factor; also scales the softmax by "
            "(0.1 * mscale_all_dim * ln(factor) + 1)^2."
        ),
    )
    attention_factor: PositiveFloat | None = Field(
        None, description="cos/sin factor; unset: from factor, mscale and mscale_all_dim."
    )
    truncate: bool = Field(True, description="Round the ramp's boundaries to whole dims.")


class DeepseekV3Config(Section):
    """The `deepseek_v3` family's own settings (HF `DeepseekV3Config`). The shared `[model]` keys
    give the heads (`num_heads`; `num_kv_heads` equals it), the dense MLP of the first layers
    (`intermediate_size`), the routed experts (`num_experts` = HF n_routed_experts,
    `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`) and the router bias
    (`router_bias_update_rate`; HF's e_score_correction_bias)."""

    q_lora_rank: PositiveInt | None = Field(
        1536, description="Query low-rank width (q_a_proj, q_a_layernorm, q_b_proj); unset: q_proj."
    )
    kv_lora_rank: PositiveInt = Field(512, description="Width of the compressed key/value latent.")
    qk_nope_head_dim: PositiveInt = Field(128, description="Query/key head dims without RoPE.")
    qk_rope_head_dim: PositiveInt = Field(
        64, description="Query/key head dims with RoPE (the key's are shared by all heads)."
    )
    v_head_dim: PositiveInt = Field(128, description="Value head dim.")
    rope_interleave: bool = Field(
        True,
        description="RoPE on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek stores q/k.",
    )
    yarn: YarnConfig | None = Field(None, description="YaRN RoPE scaling; unset: plain RoPE.")
    n_shared_experts: PositiveInt = Field(
        1, description="Shared experts: one SwiGLU of n_shared_experts x moe_intermediate_size."
    )
    n_group: PositiveInt = Field(8, description="Expert groups of the group-limited routing.")
    topk_group: PositiveInt = Field(4, description="Groups each token may route to.")
    routed_scaling_factor: PositiveFloat = Field(
        2.5, description="Factor on the routed experts' weights."
    )
    first_k_dense_replace: NonNegativeInt = Field(
        3, description="The first k layers use the dense MLP; the rest the MoE."
    )
    num_nextn_predict_layers: NonNegativeInt = Field(
        0,
        description=(
            "Multi-token-prediction layers an HF checkpoint holds after the decoder layers: not "
            "built; import skips their tensors, export writes none."
        ),
    )

    def moe_layers(self, num_layers: int) -> list[bool]:
        """Per layer: does it route through experts (HF: layer index >= first_k_dense_replace)?"""
        return [i >= self.first_k_dense_replace for i in range(num_layers)]


class DeepseekV3ModelConfig(ModelConfig):
    family: Literal["deepseek_v3"] = Field(description="Architecture family.")
    deepseek_v3: DeepseekV3Config = Field(
        default_factory=DeepseekV3Config,
        description="deepseek_v3: the family's own settings ([model.deepseek_v3]).",
    )

    takes_expert_keys: ClassVar[bool] = True
    hf_keys: ClassVar[tuple[str, ...]] = HF_MOE_KEYS

    @model_validator(mode="before")
    @classmethod
    def _mla_heads(cls, data: Any) -> Any:
        """As in transformers: head_dim is qk_rope_head_dim and the key/value heads are the
        query heads (latent attention has no grouped K/V); both may be left out."""
        if not isinstance(data, dict):
            return data
        table = data.get("deepseek_v3")
        if isinstance(table, DeepseekV3Config):
            rope = table.qk_rope_head_dim
        else:
            rope = (table or {}).get("qk_rope_head_dim", 64) if isinstance(table, dict) else 64
        out = dict(data)
        if isinstance(rope, int) and out.get("head_dim") is None:
            out["head_dim"] = rope
        if "num_heads" in out:
            out.setdefault("num_kv_heads", out["num_heads"])
        return out

    def family_problem(self) -> str | None:
        d = self.deepseek_v3
        if self.head_dim != d.qk_rope_head_dim:
            return (
                f"model.head_dim ({self.head_dim}) is model.deepseek_v3.qk_rope_head_dim "
                f"({d.qk_rope_head_dim}) for deepseek_v3; leave it out"
            )
        if self.num_kv_heads != self.num_heads:
            return (
                f"model.num_kv_heads ({self.num_kv_heads}) must equal model.num_heads "
                f"({self.num_heads}) for deepseek_v3 (latent attention expands one key/value head "
                "per query head); leave it out"
            )
        if d.qk_rope_head_dim % 2:
            return f"model.deepseek_v3.qk_rope_head_dim ({d.qk_rope_head_dim}) must be even"
        problem = self._expert_problem()
        if problem:
            return problem
        if self.router_bias_update_rate and not any(d.moe_layers(self.num_layers)):
            return (
                "model.router_bias_update_rate needs MoE layers, but model.deepseek_v3."
                f"first_k_dense_replace ({d.first_k_dense_replace}) makes all {self.num_layers} "
                "layers dense"
            )
        return None

    def _expert_problem(self) -> str | None:
        """The routed experts' sizes against the group-limited routing."""
        missing = [k for k in EXPERT_KEYS if getattr(self, k) is None]
        if missing:
            return f"family deepseek_v3 needs model.{', model.'.join(missing)}"
        d, e, k = self.deepseek_v3, self.num_experts, self.num_experts_per_tok
        assert e is not None and k is not None
        if e % d.n_group:
            return (
                f"model.num_experts ({e}) must be a multiple of model.deepseek_v3.n_group "
                f"({d.n_group})"
            )
        per_group = e // d.n_group
        if per_group < 2:
            return (
                f"model.deepseek_v3.n_group ({d.n_group}) leaves {per_group} expert per group; a "
                "group is scored by its best 2 experts, so give each group at least 2"
            )
        if d.topk_group > d.n_group:
            return (
                f"model.deepseek_v3.topk_group ({d.topk_group}) exceeds model.deepseek_v3.n_group "
                f"({d.n_group})"
            )
        if k > d.topk_group * per_group:
            return (
                f"model.num_experts_per_tok ({k}) exceeds the {d.topk_group * per_group} experts "
                f"of the model.deepseek_v3.topk_group = {d.topk_group} groups a token may use"
            )
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        h = {**_HF_DEFAULTS, **hf}
        problems = _hf_problems(h)
        rope = rope_parameters(hf)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            problems.append(f"rope_type {kind!r} (only default RoPE and yarn)")
        if problems:
            cannot_load(what, problems)
        own: dict[str, Any] = {k: h[k] for k in _OWN_KEYS}
        own["rope_interleave"] = bool(h["rope_interleave"])  # null: off, as transformers reads it
        if kind == "yarn":
            own["yarn"] = _yarn_from_hf(rope, hf)
        out: dict[str, Any] = {"family": "deepseek_v3", "deepseek_v3": own}
        copy_plain(hf, out)
        out.setdefault("tie_word_embeddings", False)  # DeepseekV3Config's default
        out["head_dim"] = own["qk_rope_head_dim"]
        out["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
        out["num_experts"] = h["n_routed_experts"]
        out |= {k: h[k] for k in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
        copy_dtype(hf, out)
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        d = DeepseekV3Config(**(model.get("deepseek_v3") or {}))
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model["rope_theta"])}
        if d.yarn is not None:
            rope = {**rope, "rope_type": "yarn", **d.yarn.model_dump(exclude_none=True)}
        own = {k: getattr(d, k) for k in _OWN_KEYS} | {
            "head_dim": d.qk_rope_head_dim,
            "n_routed_experts": model["num_experts"],
            "num_experts_per_tok": model["num_experts_per_tok"],
            "moe_intermediate_size": model["moe_intermediate_size"],
            "norm_topk_prob": bool(model.get("norm_topk_prob", True)),
            "num_nextn_predict_layers": 0,  # an export holds no MTP layers
        }
        return shared_hf_config(
            model,
            architecture="DeepseekV3ForCausalLM",
            model_type="deepseek_v3",
            rope=rope,
            own=own,
        )


#: HF DeepseekV3Config's defaults for the keys jaxjob reads.
_HF_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "rope_interleave": True, "n_shared_experts": 1, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048, "norm_topk_prob": True,
}  # fmt: skip
#: [model.deepseek_v3] keys that copy from the HF config under the same name.
_OWN_KEYS = (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "rope_interleave", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
    "first_k_dense_replace", "num_nextn_predict_layers",
)  # fmt: skip
#: Keys of DeepSeek's own config.json that transformers' DeepseekV3 never reads, with the only
#: value whose model it computes.
_FIXED_BY_TRANSFORMERS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
#: HF keys whose null transformers cannot run.
_NOT_NULL = (
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
    "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
)  # fmt: skip


def _hf_problems(h: dict[str, Any]) -> list[str]:
    """What of a DeepseekV3 config.json (with transformers' defaults filled) jaxjob cannot load."""
    problems = qwen_problems(h, sliding_window=False)
    if h.get("quantization_config"):
        method = h["quantization_config"].get("quant_method", "?")
        problems.append(
            f"quantization_config ({method}; dequantise the weights to bf16 and drop the key)"
        )
    heads, kv = h.get("num_attention_heads"), h.get("num_key_value_heads")
    if kv is not None and kv != heads:
        problems.append(f"num_key_value_heads = {kv} != num_attention_heads = {heads}")
    if h.get("attention_dropout"):
        problems.append(f"attention_dropout = {h['attention_dropout']} (jaxjob has no dropout)")
    for key, value in _FIXED_BY_TRANSFORMERS.items():
        if key in h and h[key] != value:
            problems.append(f"{key} = {h[key]!r} (transformers computes only {value!r})")
    problems += [f"{key} = null" for key in _NOT_NULL if h.get(key) is None]
    return problems


def _yarn_from_hf(rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """[model.deepseek_v3.yarn] from a yarn rope table, with transformers' fallbacks (the
    original length: a top-level original_max_position_embeddings first, then the table's,
    then max_position_embeddings)."""
    original = hf.get(
        "original_max_position_embeddings",
        rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096)),
    )
    # transformers' fallback for a null factor: the ratio of the two context lengths.
    factor = rope.get("factor") or hf.get("max_position_embeddings", 4096) / original
    out = {"factor": factor, "original_max_position_embeddings": original}
    # transformers reads `beta_fast or 32`, `beta_slow or 1`.
    out["beta_fast"] = rope.get("beta_fast") or 32.0
    out["beta_slow"] = rope.get("beta_slow") or 1.0
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(key) is not None:
            out[key] = rope[key]
    out["truncate"] = bool(rope.get("truncate", True))
    return out
