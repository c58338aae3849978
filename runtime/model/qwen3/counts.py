"""Parameter counts and training FLOPs per token of the Qwen3 decoder (runtime/model/flops.py's
convention), for the dense family and, through `decoder_param_count`, the ones built on it."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig


def attention_param_count(
    cfg: ModelConfig, *, qk_norm: bool = True, qkv_bias: bool = False, query_gate: bool = False
) -> int:
    """q, k, v, o projections and the q/k norms (`qk_norm`) of one layer; `qkv_bias` adds the
    q/k/v biases (qwen2), `query_gate` a per-head output gate in q_proj, twice its width
    (qwen3_next)."""
    d, hd, h, kvh = cfg.hidden_size, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
    q = d * h * hd * (2 if query_gate else 1)
    out = q + 2 * d * kvh * hd + h * hd * d
    if qk_norm:
        out += 2 * hd
    if qkv_bias:
        out += (h + 2 * kvh) * hd
    return out


def decoder_param_count(
    cfg: ModelConfig, mlp: int, active_mlp: int | None = None, attention: int | None = None
) -> dict[str, int]:
    """Parameter counts of a Qwen3Decoder whose per-layer MLP holds `mlp` parameters (and attention
    `attention`, default Qwen3's).

    embedding: the input table (vocab x hidden); lm_head: the separate head (0 when tied);
    non_embedding: everything else (blocks and final norm). The head matmul costs vocab x hidden
    MACs per token whether tied or not, so a FLOPs estimate adds that to non_embedding.
    With `active_mlp` (the MLP parameters one token uses, e.g. an MoE's router and k experts) the
    counts add active_non_embedding (for FLOPs).
    """
    d, v = cfg.hidden_size, cfg.vocab_size
    attn = attention_param_count(cfg) if attention is None else attention
    per_layer = attn + mlp + 2 * d
    embedding = v * d
    lm_head = 0 if cfg.tie_word_embeddings else v * d
    non_embedding = cfg.num_layers * per_layer + d
    counts = {
        "total": embedding + lm_head + non_embedding,
        "embedding": embedding,
        "lm_head": lm_head,
        "non_embedding": non_embedding,
        "per_layer": per_layer,
    }
    if active_mlp is not None:
        counts["active_non_embedding"] = cfg.num_layers * (attn + active_mlp + 2 * d) + d
    return counts


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the dense family (SwiGLU MLP: 3 x hidden x intermediate per layer)."""
    return decoder_param_count(cfg, 3 * cfg.hidden_size * cfg.intermediate_size)


def decoder_flops_per_token(
    cfg: ModelConfig, counts: dict[str, int], seq_len: int
) -> dict[str, float]:
    """6 * N + 12 * L * T * H * D from `counts` (see runtime/model/flops.py for the convention).

    N is active_non_embedding when present (model FLOPs of the parameters a token uses), else
    non_embedding, plus the head matmul (vocab x hidden) tied or not.
    """
    n = (
        counts.get("active_non_embedding", counts["non_embedding"])
        + cfg.vocab_size * cfg.hidden_size
    )
    attention = 12 * cfg.num_layers * seq_len * cfg.num_heads * cfg.resolved_head_dim
    return {"params_counted": n, "dense": 6 * n, "attention": attention, "total": 6 * n + attention}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token of the dense family."""
    return decoder_flops_per_token(cfg, param_count(cfg), seq_len)


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer kept for the backward pass (preflight's estimate)."""
    return 3 * cfg.intermediate_size
