"""Parameter counts and training FLOPs per token of the qwen3_next family (runtime/model/flops.py's
convention)."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.qwen3.counts import attention_param_count
from runtime.model.qwen3_next.decoder import layer_kinds, settings


def _deltanet_params(cfg: ModelConfig) -> int:
    q = settings(cfg)
    d, hk, hv = cfg.hidden_size, q.linear_num_key_heads, q.linear_num_value_heads
    dk, dv = q.linear_key_head_dim, q.linear_value_head_dim
    qkvz = d * (2 * hk * dk + 2 * hv * dv)
    ba = d * 2 * hv
    conv = q.linear_conv_kernel_dim * (2 * hk * dk + hv * dv)
    return qkvz + ba + conv + 2 * hv + dv + hv * dv * d  # + A_log, dt_bias, norm, out_proj


def _mlp_params(cfg: ModelConfig, moe: bool) -> tuple[int, int]:
    """(total, active per token) parameters of one layer's MLP."""
    d = cfg.hidden_size
    if not moe:
        dense = 3 * d * cfg.intermediate_size
        return dense, dense
    e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    assert e is not None and k is not None and f is not None
    shared = 3 * d * settings(cfg).shared_expert_intermediate_size + d  # + shared_expert_gate
    return d * e + 3 * d * f * e + shared, d * e + 3 * d * f * k + shared


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts; active_non_embedding counts the k routed experts a token uses (FLOPs).
    The router bias is not a parameter and is not counted."""
    d, v = cfg.hidden_size, cfg.vocab_size
    blocks = active = 0
    attention = attention_param_count(cfg, query_gate=True)  # q_proj carries [q | gate]
    for kind in layer_kinds(cfg):
        mixer = _deltanet_params(cfg) if kind.linear else attention
        mlp, mlp_active = _mlp_params(cfg, kind.moe)
        blocks += mixer + mlp + 2 * d
        active += mixer + mlp_active + 2 * d
    embedding = v * d
    lm_head = 0 if cfg.tie_word_embeddings else v * d
    return {
        "total": embedding + lm_head + blocks + d,
        "embedding": embedding,
        "lm_head": lm_head,
        "non_embedding": blocks + d,
        "active_non_embedding": active + d,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """6 * N + attention (runtime/model/flops.py's convention), N the active non-embedding
    parameters plus the head matmul. Full-attention layers add 12 * T * H * head_dim (QK^T and
    AV over T keys); DeltaNet layers have no T^2 term: per token and value head the recurrence
    reads the state with k, writes k u^T and reads it with q, 3 products of 2 * dk * dv FLOPs,
    18 * Hv * dk * dv forward + backward, whatever T (the chunked form's within-chunk products
    are counted the same way, as the recurrence they compute)."""
    q = settings(cfg)
    counts = param_count(cfg)
    n = counts["active_non_embedding"] + cfg.vocab_size * cfg.hidden_size
    full = 12 * seq_len * cfg.num_heads * cfg.resolved_head_dim
    linear = 18 * q.linear_num_value_heads * q.linear_key_head_dim * q.linear_value_head_dim
    mixing = sum(linear if kind.linear else full for kind in layer_kinds(cfg))
    return {"params_counted": n, "dense": 6 * n, "attention": mixing, "total": 6 * n + mixing}


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer kept for backward: the dense MLP, or the dense dispatch's
    [E, moe_intermediate] hiddens plus the shared expert's, whichever is larger."""
    out = 3 * cfg.intermediate_size
    if any(kind.moe for kind in layer_kinds(cfg)):
        assert cfg.num_experts is not None and cfg.moe_intermediate_size is not None
        shared = 3 * settings(cfg).shared_expert_intermediate_size
        out = max(out, 3 * cfg.num_experts * cfg.moe_intermediate_size + shared)
    return out
