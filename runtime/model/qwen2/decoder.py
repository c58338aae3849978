"""The "qwen2" family's decoder: the Qwen3 decoder with Qwen2's attention, computing what HF
`Qwen2ForCausalLM` does: q/k/v projections with a bias (`{q,k,v}_proj.bias`, zero at init as
HF's), o_proj without, and no q/k norm; everything else is
`runtime.model.qwen3.decoder.Decoder` (scanned or unrolled layers, SwiGLU MLPs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.layers import ACT_HEADS, ACT_KV_HEADS, Dense, dtype_of
from runtime.model.qwen3.decoder import Attention, Decoder


class BiasedDense(Dense):
    """Dense plus a bias [out] (HF `nn.Linear(bias=True)`), sharded like the output axis."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        names: tuple[str, str],
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        eager_sharding: bool,
    ) -> None:
        super().__init__(d_in, d_out, names, cfg, rngs=rngs, eager_sharding=eager_sharding)
        self.bias = nnx.Param(
            jnp.zeros((d_out,), dtype_of(cfg.param_dtype)),
            out_sharding=(names[1],),
            eager_sharding=eager_sharding,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x) + self.bias[...].astype(self.compute_dtype)


class Qwen2Attention(Attention):
    """Qwen3's GQA attention with biased q/k/v projections and no q/k norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        d, hd, h, kvh = cfg.hidden_size, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.q_proj = BiasedDense(d, h * hd, ("embed", "heads"), cfg, **kw)
        self.k_proj = BiasedDense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
        self.v_proj = BiasedDense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
        self.o_proj = Dense(h * hd, d, ("heads", "embed"), cfg, **kw)
        self.impl = cfg.attention

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q = self.heads(self.q_proj, x, self.num_heads, ACT_HEADS, "q_proj")
        k = self.heads(self.k_proj, x, self.num_kv_heads, ACT_KV_HEADS, "k_proj")
        v = self.heads(self.v_proj, x, self.num_kv_heads, ACT_KV_HEADS, "v_proj")
        return q, k, v


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Decoder:
    """The Qwen3 decoder with `Qwen2Attention` in every layer."""
    return Decoder(cfg, rngs=rngs, eager_sharding=eager_sharding, attention_factory=Qwen2Attention)
