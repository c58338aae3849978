"""Parameter counts and training FLOPs per token of the gpt_oss family (runtime/model/flops.py's
convention)."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.gpt_oss.decoder import settings, sliding_layers


def _attention_params(cfg: ModelConfig) -> int:
    """q, k, v, o projections (and their biases with attention_bias) and the sinks."""
    d, hd, h, kvh = cfg.hidden_size, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
    out = 2 * d * h * hd + 2 * d * kvh * hd + h
    if settings(cfg).attention_bias:
        out += (h + 2 * kvh) * hd + d
    return out


def _expert_params(cfg: ModelConfig) -> int:
    """One expert: gate_up [D, 2I] and its bias, down [I, D] and its bias."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    return 3 * d * f + 2 * f + d


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts; active_non_embedding counts the router and the k experts a token uses
    (for FLOPs)."""
    g = settings(cfg)
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    e, k = g.num_local_experts, g.num_experts_per_tok
    shared = _attention_params(cfg) + d * e + e + 2 * d  # attention, router, the two norms
    per_layer = shared + e * _expert_params(cfg)
    embedding = v * d
    lm_head = 0 if cfg.tie_word_embeddings else v * d
    return {
        "total": embedding + lm_head + n * per_layer + d,
        "embedding": embedding,
        "lm_head": lm_head,
        "non_embedding": n * per_layer + d,
        "per_layer": per_layer,
        "active_non_embedding": n * (shared + k * _expert_params(cfg)) + d,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """6 * N + attention, N the active non-embedding parameters plus the head matmul; attention
    12 * H * hd * keys per layer, keys = min(sliding_window, T) on sliding layers (what the
    window lets them compute), T on full ones."""
    window = settings(cfg).sliding_window
    n = param_count(cfg)["active_non_embedding"] + cfg.vocab_size * cfg.hidden_size
    per_key = 12 * cfg.num_heads * cfg.resolved_head_dim
    keys = sum(min(window, seq_len) if s else seq_len for s in sliding_layers(cfg))
    return {"params_counted": n, "dense": 6 * n, "attention": per_key * keys,
            "total": 6 * n + per_key * keys}  # fmt: skip


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer kept for backward: the dense dispatch's fused [E, 2I]
    gate/up and [E, I] hidden for every expert, not only the k chosen ones."""
    return 3 * settings(cfg).num_local_experts * cfg.intermediate_size
