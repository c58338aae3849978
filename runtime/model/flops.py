"""Training FLOPs per token, as MaxText and torchtitan count them.

    flops_per_token = 6 * N + 12 * L * T * H * D

N is the parameter count without the input embedding table (a lookup, not a matmul), with the
LM-head matrix counted once even when it is tied to the embedding (the head is a matmul either
way). The second term is attention's QK^T and AV products: per layer and token, 2 matmuls of
2*T*H*D FLOPs forward, times 3 for forward + backward. No causal halving is applied (the same
convention as torchtitan's `get_num_flop_per_token` and MaxText's non-causal count), so MFU here
is directly comparable with theirs; a causal-aware count would be 6 * L * T * H * D.

For qwen3_moe, N counts the router and only the k active experts per token (model FLOPs), while
runtime/moe.py's dense dispatch computes all E experts: its MFU understates the hardware's work.
"""

from __future__ import annotations

from jobspec.run_config import ModelConfig
from runtime.model.qwen3 import param_count as parameter_counts


def flops_per_token(m: ModelConfig, seq_len: int) -> dict[str, float]:
    counts = parameter_counts(m)
    # MoE: model FLOPs of the k active experts per token (the MFU convention), although the dense
    # dispatch in runtime/moe.py computes all E experts; plus the head matmul, tied or not.
    n = counts.get("active_non_embedding", counts["non_embedding"]) + m.vocab_size * m.hidden_size
    attention = 12 * m.num_layers * seq_len * m.num_heads * m.resolved_head_dim
    return {"params_counted": n, "dense": 6 * n, "attention": attention, "total": 6 * n + attention}
