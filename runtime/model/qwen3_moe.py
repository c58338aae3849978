"""The "qwen3_moe" family's own pieces: the Qwen3 decoder with a sparse MoE MLP, and its counts.

Each layer's MLP is `runtime.model.moe.SparseMoE` (router `mlp.gate` + E stacked SwiGLU experts;
paths and math documented there); everything else is `runtime.model.qwen3.Decoder`.
"""

from __future__ import annotations

from flax import nnx

from jobspec.run_config import ModelConfig
from runtime.model.moe import SparseMoE
from runtime.model.qwen3 import Decoder, decoder_flops_per_token, decoder_param_count

_MOE_KEYS: tuple[str, ...] = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def check_config(cfg: ModelConfig) -> None:
    """ValueError unless the MoE sizes are set (ModelConfig's validator already ensures it)."""
    missing = [k for k in _MOE_KEYS if getattr(cfg, k) is None]
    if missing:
        raise ValueError(f"model.family {cfg.family!r} needs model.{', model.'.join(missing)}")


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Decoder:
    """The Qwen3 decoder with `SparseMoE` as every layer's MLP."""
    return Decoder(cfg, rngs=rngs, eager_sharding=eager_sharding, mlp_factory=SparseMoE)


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
    dispatch in runtime/model/moe.py computes all E experts: MFU understates the hardware's work."""
    return decoder_flops_per_token(cfg, param_count(cfg), seq_len)


def mlp_activations(cfg: ModelConfig) -> int:
    """MLP values per token and layer: the dense dispatch keeps [B, T, E, moe_intermediate]
    arrays for every expert, not only the k chosen ones."""
    assert cfg.num_experts is not None and cfg.moe_intermediate_size is not None
    return 3 * cfg.num_experts * cfg.moe_intermediate_size
