"""Parameter counts and training FLOPs per token of the qwen3_5 families: qwen3_next's of the
equivalent qwen3_next config (the four DeltaNet input projections hold the same weights as
Qwen3-Next's two fused ones, and the layers compute the same)."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.qwen3_5.decoder import as_qwen3_next
from runtime.model.qwen3_next import counts


def param_count(cfg: ModelConfig) -> dict[str, int]:
    return counts.param_count(as_qwen3_next(cfg))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    return counts.flops_per_token(as_qwen3_next(cfg), seq_len)


def mlp_activations(cfg: ModelConfig) -> int:
    return counts.mlp_activations(as_qwen3_next(cfg))
