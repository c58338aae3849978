"""The "qwen3_next" family's contract: Qwen3-Next's hybrid decoder, its `[model.qwen3_next]`
table and checks, and its HF config.json (`Qwen3NextForCausalLM`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

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
from jobspec.section import NonNegativeInt, PositiveInt, Section


class HybridMixerConfig(Section):
    """What the Gated-DeltaNet / gated-attention hybrids share (Qwen3-Next, and Qwen3.5 after
    it): which layers mix tokens how, the DeltaNet layers' shapes, the partial RoPE of the full
    attention layers and the delta rule's chunk."""

    # A tuple, so the config (a static attribute of the model's graph) stays hashable.
    layer_types: tuple[Literal["linear_attention", "full_attention"], ...] | None = Field(
        None,
        description=(
            "Token mixer per layer (Gated DeltaNet or gated full attention); default: every "
            "full_attention_interval-th layer full, the rest linear."
        ),
    )
    full_attention_interval: PositiveInt = Field(
        4,
        description="Without layer_types: layers i with (i + 1) % interval == 0 are full attention.",
    )
    linear_conv_kernel_dim: PositiveInt = Field(
        4, description="Width of the DeltaNet layers' depthwise causal convolution over q, k, v."
    )
    linear_key_head_dim: PositiveInt = Field(128, description="DeltaNet query/key head dim.")
    linear_value_head_dim: PositiveInt = Field(128, description="DeltaNet value head dim.")
    linear_num_key_heads: PositiveInt = Field(16, description="DeltaNet query/key heads.")
    linear_num_value_heads: PositiveInt = Field(
        32, description="DeltaNet value heads; a multiple of linear_num_key_heads."
    )
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] = Field(
        0.25,
        description="Fraction of the full-attention head dim that RoPE rotates (the first dims).",
    )
    chunk_size: PositiveInt = Field(
        64, description="Tokens per chunk of the chunked gated delta rule (training and prefill)."
    )

    def resolved_layer_types(self, num_layers: int) -> list[str]:
        """layer_types, or transformers' default pattern from full_attention_interval."""
        if self.layer_types is not None:
            return list(self.layer_types)
        n = self.full_attention_interval
        return [
            "full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(num_layers)
        ]


def mixer_problem(cfg: ModelConfig, q: HybridMixerConfig, table: str) -> str | None:
    """What a hybrid's layers and heads must satisfy (`table`: model.<its table>), or None."""
    n = cfg.num_layers
    if q.layer_types is not None and len(q.layer_types) != n:
        return (
            f"{table}.layer_types has {len(q.layer_types)} entries but model.num_layers is {n}; "
            "give one type per layer"
        )
    if q.linear_num_value_heads % q.linear_num_key_heads:
        return (
            f"{table}.linear_num_value_heads ({q.linear_num_value_heads}) must be a multiple of "
            f"{table}.linear_num_key_heads ({q.linear_num_key_heads})"
        )
    rotated = int(cfg.resolved_head_dim * q.partial_rotary_factor)
    if rotated < 2 or rotated % 2:
        return (
            f"{table}.partial_rotary_factor = {q.partial_rotary_factor} rotates {rotated} of "
            f"model.head_dim = {cfg.resolved_head_dim} dims; it must rotate an even number, at "
            "least 2"
        )
    return None


class Qwen3NextConfig(HybridMixerConfig):
    """The `qwen3_next` family's own settings (HF `Qwen3NextConfig`). The shared `[model]` keys
    describe its full-attention layers (`num_heads`, `num_kv_heads`, `head_dim`, `rope_theta`),
    the dense MLP of non-MoE layers (`intermediate_size`) and the routed experts
    (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
    `router_bias_update_rate`; unset experts: every layer is dense)."""

    shared_expert_intermediate_size: PositiveInt = Field(
        512,
        description="Width of the SwiGLU shared expert beside the routed experts of MoE layers.",
    )
    decoder_sparse_step: PositiveInt = Field(
        1, description="Layers i with (i + 1) % step == 0 are MoE layers (when experts are set)."
    )
    mlp_only_layers: tuple[NonNegativeInt, ...] = Field(
        (), description="Layer indices that use the dense MLP instead of the MoE."
    )

    def moe_layers(self, num_layers: int, num_experts: int | None) -> list[bool]:
        """Per layer: does it route through experts (HF's mlp_only_layers / decoder_sparse_step)?"""
        return [
            bool(num_experts)
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(num_layers)
        ]


class Qwen3NextModelConfig(ModelConfig):
    family: Literal["qwen3_next"] = Field(description="Architecture family.")
    qwen3_next: Qwen3NextConfig = Field(
        default_factory=Qwen3NextConfig,
        description="qwen3_next: the family's own settings ([model.qwen3_next]).",
    )

    takes_expert_keys: ClassVar[bool] = True
    # Present (null for a dense model) in a resolved table.
    hf_keys: ClassVar[tuple[str, ...]] = HF_MOE_KEYS

    # Unrolled unless asked: the layers differ in token mixer and MLP, so they scan in periods
    # of their kinds (paths `layers.blocks.{j}`), not as one stack.
    scanned_by_default: ClassVar[bool] = False

    def family_problem(self) -> str | None:
        q, n = self.qwen3_next, self.num_layers
        problem = mixer_problem(self, q, "model.qwen3_next")
        if problem:
            return problem
        bad = [i for i in q.mlp_only_layers if i >= n]
        if bad:
            return (
                f"model.qwen3_next.mlp_only_layers names layer {bad[0]}, but model.num_layers is {n} "
                f"(layers 0-{n - 1})"
            )
        given = [k for k in EXPERT_KEYS if getattr(self, k) is not None]
        if given and len(given) < len(EXPERT_KEYS):
            missing = [k for k in EXPERT_KEYS if getattr(self, k) is None]
            return (
                f"model.{given[0]} gives qwen3_next routed experts, which also need "
                f"model.{', model.'.join(missing)}"
            )
        if given:
            assert self.num_experts is not None and self.num_experts_per_tok is not None
            if self.num_experts_per_tok > self.num_experts:
                return (
                    f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                    f"model.num_experts ({self.num_experts})"
                )
        if self.router_bias_update_rate and not any(q.moe_layers(n, self.num_experts)):
            return (
                "model.router_bias_update_rate needs MoE layers, but this qwen3_next model has none "
                "(set model.num_experts, or check model.qwen3_next.mlp_only_layers)"
            )
        return None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        problems = qwen_problems(hf, sliding_window=False)
        theta = rope_theta(hf, problems, terse=True)
        if problems:
            cannot_load(what, problems)
        h = {**_HF_DEFAULTS, **_HF_MOE_DEFAULTS, **hf}
        n = h.get("num_hidden_layers", 48)
        types = hf.get("layer_types")
        if not types:
            interval = hf.get("full_attention_interval", 4)
            types = [
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
            ]
        q: dict[str, Any] = {k: h[k] for k in _HF_DEFAULTS}
        q["layer_types"] = list(types)
        q["mlp_only_layers"] = list(h.get("mlp_only_layers") or [])
        rope = rope_parameters(hf)
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        q["partial_rotary_factor"] = float(factor)
        out: dict[str, Any] = {"family": "qwen3_next", "qwen3_next": q}
        copy_plain(hf, out)
        out.setdefault("tie_word_embeddings", False)  # Qwen3NextConfig's default
        out.setdefault("head_dim", 256)
        out["rope_theta"] = theta if theta is not None else 10_000.0  # Qwen3NextConfig's default
        if h["num_experts"]:  # 0: every layer dense, as in transformers
            out |= {k: h[k] for k in _HF_MOE_DEFAULTS}
        copy_dtype(hf, out)
        return out

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        q = Qwen3NextConfig(**(model.get("qwen3_next") or {}))
        n = model["num_layers"]
        moe = model.get("num_experts") is not None
        return shared_hf_config(
            model,
            architecture="Qwen3NextForCausalLM",
            model_type="qwen3_next",
            rope={
                "rope_type": "default",
                "rope_theta": float(model["rope_theta"]),
                "partial_rotary_factor": q.partial_rotary_factor,
            },
            own={
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
            },
        )


#: HF Qwen3NextConfig's defaults for the keys our [model.qwen3_next] reads.
_HF_DEFAULTS: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
}
_HF_MOE_DEFAULTS = {"num_experts": 512, "num_experts_per_tok": 10,
                    "moe_intermediate_size": 512, "norm_topk_prob": True}  # fmt: skip
