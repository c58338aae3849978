"""Parameter counts and training FLOPs per token of the deepseek_v3 family
(runtime/model/flops.py's convention)."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.deepseek_v3.decoder import moe_layers
from runtime.model.deepseek_v3.mla import settings


def mla_param_count(cfg: ModelConfig) -> int:
    """One layer's latent attention: projections and the latent norms."""
    d = settings(cfg)
    hidden, h = cfg.hidden_size, cfg.num_heads
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    if d.q_lora_rank is None:
        q = hidden * h * qk
    else:
        q = hidden * d.q_lora_rank + d.q_lora_rank + d.q_lora_rank * h * qk
    kv_a = hidden * (d.kv_lora_rank + d.qk_rope_head_dim) + d.kv_lora_rank
    kv_b = d.kv_lora_rank * h * (d.qk_nope_head_dim + d.v_head_dim)
    return q + kv_a + kv_b + h * d.v_head_dim * hidden


def _mlp_params(cfg: ModelConfig, moe: bool) -> tuple[int, int]:
    """(total, active per token) parameters of one layer's MLP."""
    hidden = cfg.hidden_size
    if not moe:
        dense = 3 * hidden * cfg.intermediate_size
        return dense, dense
    e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    assert e is not None and k is not None and f is not None
    shared = 3 * hidden * f * settings(cfg).n_shared_experts
    return hidden * e + 3 * hidden * f * e + shared, hidden * e + 3 * hidden * f * k + shared


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts; active_non_embedding counts the k routed experts a token uses (FLOPs).
    The router bias is not a parameter and is not counted (nor do transformers' parameters)."""
    hidden, v = cfg.hidden_size, cfg.vocab_size
    attention = mla_param_count(cfg)
    blocks = active = 0
    for moe in moe_layers(cfg):
        mlp, mlp_active = _mlp_params(cfg, moe)
        blocks += attention + mlp + 2 * hidden
        active += attention + mlp_active + 2 * hidden
    embedding = v * hidden
    lm_head = 0 if cfg.tie_word_embeddings else v * hidden
    return {
        "total": embedding + lm_head + blocks + hidden,
        "embedding": embedding,
        "lm_head": lm_head,
        "non_embedding": blocks + hidden,
        "active_non_embedding": active + hidden,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """6 * N + attention: N the active non-embedding parameters plus the head matmul; per layer
    QK^T over nope + rope dims and AV over v_head_dim, 2 * T * H * dims each forward, times 3."""
    d = settings(cfg)
    n = param_count(cfg)["active_non_embedding"] + cfg.vocab_size * cfg.hidden_size
    dims = d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim
    attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * dims
    return {"params_counted": n, "dense": 6 * n, "attention": attention, "total": 6 * n + attention}


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer kept for backward: the dense MLP, or the dense dispatch's
    [E, moe_intermediate] hiddens plus the shared experts', whichever is larger."""
    out = 3 * cfg.intermediate_size
    if any(moe_layers(cfg)):
        assert cfg.num_experts is not None and cfg.moe_intermediate_size is not None
        shared = 3 * cfg.moe_intermediate_size * settings(cfg).n_shared_experts
        out = max(out, 3 * cfg.num_experts * cfg.moe_intermediate_size + shared)
    return out
