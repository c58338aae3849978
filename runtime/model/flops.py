"""Training FLOPs per token, as MaxText and torchtitan count them.

    flops_per_token = 6 * N + 12 * L * T * H * D

N is the parameter count without the input embedding table (a lookup, not a matmul), with the
LM-head matrix counted once even when it is tied to the embedding (the head is a matmul either
way). The second term is attention's QK^T and AV products: per layer and token, 2 matmuls of
2*T*H*D FLOPs forward, times 3 for forward + backward. No causal halving is applied (the same
convention as torchtitan's `get_num_flop_per_token` and MaxText's non-causal count), so MFU here
is directly comparable with theirs; a causal-aware count would be 6 * L * T * H * D.

Each family's spec (runtime/model/registry.py) supplies its counts and formula; an MoE family's N
counts the router and only the k active experts per token (model FLOPs), while
runtime/model/moe/layer.py's dense dispatch computes all E experts: its MFU understates the
hardware's work.
"""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.model.registry import spec_for


def parameter_counts(m: ModelConfig) -> dict[str, int]:
    """Parameter counts of m's family (see its spec's `param_count`)."""
    return spec_for(m).param_count(m)


def flops_per_token(m: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token of m's family at seq_len."""
    return spec_for(m).flops_per_token(m, seq_len)
