"""ModelConfig: the `[model]` keys every family shares, and the choice of family.

Each family subclasses it in `jobspec/families/<family>.py` with its `family` literal, its own
keys and checks, and how its HF config.json reads and writes; `jobspec/families/__init__.py`
registers it. `ModelConfig(**keys)` and `ModelConfig.model_validate(keys)` build the class of the
family `keys` names (qwen3 when none). Every family reads and dumps the same keys: another
family's own table is null (a resolved.json or a checkpoint's compatibility record holds every
key whatever the family, as it always has). Nothing here imports jax.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    create_model,
    model_serializer,
    model_validator,
)

from jobspec.section import PositiveFloat, PositiveInt, Section

#: The families that read the shared routed-experts keys, as their descriptions name them.
_EXPERT_FAMILIES = "qwen3_moe, qwen3_next, qwen3_5_moe_text, deepseek_v3"
#: The family of a `[model]` table that names none.
DEFAULT_FAMILY = "qwen3"
#: The shared routed-experts sizes, for the families that take them (`takes_expert_keys`).
EXPERT_KEYS: tuple[str, ...] = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


#: Every family's class by name, in registry order. Filled by `jobspec/families/__init__.py`
#: (the registration, which imports each family's module); importing this module runs the package's
#: `__init__` first, so it is complete before any config is validated. Kept here, not imported
#: from the package, because each family's module imports this one.
MODEL_CONFIGS: dict[str, type[ModelConfig]] = {}


def _registry() -> dict[str, type[ModelConfig]]:
    return MODEL_CONFIGS


@functools.cache
def _family_name() -> type[BaseModel]:
    """A `[model]` table's family alone: an unknown one fails at `family`, listing the known
    (the registry's names as one Literal, so the message lists them)."""
    return create_model(
        "FamilyName",
        __config__=ConfigDict(extra="ignore"),
        family=(Literal[tuple(MODEL_CONFIGS)], DEFAULT_FAMILY),
    )


def family_class(data: dict[str, Any]) -> type[ModelConfig]:
    """The class of the family `data` names; a ValidationError at `family` for an unknown one."""
    return _registry()[_family_name().model_validate(data).family]


def own_keys() -> dict[str, str]:
    """Every family's own keys (beyond these shared ones), in registry order -> its family."""
    return {
        key: name
        for name, cls in _registry().items()
        for key in cls.model_fields
        if key not in ModelConfig.model_fields
    }


class ModelConfig(Section):
    """Decoder sizes; names follow the Hugging Face config keys."""

    family: str = Field(DEFAULT_FAMILY, description="Architecture family.")
    init_from: str | None = Field(
        None,
        description=(
            "'hf:PATH': a local Hugging Face model dir (config.json + *.safetensors); sizes come "
            "from its config.json unless given here, and the weights initialise the run."
        ),
    )
    num_experts: PositiveInt | None = Field(
        None, description=f"{_EXPERT_FAMILIES}: routed experts per layer."
    )
    num_experts_per_tok: PositiveInt | None = Field(
        None, description=f"{_EXPERT_FAMILIES}: experts each token uses (top-k)."
    )
    moe_intermediate_size: PositiveInt | None = Field(
        None, description=f"{_EXPERT_FAMILIES}: hidden width of each expert."
    )
    norm_topk_prob: bool = Field(
        True,
        description=(
            "qwen3_moe, qwen3_next, deepseek_v3: renormalise the top-k router weights to sum to "
            "1 (qwen3_5_moe_text and gpt_oss always do: false is refused)."
        ),
    )
    router_bias_update_rate: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description=(
            f"{_EXPERT_FAMILIES}: aux-loss-free load balancing; per step each expert's "
            "selection bias moves by this rate toward equal load (0 = off)."
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
    remat: Literal["none", "block", "attention", "attention_host", "full", "auto"] = Field(
        "none",
        description=(
            "What each block keeps for the backward pass (the rest is recomputed from its input): "
            "none: all activations; block: matmul outputs; attention: the splash kernel's output "
            "and log-sum-exp (its forward is not run again); attention_host: the same in host "
            "memory (HBM as full; copied out and back each step); full: only block inputs; "
            "auto: attention where the step compiled with it fits the devices (splash attention "
            "on a TPU), else full (a second compile where attention does not fit)."
        ),
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

    #: Does the family read the shared routed-experts keys (EXPERT_KEYS)?
    takes_expert_keys: ClassVar[bool] = False
    #: HF `model_type`s besides the family's own name whose config.json it reads.
    hf_aliases: ClassVar[tuple[str, ...]] = ()
    #: Further [model] keys an HF config fills (beyond jobspec.hf_config.HF_KEYS and the
    #: family's own tables), so a table holding them needs no lookup.
    hf_keys: ClassVar[tuple[str, ...]] = ()
    #: Whether the layers run under jax.lax.scan unless the table says: false for a family whose
    #: layers differ from each other (they cannot stack).
    scanned_by_default: ClassVar[bool] = True

    # ---- the family's own part (overridden in jobspec/families/<family>.py) -------------------

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        """`[model]` keys (our names) this family's HF config.json determines; ConfigError
        naming `what` for a setting jaxjob cannot load."""
        raise NotImplementedError(cls.__name__)

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        """The HF config.json dict for a resolved `[model]` section (our names) of this family."""
        raise NotImplementedError(cls.__name__)

    def family_problem(self) -> str | None:
        """Why this family cannot build the model (one sentence naming the field), or None."""
        return None

    @property
    def routed_experts(self) -> int | None:
        """Routed experts per MoE layer, or None for a model without MoE layers."""
        return self.num_experts if self.takes_expert_keys else None

    # ---- shared ---------------------------------------------------------------------------

    @classmethod
    def family_name(cls) -> str:
        return typing.get_args(cls.model_fields["family"].annotation)[0]

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def __new__(cls, *args: Any, **data: Any) -> ModelConfig:
        # ModelConfig(**keys) builds the family's own class (whose __init__ then validates).
        return super().__new__(family_class(data) if cls is ModelConfig else cls)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> ModelConfig:
        if cls is ModelConfig and isinstance(obj, dict):
            return family_class(obj).model_validate(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @model_validator(mode="before")
    @classmethod
    def _others_tables(cls, data: Any) -> Any:
        """Another family's own key is accepted as null (every dump holds it) and refused set;
        this family's own table may be null or left out (its defaults), and scan_layers defaults
        to the family's `scanned_by_default`."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, family in own_keys().items():
            if key not in data:
                continue
            if key not in cls.model_fields:
                if data[key] is not None:
                    raise ValueError(f"model.{key} needs model.family = {family!r}")
                del out[key]
            elif data[key] is None:
                del out[key]  # the field's default table
        if not cls.scanned_by_default:
            out.setdefault("scan_layers", False)
        return out

    @model_serializer(mode="wrap")
    def _every_key(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        """Every family's keys, in one order: family, each family's own table (null but this
        one's), the shared keys."""
        out = handler(self)
        if info.exclude_none or info.exclude_unset or info.include or info.exclude:
            return out
        tables = {key: out.get(key) for key in own_keys()}
        return {
            "family": out["family"],
            **tables,
            **{k: v for k, v in out.items() if k not in tables},
        }

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly"
            )
        if not self.takes_expert_keys and any(getattr(self, k) is not None for k in EXPERT_KEYS):
            takers = [repr(n) for n, c in _registry().items() if c.takes_expert_keys]
            raise ValueError(f"{'/'.join(EXPERT_KEYS)} need family = {' or '.join(takers)}")
        problem = self.family_problem()
        if problem:
            raise ValueError(problem)
        if self.moe_capacity_factor is not None:
            if self.routed_experts is None:
                raise ValueError("model.moe_capacity_factor needs a model with MoE layers")
            if self.moe_dispatch == "dense":
                raise ValueError(
                    "model.moe_capacity_factor drops tokens of the sparse dispatch; the dense "
                    "dispatch drops none: set model.moe_dispatch = 'sparse' (or 'auto')"
                )
        return self
