"""What a model family offers the runtime: the `FamilyModel` interface its model meets, and its
`ModelSpec` (the builder, HF name map, counts), which `runtime/model/<package>/__init__.py`
exports as `SPECS` for runtime/model/registry.py to find."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry
from runtime.model.moe.layer import MoEStats


class FamilyModel(Protocol):
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
    build: Callable[..., FamilyModel]
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
    #: A checkpoint's tensors -> the same values under the names the map uses (e.g. fused expert
    #: stacks split per expert, runtime/hf/experts.py); import applies it before the map.
    hf_read: Callable[[dict[str, Any]], dict[str, Any]] = lambda tensors: tensors
    #: The map's tensors -> the layout export writes (hf_read's inverse).
    hf_write: Callable[[dict[str, Any]], dict[str, Any]] = lambda tensors: tensors
