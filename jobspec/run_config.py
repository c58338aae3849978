"""RunConfig: the `cfg.toml` every host trains from.

Section and key names are the documented contract (README "Config reference");
unknown keys are errors. Nothing here imports jax.
"""

from __future__ import annotations

import math
import re
from pathlib import PurePosixPath
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
# A step number or count of steps: the train state counts steps in int32.
MAX_STEPS = 2**31 - 1
StepCount = Annotated[int, Field(ge=0, le=MAX_STEPS)]
PositiveStepCount = Annotated[int, Field(gt=0, le=MAX_STEPS)]
# JAX's PRNG seeds are signed 64-bit integers.
MAX_SEED = 2**63 - 1
# Far beyond any corpus trained on (frontier runs are ~1e13 tokens): a larger value is a typo.
MAX_TARGET_TOKENS = 10**16
NONFINITE_POLICIES = ("stop", "skip_step")

# Always fullmatch: `$` alone also matches before a trailing newline ("name\n").
RUN_ID_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _number_outside(value: object, lo: float, hi: float) -> bool:
    """A number (not a bool) outside [lo, hi], NaN and infinities included."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not lo <= value <= hi


def check_dns_label(value: str, what: str, max_len: int = 63) -> str:
    """`value` if it is a DNS-1123 label of at most max_len characters, else the one error
    every run id, job name and JAXJOB_RUN_ID gives (`what` names the field)."""
    if len(value) > max_len or not RUN_ID_RE.fullmatch(value):
        raise ValueError(
            f"{what}{value!r} is not a DNS-1123 label: use 1-{max_len} lowercase letters, digits or "
            "'-', starting and ending with a letter or digit"
        )
    return value


class Section(BaseModel):
    # allow_inf_nan=False: every float setting is finite; `inf`/`nan` is refused naming the field.
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


class RunSection(Section):
    """Identity and destination of the run."""

    id: str = Field(description="Run id, a DNS-1123 label (lowercase letters, digits, '-').")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = Field(
        0,
        description="Seed for parameter init, data order and dropout-free RNG; 0 to 2**63 - 1 "
        "(what JAX's PRNG takes).",
    )
    output_uri: str = Field(
        "runs",
        description="Where `<id>/` with artifacts and checkpoints goes: a local path or gs://bucket/prefix.",
    )

    @field_validator("seed", mode="before")
    @classmethod
    def _check_seed(cls, value: object) -> object:
        if _number_outside(value, 0, MAX_SEED):
            raise ValueError(
                f"not a seed JAX's PRNG takes; use an integer from 0 to 2**63 - 1 ({MAX_SEED:,})"
            )
        return value

    @model_validator(mode="after")
    def _check_id(self) -> RunSection:
        check_dns_label(self.id, "run id ")
        return self


GEMMA4_LAYER_TYPES = ("sliding_attention", "full_attention")


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


def gemma4_problem(m: ModelConfig) -> str | None:
    """Why a gemma4_text ModelConfig cannot be built (one sentence naming the field), or None."""
    g = m.gemma4
    if g is None:
        return "model.family 'gemma4_text' needs a [model.gemma4] table (it may be empty)"
    n = m.num_layers
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
    kv_global = g.num_global_kv_heads or m.num_kv_heads
    if m.num_heads % kv_global:
        return (
            f"model.gemma4.num_global_kv_heads ({kv_global}) must divide model.num_heads "
            f"({m.num_heads})"
        )
    moe = {"num_experts": g.num_experts, "top_k_experts": g.top_k_experts,
           "moe_intermediate_size": g.moe_intermediate_size}  # fmt: skip
    if g.enable_moe_block:
        missing = [k for k, v in moe.items() if v is None]
        if missing:
            return f"model.gemma4.enable_moe_block needs model.gemma4.{', model.gemma4.'.join(missing)}"
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
    if m.scan_layers:
        return (
            "model.scan_layers = true is not available for gemma4_text (its layers differ in "
            "head dim, K/V ownership and MLP width); set it to false"
        )
    if m.router_bias_update_rate:
        return "model.router_bias_update_rate is a qwen3_moe setting; gemma4_text's router has no selection bias"
    return None


QWEN3_NEXT_LAYER_TYPES = ("linear_attention", "full_attention")


class Qwen3NextConfig(Section):
    """The `qwen3_next` family's own settings (HF `Qwen3NextConfig`). The shared `[model]` keys
    describe its full-attention layers (`num_heads`, `num_kv_heads`, `head_dim`, `rope_theta`),
    the dense MLP of non-MoE layers (`intermediate_size`) and the routed experts
    (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
    `router_bias_update_rate`; unset experts: every layer is dense)."""

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

    def moe_layers(self, num_layers: int, num_experts: int | None) -> list[bool]:
        """Per layer: does it route through experts (HF's mlp_only_layers / decoder_sparse_step)?"""
        return [
            bool(num_experts)
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(num_layers)
        ]


_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def qwen3_next_problem(m: ModelConfig) -> str | None:
    """Why a qwen3_next ModelConfig cannot be built (one sentence naming the field), or None."""
    q = m.qwen3_next
    if q is None:
        return "model.family 'qwen3_next' needs a [model.qwen3_next] table (it may be empty)"
    n = m.num_layers
    if q.layer_types is not None and len(q.layer_types) != n:
        return (
            f"model.qwen3_next.layer_types has {len(q.layer_types)} entries but model.num_layers "
            f"is {n}; give one type per layer"
        )
    if q.linear_num_value_heads % q.linear_num_key_heads:
        return (
            f"model.qwen3_next.linear_num_value_heads ({q.linear_num_value_heads}) must be a "
            f"multiple of model.qwen3_next.linear_num_key_heads ({q.linear_num_key_heads})"
        )
    bad = [i for i in q.mlp_only_layers if i >= n]
    if bad:
        return (
            f"model.qwen3_next.mlp_only_layers names layer {bad[0]}, but model.num_layers is {n} "
            f"(layers 0-{n - 1})"
        )
    rotated = int(m.resolved_head_dim * q.partial_rotary_factor)
    if rotated < 2 or rotated % 2:
        return (
            f"model.qwen3_next.partial_rotary_factor = {q.partial_rotary_factor} rotates {rotated} "
            f"of model.head_dim = {m.resolved_head_dim} dims; it must rotate an even number, at "
            "least 2"
        )
    given = [k for k in _MOE_KEYS if getattr(m, k) is not None]
    if given and len(given) < len(_MOE_KEYS):
        missing = [k for k in _MOE_KEYS if getattr(m, k) is None]
        return (
            f"model.{given[0]} gives qwen3_next routed experts, which also need "
            f"model.{', model.'.join(missing)}"
        )
    if given and m.num_experts_per_tok > m.num_experts:
        return (
            f"model.num_experts_per_tok ({m.num_experts_per_tok}) exceeds model.num_experts "
            f"({m.num_experts})"
        )
    if m.router_bias_update_rate and not any(q.moe_layers(n, m.num_experts)):
        return (
            "model.router_bias_update_rate needs MoE layers, but this qwen3_next model has none "
            "(set model.num_experts, or check model.qwen3_next.mlp_only_layers)"
        )
    if m.scan_layers:
        return (
            "model.scan_layers = true is not available for qwen3_next (its layers differ in token "
            "mixer and MLP); set it to false"
        )
    return None


class ModelConfig(Section):
    """Decoder sizes (Qwen3, Qwen3-Next and Gemma 4 families). Names follow the Hugging Face config keys."""

    family: Literal["qwen3", "qwen3_moe", "gemma4_text", "qwen3_next"] = Field(
        "qwen3", description="Architecture family."
    )
    gemma4: Gemma4Config | None = Field(
        None, description="gemma4_text: the family's own settings ([model.gemma4])."
    )
    qwen3_next: Qwen3NextConfig | None = Field(
        None, description="qwen3_next: the family's own settings ([model.qwen3_next])."
    )
    init_from: str | None = Field(
        None,
        description=(
            "'hf:PATH': a local Hugging Face model dir (config.json + *.safetensors); sizes come "
            "from its config.json unless given here, and the weights initialise the run."
        ),
    )
    num_experts: PositiveInt | None = Field(
        None, description="qwen3_moe, qwen3_next: routed experts per layer."
    )
    num_experts_per_tok: PositiveInt | None = Field(
        None, description="qwen3_moe, qwen3_next: experts each token uses (top-k)."
    )
    moe_intermediate_size: PositiveInt | None = Field(
        None, description="qwen3_moe, qwen3_next: hidden width of each expert."
    )
    norm_topk_prob: bool = Field(
        True, description="qwen3_moe, qwen3_next: renormalise the top-k router weights to sum to 1."
    )
    router_bias_update_rate: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description=(
            "qwen3_moe, qwen3_next: aux-loss-free load balancing; per step each expert's selection bias moves by "
            "this rate toward equal load (0 = off)."
        ),
    )
    vocab_size: PositiveInt = Field(
        description="Embedding rows; must exceed every token id in the data."
    )
    hidden_size: PositiveInt = Field(description="Residual stream width.")
    num_layers: PositiveInt = Field(description="Decoder blocks.")
    num_heads: PositiveInt = Field(description="Query heads.")
    num_kv_heads: PositiveInt = Field(
        description="Key/value heads (grouped-query attention); divides num_heads."
    )
    head_dim: PositiveInt | None = Field(None, description="Defaults to hidden_size / num_heads.")
    intermediate_size: PositiveInt = Field(description="SwiGLU hidden width.")
    max_position_embeddings: PositiveInt = Field(
        2048, description="Longest sequence the model accepts."
    )
    rope_theta: PositiveFloat = Field(1_000_000.0, description="RoPE base frequency.")
    rms_norm_eps: PositiveFloat = Field(1e-6, description="RMSNorm epsilon.")
    tie_word_embeddings: bool = Field(True, description="LM head shares the embedding matrix.")
    init_std: PositiveFloat = Field(
        0.02, description="Std of the normal initialiser for embeddings and kernels."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Stored parameter dtype."
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Matmul/activation dtype; logits and the loss are always float32."
    )
    remat: Literal["none", "block", "full"] = Field(
        "none",
        description="none: keep all activations; block: per-block remat keeping matmul outputs; full: per-block remat keeping only block inputs.",
    )
    scan_layers: bool = Field(
        True,
        description=(
            "Run the decoder blocks under jax.lax.scan over stacked layer parameters, so compile "
            "time does not grow with depth; false keeps one module per layer."
        ),
    )
    moe_dispatch: Literal["auto", "dense", "sparse"] = Field(
        "auto",
        description=(
            "MoE expert dispatch: dense (every expert on every token; exact, small models only), "
            "sparse (each token visits its top-k experts: sorted, exchanged over mesh.expert, "
            "grouped matmuls), auto (sparse on TPU/GPU or with mesh.expert > 1 or a capacity "
            "factor, else dense)."
        ),
    )
    moe_capacity_factor: PositiveFloat | None = Field(
        None,
        description=(
            "Sparse MoE dispatch: each expert takes at most ceil(factor x tokens x top-k / "
            "experts) of a device's tokens, the rest are dropped (counted in moe_dropped_tokens); "
            "unset = dropless."
        ),
    )
    attention: Literal["auto", "xla", "cudnn", "splash"] = Field(
        "auto",
        description=(
            "Attention kernel: xla (einsum reference), cudnn (jax.nn.dot_product_attention on GPU), "
            "splash (Pallas splash attention on TPU), auto (splash on TPU, cudnn on GPU, else xla)."
        ),
    )

    @property
    def routed_experts(self) -> int | None:
        """Routed experts per MoE layer, or None for a model without MoE layers."""
        if self.family == "gemma4_text":
            g = self.gemma4
            return g.num_experts if g is not None and g.enable_moe_block else None
        if self.family in ("qwen3_moe", "qwen3_next"):
            return self.num_experts
        return None

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: object) -> object:
        # gemma4_text's and qwen3_next's layers differ from each other, so they are never scanned
        # by default.
        own = {"gemma4_text": "gemma4", "qwen3_next": "qwen3_next"}
        if isinstance(data, dict) and data.get("family") in own:
            data = {"scan_layers": False, **data}
            section = own[data["family"]]
            if data.get(section) is None:
                data[section] = {}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly"
            )
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if self.family == "qwen3_moe":
            missing = [k for k in moe if getattr(self, k) is None]
            if missing:
                raise ValueError(f"family qwen3_moe needs {', '.join(missing)}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
                )
        elif self.family != "qwen3_next" and any(getattr(self, k) is not None for k in moe):
            raise ValueError(
                "num_experts/num_experts_per_tok/moe_intermediate_size need family = 'qwen3_moe' "
                "or 'qwen3_next'"
            )
        if self.family == "gemma4_text":
            problem = gemma4_problem(self)
            if problem:
                raise ValueError(problem)
        elif self.gemma4 is not None:
            raise ValueError("model.gemma4 needs model.family = 'gemma4_text'")
        if self.family == "qwen3_next":
            problem = qwen3_next_problem(self)
            if problem:
                raise ValueError(problem)
        elif self.qwen3_next is not None:
            raise ValueError("model.qwen3_next needs model.family = 'qwen3_next'")
        if self.moe_capacity_factor is not None:
            if self.routed_experts is None:
                raise ValueError("model.moe_capacity_factor needs a model with MoE layers")
            if self.moe_dispatch == "dense":
                raise ValueError(
                    "model.moe_capacity_factor drops tokens of the sparse dispatch; the dense "
                    "dispatch drops none: set model.moe_dispatch = 'sparse' (or 'auto')"
                )
        return self


class ScheduleConfig(Section):
    """Learning-rate schedule: linear warmup, then decay to min_lr_ratio × lr."""

    kind: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Shape after warmup."
    )
    warmup_steps: StepCount = Field(0, description="Linear warmup from 0 to lr.")
    decay_steps: PositiveStepCount | None = Field(
        None,
        description=(
            "Steps from start to the end of decay. Unset: the first run's total steps; a resumed run "
            "keeps the value its checkpoint recorded, so raising target_tokens continues at the floor."
        ),
    )
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.1, description="Final lr as a fraction of lr."
    )


class OptimizerConfig(Section):
    """AdamW with a schedule and global-norm clipping."""

    name: Literal["adamw"] = Field("adamw", description="Optimizer.")
    lr: Annotated[float, Field(gt=0, le=10)] = Field(
        3e-4, description="Peak learning rate; at most 10."
    )
    b1: Annotated[float, Field(ge=0, lt=1)] = Field(0.9, description="Adam first-moment decay.")
    b2: Annotated[float, Field(ge=0, lt=1)] = Field(0.95, description="Adam second-moment decay.")
    eps: Annotated[float, Field(gt=0, le=1)] = Field(1e-8, description="Adam epsilon; at most 1.")
    weight_decay: Annotated[float, Field(ge=0, le=10)] = Field(
        0.1,
        description="Decoupled weight decay on matrices (norm scales are not decayed); at most 10.",
    )
    grad_clip_norm: PositiveFloat | None = Field(
        1.0, description="Global-norm clip; unset to disable."
    )
    schedule: ScheduleConfig = ScheduleConfig()


class PrepareConfig(Section):
    """How to make the manifest on first use when it does not exist yet."""

    inputs: list[str] = Field(
        min_length=1,
        description=(
            "Globs (local or gs://) of *.parquet, *.jsonl[.gz|.zst] or text files (any other file is "
            "one document); '{stdlib}' expands to this Python's standard-library folder."
        ),
    )
    text_field: str = Field(
        "text", min_length=1, description="The JSONL key or parquet column holding the text."
    )
    workers: PositiveInt | None = Field(
        None, description="Processes tokenizing at once on the writer host (default: its cores)."
    )
    format: Literal["text", "rollouts"] = Field(
        "text",
        description=(
            "text: documents (files, or JSONL 'text' fields) packed into a token stream; rollouts: "
            "JSONL rollouts (prompt, completion, advantages, old_logprobs), one per row."
        ),
    )
    tokenizer: str = Field("byte", description="'byte' or a path or URI of a tokenizer.json.")
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.05, description="Share of documents held out as the validation split."
    )
    max_bytes: PositiveInt | None = Field(
        None, description="Stop reading inputs after this many bytes."
    )


# Samples per mixture block: each block of a [[data.sources]] mixture holds every source's share of
# it exactly (README "Mixtures"), so a source needs at least 1/MIXTURE_BLOCK of the total weight.
MIXTURE_BLOCK = 4096


def default_source_name(manifest: str) -> str:
    """A source's default name: the folder its manifest.json is in ("data/web/manifest.json": web)."""
    return PurePosixPath(manifest.rstrip("/")).parent.name


class SourceConfig(Section):
    """One prepared-token manifest of a `[[data.sources]]` mixture."""

    manifest: str = Field(
        description=(
            "A mixture source (instead of data.manifest): path or URI of its prepared-token "
            "manifest.json; every source has the same tokenizer and the text (stream) layout."
        )
    )
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        description=(
            "Relative share of the rows drawn from the source; the weights are normalised, so "
            f"they need not sum to 1 (each source needs at least 1/{MIXTURE_BLOCK} of the total)."
        )
    )
    name: str | None = Field(
        None,
        min_length=1,
        description=(
            "The source's label in train rows (tokens_per_source) and errors; default: the "
            "manifest's folder name. Unique within the mixture."
        ),
    )


class DataSource(NamedTuple):
    """One dataset a run reads: its name, manifest, and normalised share of the rows."""

    name: str
    manifest: str
    share: float


class DataConfig(Section):
    manifest: str | None = Field(
        None,
        description="Path or URI of a prepared-token manifest.json (or give [[data.sources]] instead).",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        min_length=1,
        description='A weighted mixture of several manifests instead of data.manifest (README "Mixtures").',
    )
    tokenizer: str | None = Field(
        None,
        description="Expected tokenizer id ('byte' or tokenizer.json path); must match the manifest's.",
    )
    order: Literal["sequential", "shuffle", "document_buffer"] = Field(
        "shuffle",
        description=(
            "sequential: fixed windows in stream order; shuffle: the same windows permuted per epoch; "
            "document_buffer: documents permuted and packed, joins masked out of the loss."
        ),
    )
    prefetch: NonNegativeInt = Field(
        2, description="Global batches the loader prepares ahead (threads)."
    )
    prepare: PrepareConfig | None = Field(
        None, description="Make the manifest on first use if absent."
    )

    @field_validator("sources")
    @classmethod
    def _name_sources(cls, sources: list[SourceConfig] | None) -> list[SourceConfig] | None:
        """Fill each unnamed source's name, so the resolved config and checkpoints record it."""
        if sources is None:
            return None
        out = []
        for i, s in enumerate(sources):
            name = s.name or default_source_name(s.manifest)
            if not name:
                raise ValueError(
                    f"data.sources[{i}] has no name and its manifest {s.manifest!r} is not inside a "
                    f"folder to name it after; set data.sources[{i}].name"
                )
            out.append(s if s.name else s.model_copy(update={"name": name}))
        return out

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if (self.manifest is None) == (self.sources is None):
            given = "both" if self.sources is not None else "neither"
            raise ValueError(
                "set exactly one of data.manifest (one prepared dataset) and [[data.sources]] (a "
                f"weighted mixture of several); this config sets {given}"
            )
        if self.sources is None:
            return self
        if self.prepare is not None:
            raise ValueError(
                "data.prepare makes one manifest and does not combine with [[data.sources]]; "
                "prepare each source with `runtime data prepare` and point its manifest at the result"
            )
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(
                f"data.sources names must be unique, got {names} (a name defaults to the folder of "
                "its manifest); set distinct data.sources[].name values"
            )
        total = sum(s.weight for s in self.sources)
        for i, s in enumerate(self.sources):
            if s.weight / total * MIXTURE_BLOCK < 1:
                raise ValueError(
                    f"data.sources[{i}].weight ({s.weight:g}) is {s.weight / total:.3g} of the total, "
                    f"below 1/{MIXTURE_BLOCK}, the smallest share a mixture draws; raise it or "
                    "remove the source"
                )
        return self

    @property
    def datasets(self) -> list[DataSource]:
        """Every dataset the run reads: the sources with their weights normalised, or the one
        manifest (share 1), named like a source would be."""
        if self.sources is None:
            manifest = self.manifest or ""
            return [DataSource(default_source_name(manifest), manifest, 1.0)]
        total = sum(s.weight for s in self.sources)
        return [DataSource(s.name or "", s.manifest, s.weight / total) for s in self.sources]


class TrainingConfig(Section):
    objective: Literal["cross_entropy", "clipped_pg"] = Field(
        "cross_entropy",
        description=(
            "cross_entropy: next-token loss; clipped_pg: PPO/GRPO-style clipped policy gradient on "
            "the per-token advantages and old log-probs of a rollouts manifest."
        ),
    )
    pg_clip_epsilon: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.2, description="clipped_pg: ratio clip range [1 - eps, 1 + eps]."
    )
    seq_len: PositiveInt = Field(description="Tokens per training row.")
    global_batch_size: PositiveInt = Field(description="Sequences per microbatch across all hosts.")
    gradient_accumulation_steps: PositiveInt = Field(
        1, description="Microbatches per optimizer step."
    )
    target_tokens: Annotated[int, Field(gt=0, le=MAX_TARGET_TOKENS)] = Field(
        description="Train until this many tokens have been consumed; at most 1e16."
    )
    log_every: PositiveStepCount = Field(
        10, description="Steps between live lines and host syncs (every step gets a metrics row)."
    )
    eval_every: StepCount = Field(
        0, description="Steps between evals; 0 runs evals only at the end."
    )
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        "stop",
        description=(
            "A NaN/inf loss, gradient norm or parameter norm: stop ends the run with exit 46 "
            "before anything non-finite is saved; skip_step leaves that step's parameters and "
            "optimizer state unchanged (row `skipped`, a `step_skipped` event) and stops once "
            "max_skipped_steps is exceeded."
        ),
    )
    max_skipped_steps: StepCount = Field(
        10, description="skip_step: the most steps a run may skip before it stops with exit 46."
    )
    loss_chunk_size: NonNegativeInt = Field(
        256,
        description=(
            "Sequence positions per chunk of the loss: the [rows, chunk, vocab] fp32 logits are made "
            "and dropped one chunk at a time (recomputed in the backward pass); 0 = whole sequence."
        ),
    )

    @field_validator("target_tokens", mode="before")
    @classmethod
    def _check_target(cls, value: object) -> object:
        if _number_outside(value, -math.inf, MAX_TARGET_TOKENS):  # too large, inf or NaN
            raise ValueError(
                f"must be a number of tokens up to 1e16 ({MAX_TARGET_TOKENS:,}), already far "
                "beyond any corpus trained on; check the exponent"
            )
        return value

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.gradient_accumulation_steps * self.seq_len

    @property
    def total_steps(self) -> int:
        return -(-self.target_tokens // self.tokens_per_step)


class MeshConfig(Section):
    """Mesh axis sizes; their product must equal the global device count."""

    data: PositiveInt = Field(1, description="Pure data-parallel replicas.")
    expert: PositiveInt = Field(
        1,
        description=(
            "Devices MoE experts are sharded over (expert parallelism; divides the routed "
            "experts); outside the MoE blocks they split the batch like data."
        ),
    )
    fsdp: PositiveInt = Field(
        1, description="Devices parameters and optimizer state are sharded over."
    )
    tensor: PositiveInt = Field(
        1, description="Tensor-parallel devices (heads, MLP hidden, vocab)."
    )
    slices: PositiveInt = Field(
        1,
        description=(
            "Data-parallel groups across the slow (DCN) network: TPU slices, or groups of whole "
            "hosts elsewhere; data/expert/fsdp/tensor then describe one slice."
        ),
    )

    @property
    def size(self) -> int:
        return self.slices * self.data * self.expert * self.fsdp * self.tensor

    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over (slices x data x expert x fsdp)."""
        return self.slices * self.data * self.expert * self.fsdp


class EvalConfig(Section):
    name: str = Field(
        pattern=r"^[a-z0-9_-]+$",
        description="Row label in metrics/eval.jsonl; the first eval picks `best`.",
    )
    split: Literal["validation", "train"] = Field("validation", description="Data split evaluated.")
    batches: PositiveInt = Field(
        4, description="Global batches of global_batch_size rows per eval."
    )


class CheckpointConfig(Section):
    every: StepCount = Field(0, description="Save every N steps; 0 saves only at the end.")
    keep: PositiveInt = Field(3, description="Most recent checkpoints kept (the best is kept too).")
    async_: bool = Field(
        True, alias="async", description="Save in the background while training continues."
    )
    on_signal: bool = Field(
        True, description="On SIGTERM/SIGINT, save a final checkpoint before exiting."
    )


class ArtifactsConfig(Section):
    provenance: Literal["ids", "hash"] = Field(
        "ids", description="Per train row: the record ids that fed the step, or only their hash."
    )


class RuntimeConfig(Section):
    """How hosts find each other and what counts as a lost host."""

    boot_timeout_s: PositiveInt = Field(
        300, description="Seconds a host waits for the coordinator (process 0) before giving up."
    )
    host_loss_timeout_s: PositiveInt = Field(
        60,
        description="Seconds without a peer's heartbeat, or without a host's progress while "
        "stepping, before the hosts exit 43; keep it above the longest training step.",
    )
    storage_retry_s: PositiveFloat = Field(
        120.0,
        description="Seconds a failing gs:// call (5xx, 429, timeout, connection error) is retried "
        "with backoff before the job ends with exit 45 (restartable).",
    )
    owner_lease_s: int = Field(
        60,
        ge=2,
        description=(
            "Seconds the run's owner claim (owner.json) stays valid without renewal; the writer "
            "renews it every few seconds, and a claim older than this is taken over as stale."
        ),
    )


class WandbConfig(Section):
    """Weights & Biases: the same scalars as metrics/train.jsonl, from the writer host only."""

    project: str = Field(min_length=1, description="W&B project the run logs to.")
    entity: str | None = Field(None, description="W&B entity (team or user); default: yours.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="online: stream to the W&B server (needs WANDB_API_KEY or `wandb login`); "
        "offline: a run directory under <run>/wandb/ to `wandb sync` later.",
    )


class MetricsConfig(Section):
    """Metric sinks beside the JSON records (which stay the source of truth); off by default.
    A sink that fails (no network, no key, a missing package) is one warning, never a failed run."""

    tensorboard: bool = Field(
        False, description="Write TensorBoard event files under <run>/tensorboard/."
    )
    wandb: WandbConfig | None = Field(None, description="Log to Weights & Biases.")


class ProfileConfig(Section):
    """A jax.profiler trace of a few steps on every host, into <run>/profile/host-<i>/."""

    start_step: Annotated[int, Field(ge=2, le=MAX_STEPS)] = Field(
        description="First step traced (step 1 of an attempt compiles, so 2 or later)."
    )
    steps: PositiveStepCount = Field(
        2, description="Steps traced; they count as training but not in tokens/s."
    )

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


class RunConfig(Section):
    run: RunSection
    model: ModelConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig
    training: TrainingConfig
    mesh: MeshConfig = MeshConfig()
    evals: list[EvalConfig] = []
    checkpoint: CheckpointConfig = CheckpointConfig()
    artifacts: ArtifactsConfig = ArtifactsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig | None = None

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        t, m = self.training, self.model
        if t.total_steps > MAX_STEPS:
            raise ValueError(
                f"training.target_tokens ({t.target_tokens:,}) takes {t.total_steps:,} steps of "
                f"{t.tokens_per_step:,} tokens, more than the {MAX_STEPS:,} a run counts; lower "
                "target_tokens or raise the tokens per step"
            )
        if t.seq_len > m.max_position_embeddings:
            raise ValueError(
                f"training.seq_len ({t.seq_len}) is longer than model.max_position_embeddings "
                f"({m.max_position_embeddings}); shorten seq_len or raise max_position_embeddings"
            )
        shards = self.mesh.batch_shards
        if t.global_batch_size % shards:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"mesh.slices x data x expert x fsdp = {shards}, the devices each batch is split "
                "over"
            )
        if self.mesh.expert > 1:
            experts = m.routed_experts
            if experts is None:
                raise ValueError(
                    f"mesh.expert = {self.mesh.expert} shards MoE experts, but this model has no "
                    "MoE layers; fold those devices into mesh.data or mesh.fsdp"
                )
            if experts % self.mesh.expert:
                raise ValueError(
                    f"mesh.expert ({self.mesh.expert}) must divide the {experts} routed experts "
                    "of each MoE layer; pick a divisor"
                )
            if m.moe_dispatch == "dense":
                raise ValueError(
                    "model.moe_dispatch = 'dense' runs every expert on every token and cannot "
                    f"use mesh.expert = {self.mesh.expert}; set it to 'sparse' or 'auto'"
                )
        if self.profile and self.profile.start_step > t.total_steps:
            raise ValueError(
                f"profile.start_step ({self.profile.start_step}) is past the run's last step "
                f"({t.total_steps}); pick a step the run reaches"
            )
        names = [e.name for e in self.evals]
        if len(names) != len(set(names)):
            raise ValueError(f"evals: names must be unique, got {names}")
        return self
