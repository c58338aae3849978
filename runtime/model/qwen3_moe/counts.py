"""Parameter counts and training FLOPs per token of the qwen3_moe family."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.qwen3.counts import decoder_flops_per_token, decoder_param_count


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Decoder counts with the router (hidden x E) plus E experts as the MLP.

    active_non_embedding counts the router and only the k experts a token uses (for FLOPs). The
    router bias is not a parameter and is not counted.
    """
    d = cfg.hidden_size
    e, k, mf = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    assert e is not None and k is not None and mf is not None
    return decoder_param_count(cfg, mlp=d * e + 3 * d * mf * e, active_mlp=d * e + 3 * d * mf * k)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Model FLOPs of the k active experts per token (the MFU convention), although the dense
    dispatch in runtime/model/moe/layer.py computes all E experts: MFU understates the hardware's
    work."""
    return decoder_flops_per_token(cfg, param_count(cfg), seq_len)


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer: the dense dispatch keeps [B, T, E, moe_intermediate]
    arrays for every expert, not only the k chosen ones."""
    assert cfg.num_experts is not None and cfg.moe_intermediate_size is not None
    return 3 * cfg.num_experts * cfg.moe_intermediate_size
