"""Parameter counts and training FLOPs per token of the gemma4_text family (runtime/model/flops.py's
convention)."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.gemma4_text.decoder import LayerShape, layer_shapes, settings


def _layer_counts(cfg: ModelConfig, s: LayerShape, i: int) -> tuple[int, int, int]:
    """(attention, MLP and MoE total, MLP and MoE active per token) parameters of layer i,
    norms and scalars included in attention's share."""
    g = settings(cfg)
    d, h = cfg.hidden_size, cfg.num_heads
    attn = d * h * s.head_dim * 2 + s.head_dim  # q_proj, o_proj, q_norm
    if s.source == i:
        attn += d * s.kv_heads * s.head_dim * (1 if s.k_eq_v else 2) + s.head_dim  # k/v, k_norm
    attn += 4 * d + 1  # the four sandwich norms and layer_scalar
    mlp = 3 * d * s.mlp_width
    active = mlp
    if g.hidden_size_per_layer_input:
        p = g.hidden_size_per_layer_input
        attn += 2 * d * p + d
    if g.enable_moe_block:
        e, k, f = g.num_experts, g.top_k_experts, g.moe_intermediate_size
        router = d * e + d + e
        mlp += router + 3 * d * f * e + 3 * d
        active += router + 3 * d * f * k + 3 * d
    return attn, mlp, active


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts; `embedding` holds both lookup tables (the per-layer one included),
    `per_layer_embedding` the second alone; active_non_embedding counts k experts per token."""
    g = settings(cfg)
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    blocks = active = 0
    for i, s in enumerate(layer_shapes(cfg)):
        attn, mlp, act = _layer_counts(cfg, s, i)
        blocks += attn + mlp
        active += attn + act
    per_layer_table = 0
    top = d  # final norm
    if g.hidden_size_per_layer_input:
        p = g.hidden_size_per_layer_input
        per_layer_table = (g.vocab_size_per_layer_input or v) * n * p
        top += d * n * p + p
    embedding = v * d + per_layer_table
    lm_head = 0 if cfg.tie_word_embeddings else v * d
    non_embedding = blocks + top
    return {
        "total": embedding + lm_head + non_embedding,
        "embedding": embedding,
        "per_layer_embedding": per_layer_table,
        "lm_head": lm_head,
        "non_embedding": non_embedding,
        "active_non_embedding": active + top,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """6 * N + attention, N the active non-embedding parameters plus the head matmul; attention
    12 * H * hd * keys per layer, keys = min(window, T) on sliding layers (sliding-window
    attention counted as what it computes), T on full ones (runtime/model/flops.py's convention)."""
    g = settings(cfg)
    counts = param_count(cfg)
    n = counts["active_non_embedding"] + cfg.vocab_size * cfg.hidden_size
    attention_flops = 0
    for s in layer_shapes(cfg):
        keys = min(g.sliding_window, seq_len) if s.sliding else seq_len
        attention_flops += 12 * keys * cfg.num_heads * s.head_dim
    return {
        "params_counted": n,
        "dense": 6 * n,
        "attention": attention_flops,
        "total": 6 * n + attention_flops,
    }


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer kept for backward: the widest dense MLP, plus every
    expert's [E, 2I] hidden under the dense dispatch."""
    g = settings(cfg)
    widest = max(s.mlp_width for s in layer_shapes(cfg))
    out = 3 * widest
    if g.enable_moe_block:
        out += 3 * g.num_experts * g.moe_intermediate_size
    return out
