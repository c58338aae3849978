"""The "qwen3_moe" family's decoder: the Qwen3 decoder with a sparse MoE MLP.

Each layer's MLP is `runtime.model.moe.layer.SparseMoE` (router `mlp.gate` + E stacked SwiGLU
experts; paths and math documented there); everything else is
`runtime.model.qwen3.decoder.Qwen3Decoder`.
"""

from __future__ import annotations

from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.moe.layer import SparseMoE
from runtime.model.qwen3.decoder import Qwen3Decoder


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Qwen3Decoder:
    """The Qwen3 decoder with `SparseMoE` as every layer's MLP."""
    return Qwen3Decoder(cfg, rngs=rngs, eager_sharding=eager_sharding, mlp_factory=SparseMoE)
