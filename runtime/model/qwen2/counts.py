"""Parameter counts and training FLOPs per token of the qwen2 family (runtime/model/flops.py's
convention): Qwen3's, with the q/k/v biases in place of the q/k norms (the MLP activations are
Qwen3's: runtime.model.qwen3.counts.mlp_activations)."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.qwen3.counts import (
    attention_param_count,
    decoder_flops_per_token,
    decoder_param_count,
)


def param_count(cfg: ModelConfig) -> dict[str, int]:
    d = cfg.hidden_size
    attention = attention_param_count(cfg, qk_norm=False, qkv_bias=True)
    return decoder_param_count(cfg, 3 * d * cfg.intermediate_size, attention=attention)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    return decoder_flops_per_token(cfg, param_count(cfg), seq_len)
