"""The qwen3_moe family's HF name map (`Qwen3MoeForCausalLM`): Qwen3's, with the router
`mlp.gate` and per-expert SwiGLU projections as the MLP.

The router bias (runtime/model/moe/layer.py `router_bias`) is not a parameter and has no HF tensor.
"""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, in_layer
from runtime.model.qwen3.hf_names import decoder_names


def moe_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """Router `mlp.gate` and expert e's `mlp.experts.{e}.{gate,up,down}_proj` (slice e of the
    stacked experts), as HF's saved checkpoints hold them."""
    assert cfg.num_experts is not None
    out = [in_layer(cfg, i, ("mlp", "gate", "kernel"), "mlp.gate.weight", True)]
    for e in range(cfg.num_experts):
        out += [
            in_layer(cfg, i, ("mlp", "experts", f"{n}_proj"), f"mlp.experts.{e}.{n}_proj.weight", True, e)
            for n in ("gate", "up", "down")
        ]  # fmt: skip
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    return decoder_names(cfg, mlp=moe_names)
