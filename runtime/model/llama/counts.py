"""Parameter counts and training FLOPs per token of the llama and mistral families
(runtime/model/flops.py's convention): the Qwen3 decoder's without q/k norms, with the optional
biases; a sliding window counts the keys a token sees (min(window, T)), not T."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.llama.decoder import options
from runtime.model.qwen3.counts import attention_param_count, decoder_param_count


def param_count(cfg: ModelConfig) -> dict[str, int]:
    opts = options(cfg)
    d, f = cfg.hidden_size, cfg.intermediate_size
    attention = attention_param_count(cfg, qk_norm=False, qkv_bias=opts.attention_bias)
    attention += d if opts.attention_bias else 0  # o_proj's bias
    mlp = 3 * d * f + ((2 * f + d) if opts.mlp_bias else 0)
    return decoder_param_count(cfg, mlp, attention=attention)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """6 * N + 12 * L * keys * H * D, keys = min(sliding_window, T) (T without a window)."""
    window = options(cfg).sliding_window
    keys = seq_len if window is None else min(window, seq_len)
    n = param_count(cfg)["non_embedding"] + cfg.vocab_size * cfg.hidden_size
    attention = 12 * cfg.num_layers * keys * cfg.num_heads * cfg.resolved_head_dim
    return {"params_counted": n, "dense": 6 * n, "attention": attention, "total": 6 * n + attention}
