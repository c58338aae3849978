"""The model-family registry: the `Decoder` interface every family's model offers, and one
`ModelSpec` per `model.family` (a line in FAMILIES), looked up with `spec_for`.

A family is a folder, `runtime/model/<family>/` (its modules, HF name map and counts), whose
contract (config class, checks, HF config.json) is `jobspec/families/<family>.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry
from runtime.model import gemma4_text, qwen2, qwen3, qwen3_moe, qwen3_next
from runtime.model.moe import MoEStats


class Decoder(Protocol):
    """What the train step, the evaluator, generation and HF export use of a family's model
    (runtime/model/decoder.py's `DecoderBase` supplies the shared part). Token ids, positions
    and segment ids are int32 [B, T]."""

    cfg: ModelConfig
    #: Logits become c * tanh(logits / c) when set; the chunked loss applies it too.
    logit_softcap: float | None

    def __call__(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """float32 logits [B, T, vocab]."""
        ...

    def forward_with_loads(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """The logits and the MoE layers' expert loads [layers, experts] (None without MoE)."""
        ...

    def forward_hidden(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """The final-normed hidden states [B, T, D] and the MoE layers' stats stacked."""
        ...

    def head_kernel(self) -> jax.Array:
        """The LM head [hidden, vocab] in compute dtype (the loss applies it chunk by chunk)."""
        ...

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states [B, T, D] -> float32 logits [B, T, vocab]."""
        ...

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> Any:
        """An empty decoding cache (a pytree) of max_len positions per sequence."""
        ...

    def decode(self, inputs: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """T new tokens against the cache -> (their logits, the cache with them)."""
        ...


@dataclass(frozen=True)
class ModelSpec:
    """Everything the runtime needs to know about one model family."""

    #: Builds the family's model from (cfg, *, rngs, eager_sharding).
    build: Callable[..., Decoder]
    #: cfg -> the NNX-path <-> HF state-dict name map (runtime/hf/names.py's entries).
    hf_names: Callable[[ModelConfig], list[Entry]]
    #: cfg -> parameter counts ("total", "embedding", "lm_head", "non_embedding", ...).
    param_count: Callable[[ModelConfig], dict[str, int]]
    #: (cfg, seq_len) -> training FLOPs per token (runtime/model/flops.py's convention).
    flops_per_token: Callable[[ModelConfig, int], dict[str, float]]
    #: cfg -> MLP values per token and layer kept for backward (preflight's activation estimate).
    mlp_activations: Callable[[ModelConfig], int]
    #: cfg -> HF tensor names a checkpoint may hold that the model does not use (import skips).
    hf_ignored: Callable[[ModelConfig], set[str]] = lambda cfg: set()
    #: Name prefixes of further HF tensors import skips (e.g. a multi-token-prediction head).
    hf_ignored_prefixes: tuple[str, ...] = ()


# fmt: off
FAMILIES: dict[str, ModelSpec] = {
    "qwen3": ModelSpec(qwen3.build, qwen3.hf_names, qwen3.param_count, qwen3.flops_per_token, qwen3.mlp_activations),
    "qwen3_moe": ModelSpec(qwen3_moe.build, qwen3_moe.hf_names, qwen3_moe.param_count, qwen3_moe.flops_per_token, qwen3_moe.mlp_activations),
    "gemma4_text": ModelSpec(gemma4_text.build, gemma4_text.hf_names, gemma4_text.param_count, gemma4_text.flops_per_token, gemma4_text.mlp_activations, gemma4_text.hf_ignored),
    "qwen3_next": ModelSpec(qwen3_next.build, qwen3_next.hf_names, qwen3_next.param_count, qwen3_next.flops_per_token, qwen3_next.mlp_activations, hf_ignored_prefixes=qwen3_next.HF_IGNORED_PREFIXES),
    "qwen2": ModelSpec(qwen2.build, qwen2.hf_names, qwen2.param_count, qwen2.flops_per_token, qwen2.mlp_activations),
}
# fmt: on


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The spec of a ModelConfig's family; ValueError naming model.family."""
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise ValueError(
            f"model.family {cfg.family!r} is not a registered model family "
            f"(known: {', '.join(FAMILIES)}; see runtime/model/registry.py)"
        ) from None


def build_model_module(
    cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False
) -> Decoder:
    """Build cfg's family's model; a config changed without validation (`model_copy`) is
    checked against its family first."""
    problem = cfg.family_problem()
    if problem:
        raise ValueError(problem)
    return spec_for(cfg).build(cfg, rngs=rngs, eager_sharding=eager_sharding)
