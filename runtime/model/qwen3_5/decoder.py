"""The "qwen3_5_text" and "qwen3_5_moe_text" families: Qwen3.5's hybrid decoder, computing what
HF `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (transformers 5.23,
`models/qwen3_5{,_moe}/modeling_qwen3_5{,_moe}.py`) do, on Qwen3-Next's modules
(runtime/model/qwen3_next/decoder.py, whose docstring describes the layers).

What differs from Qwen3-Next:

- The DeltaNet input projections are four plain ones, not two fused per key-head group:
  `in_proj_qkv` ([q (Hk*dk) | k (Hk*dk) | v (Hv*dv)], each head-major, the order the conv's
  channels already have), `in_proj_z` (Hv*dv), `in_proj_b` and `in_proj_a` (Hv each).
- RoPE is HF's interleaved M-RoPE over (time, height, width) position ids; a text token's three
  ids are equal, so on text it is exactly Qwen3-Next's partial RoPE (the rotated first
  `partial_rotary_factor * head_dim` dims, rotate-half), which is what runs here.
- The dense family has the SwiGLU MLP on every layer; the MoE family has the MoE with a shared
  expert on every layer (no `mlp_only_layers` / `decoder_sparse_step`), whose router always
  renormalises its top-k weights.

Everything else (zero-centred norms, the gated attention, the conv, the gated delta rule, the
gated output norm, the caches, packed documents) is Qwen3-Next's, built from the equivalent
qwen3_next config (`as_qwen3_next`); the model's own `cfg` stays the Qwen3.5 one.
"""

from __future__ import annotations

from functools import cache

import jax
from flax import nnx

from jobspec.families.model_config import ModelConfig
from jobspec.families.qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextModelConfig,
    Qwen3_5TextModelConfig,
)
from jobspec.families.qwen3_next import Qwen3NextModelConfig
from runtime.model.layers import ACT_ROPE, Dense, rope_tables
from runtime.model.qwen3_next.decoder import (
    Block,
    GatedDeltaNet,
    LayerKind,
    Qwen3NextDecoder,
    rotary_dim,
)
from runtime.model.qwen3_next.decoder import (
    layer_kinds as next_layer_kinds,
)
from runtime.model.sharding import constrain


def settings(cfg: ModelConfig) -> Qwen3_5Config:
    """The family's own table ([model.qwen3_5] or [model.qwen3_5_moe])."""
    if isinstance(cfg, Qwen3_5MoeTextModelConfig):
        return cfg.qwen3_5_moe
    assert isinstance(cfg, Qwen3_5TextModelConfig), "qwen3_5 needs a qwen3_5 family config"
    return cfg.qwen3_5


@cache
def as_qwen3_next(cfg: ModelConfig) -> Qwen3NextModelConfig:
    """The qwen3_next config with the same layers: Qwen3.5's mixers and norms are Qwen3-Next's,
    and its MoE is Qwen3-Next's with every layer sparse and the top-k renormalised."""
    q = settings(cfg)
    shared = cfg.model_dump(exclude={"family", "qwen3_5", "qwen3_5_moe"})
    table = q.model_dump(include=set(_NEXT_KEYS))
    if isinstance(q, Qwen3_5MoeConfig):
        table["shared_expert_intermediate_size"] = q.shared_expert_intermediate_size
        # No layer of the MoE family uses the dense MLP; qwen3_next needs a width for it.
        shared["intermediate_size"] = cfg.moe_intermediate_size
    return Qwen3NextModelConfig(**shared, family="qwen3_next", qwen3_next=table)


#: The [model.qwen3_next] keys Qwen3.5's tables carry under the same names.
_NEXT_KEYS = (
    "layer_types",
    "full_attention_interval",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "partial_rotary_factor",
    "chunk_size",
)


def layer_kinds(cfg: ModelConfig) -> list[LayerKind]:
    return next_layer_kinds(as_qwen3_next(cfg))


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet with Qwen3.5's four input projections (module docstring)."""

    def init_projections(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        d, hk, hv, dk, dv = cfg.hidden_size, self.hk, self.hv, self.dk, self.dv
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.in_proj_qkv = Dense(d, 2 * hk * dk + hv * dv, ("embed", "heads"), cfg, **kw)
        self.in_proj_z = Dense(d, hv * dv, ("embed", "heads"), cfg, **kw)
        self.in_proj_b = Dense(d, hv, ("embed", "heads"), cfg, **kw)
        self.in_proj_a = Dense(d, hv, ("embed", "heads"), cfg, **kw)

    def project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        b, t, _ = x.shape
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        qkv = self.in_proj_qkv(x)
        q = qkv[..., : hk * dk].reshape(b, t, hk, dk)
        k = qkv[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk)
        v = qkv[..., 2 * hk * dk :].reshape(b, t, hv, dv)
        z = self.in_proj_z(x).reshape(b, t, hv, dv)
        return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)


class Qwen3_5Block(Block):
    deltanet = Qwen3_5GatedDeltaNet


class Qwen3_5Decoder(Qwen3NextDecoder):
    """Qwen3.5 causal LM (dense or MoE): token ids in, float32 logits out."""

    block = Qwen3_5Block

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False):
        self.rotary_dim = rotary_dim(as_qwen3_next(cfg))
        super().__init__(as_qwen3_next(cfg), rngs=rngs, eager_sharding=eager_sharding)
        self.cfg = cfg

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        cos, sin = rope_tables(positions, self.rotary_dim, self.cfg.rope_theta)
        return constrain(cos, ACT_ROPE), constrain(sin, ACT_ROPE)


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Qwen3_5Decoder:
    return Qwen3_5Decoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
