"""The model-family registry: one `ModelSpec` per `model.family`, looked up with `spec_for`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flax import nnx

from jobspec.run_config import ModelConfig
from runtime.hf import names
from runtime.model import gemma4, qwen3, qwen3_moe, qwen3_next


def _no_check(cfg: ModelConfig) -> None:
    """A family without extra validation beyond ModelConfig's own."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the runtime needs to know about one model family."""

    name: str
    #: Builds the nnx Module (the Decoder) from (cfg, *, rngs, eager_sharding).
    build: Callable[..., nnx.Module]
    #: cfg -> the NNX-path <-> HF state-dict name map (runtime/hf/names.py).
    hf_names: Callable[[ModelConfig], list[names.Entry]]
    #: cfg -> parameter counts ("total", "embedding", "lm_head", "non_embedding", ...).
    param_count: Callable[[ModelConfig], dict[str, int]]
    #: (cfg, seq_len) -> training FLOPs per token (runtime/model/flops.py's convention).
    flops_per_token: Callable[[ModelConfig, int], dict[str, float]]
    #: cfg -> MLP values per token and layer kept for backward (preflight's activation estimate).
    mlp_activations: Callable[[ModelConfig], int]
    #: Extra validation of a ModelConfig for this family; raises ValueError.
    check_config: Callable[[ModelConfig], None] = _no_check
    #: cfg -> HF tensor names a checkpoint may hold that the model does not use (import skips).
    hf_ignored: Callable[[ModelConfig], set[str]] = lambda cfg: set()
    #: Name prefixes of further HF tensors import skips (e.g. a multi-token-prediction head).
    hf_ignored_prefixes: tuple[str, ...] = ()


# fmt: off
FAMILIES: dict[str, ModelSpec] = {
    "qwen3": ModelSpec("qwen3", qwen3.build, names.qwen3_names, qwen3.param_count, qwen3.flops_per_token, qwen3.mlp_activations),
    "qwen3_moe": ModelSpec("qwen3_moe", qwen3_moe.build, names.qwen3_moe_names, qwen3_moe.param_count, qwen3_moe.flops_per_token, qwen3_moe.mlp_activations, qwen3_moe.check_config),
    "gemma4_text": ModelSpec("gemma4_text", gemma4.build, names.gemma4_names, gemma4.param_count, gemma4.flops_per_token, gemma4.mlp_activations, gemma4.check_config, names.gemma4_ignored),
    "qwen3_next": ModelSpec("qwen3_next", qwen3_next.build, names.qwen3_next_names, qwen3_next.param_count, qwen3_next.flops_per_token, qwen3_next.mlp_activations, qwen3_next.check_config, hf_ignored_prefixes=("mtp.",)),
}
# fmt: on


def spec_for(cfg_or_family: ModelConfig | str) -> ModelSpec:
    """The spec of a family name or of a ModelConfig's family; ValueError naming model.family."""
    family = cfg_or_family if isinstance(cfg_or_family, str) else cfg_or_family.family
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"model.family {family!r} is not a registered model family "
            f"(known: {', '.join(FAMILIES)}; see runtime/model/registry.py)"
        ) from None


def build_model_module(
    cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False
) -> nnx.Module:
    """Check cfg against its family and build that family's module."""
    spec = spec_for(cfg)
    spec.check_config(cfg)
    return spec.build(cfg, rngs=rngs, eager_sharding=eager_sharding)
