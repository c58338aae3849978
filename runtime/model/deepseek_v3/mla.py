"""DeepSeek-V3's multi-head latent attention (MLA) and its RoPE (default or YaRN, on
interleaved pairs), computing what transformers' `DeepseekV3Attention` does.

Per token x [hidden]:

    q        = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))   [H, nope + rope]
    latent   = kv_a_layernorm(c[:kv_lora_rank]), k_rot = c[kv_lora_rank:],  c = kv_a_proj_with_mqa(x)
    k_nope,v = kv_b_proj(latent)                                       [H, nope], [H, v_head_dim]
    k        = [k_nope | rope(k_rot)]  (k_rot shared by every head),  q = [q_nope | rope(q_rot)]
    out      = o_proj(softmax(q k^T * scale) v)

The two latent norms use eps 1e-6 whatever `rms_norm_eps` is (transformers builds them with its
default). RoPE turns the last `qk_rope_head_dim` dims; with `rope_interleave` the pairs are
(x0, x1), (x2, x3), ... and the rotated result is laid out [evens | odds], as transformers' own
`apply_rotary_pos_emb_interleave` leaves it (q and k alike, so q.k is unchanged). YaRN
(`[model.deepseek_v3.yarn]`) gives the frequencies and a cos/sin factor as transformers'
`_compute_yarn_parameters`, and multiplies the softmax scale (nope + rope)^-0.5 by
mscale(factor, mscale_all_dim)^2.

Training runs the expanded K/V through `runtime.model.attention.kernels.attend` (every kernel);
value heads narrower than the query/key heads are zero-padded to their width for the kernel (exact:
the padded columns are sliced off). Decoding caches only the normed latent [B, S, kv_lora_rank]
and the rotated shared key [B, S, rope] per layer and attends in the latent space (kv_b_proj
absorbed into the query and the output), so the cache is (kv_lora_rank + rope) values per token.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jobspec.families.deepseek_v3 import DeepseekV3Config, DeepseekV3ModelConfig
from jobspec.families.model_config import ModelConfig
from runtime.model.attention import kernels as attention
from runtime.model.layers import (
    ACT_EMBED,
    ACT_HEADS,
    ACT_ROPE,
    Dense,
    RMSNorm,
    apply_rope,
    dtype_of,
)
from runtime.model.sharding import constrain

#: The latent activations [batch, length, rank]: the rank is never split.
ACT_LATENT = ("batch", "length", None)
#: transformers' DeepseekV3RMSNorm default, which its q_a/kv_a layernorms keep.
LATENT_NORM_EPS = 1e-6


def settings(cfg: ModelConfig) -> DeepseekV3Config:
    """The family's own table ([model.deepseek_v3])."""
    assert isinstance(cfg, DeepseekV3ModelConfig), "deepseek_v3 needs model.deepseek_v3"
    return cfg.deepseek_v3


# ---- RoPE ---------------------------------------------------------------------------------------


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies fp32 [rope / 2], the cos/sin factor), as transformers computes them."""
    d = settings(cfg)
    dim, base = d.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    y = d.yarn
    if y is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    factor = y.factor
    if y.attention_factor is not None:
        att = y.attention_factor
    elif y.mscale and y.mscale_all_dim:
        att = _mscale(factor, y.mscale) / _mscale(factor, y.mscale_all_dim)
    else:
        att = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = y.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv = (np.float32(1.0) / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) + (
        np.float32(1.0) / pos_freqs
    ) * extrapolation
    return inv.astype(np.float32), float(att)


def softmax_scale(cfg: ModelConfig) -> float:
    """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers'
    `yarn_apply_mscale`)."""
    d = settings(cfg)
    scale = (d.qk_nope_head_dim + d.qk_rope_head_dim) ** -0.5
    if d.yarn is not None and d.yarn.mscale_all_dim:
        m = _mscale(d.yarn.factor, d.yarn.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 cos/sin [B, T, rope] for positions [B, T] (times the YaRN factor), batch-sharded."""
    inv, factor = rope_frequencies(cfg)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb) * factor, jnp.sin(emb) * factor
    return constrain(cos, ACT_ROPE), constrain(sin, ACT_ROPE)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """RoPE on x [B, T, N, rope]; interleaved pairs are first gathered [evens | odds]."""
    if interleave:
        b, t, n, r = x.shape
        x = jnp.swapaxes(x.reshape(b, t, n, r // 2, 2), -1, -2).reshape(b, t, n, r)
    return apply_rope(x, cos, sin)


# ---- attention ----------------------------------------------------------------------------------


def latent_norm(dim: int, cfg: ModelConfig, eager_sharding: bool) -> RMSNorm:
    norm = RMSNorm(dim, cfg, eager_sharding=eager_sharding)
    norm.eps = LATENT_NORM_EPS
    return norm


class MLA(nnx.Module):
    """Multi-head latent attention (module docstring). The latent ranks are the input axis of
    q_b_proj/kv_b_proj, named `embed` so FSDP shards them like every other kernel's input."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        d = settings(cfg)
        hidden, h = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.rank = h, d.kv_lora_rank
        self.nope, self.rope, self.v_dim = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        self.interleave = d.rope_interleave
        self.scale = softmax_scale(cfg)
        self.impl = cfg.attention
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.low_rank_q = d.q_lora_rank is not None
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        qk = self.nope + self.rope
        if d.q_lora_rank is None:
            self.q_proj = Dense(hidden, h * qk, ("embed", "heads"), cfg, **kw)
        else:
            self.q_a_proj = Dense(hidden, d.q_lora_rank, ("embed", None), cfg, **kw)
            self.q_a_layernorm = latent_norm(d.q_lora_rank, cfg, eager_sharding)
            self.q_b_proj = Dense(d.q_lora_rank, h * qk, ("embed", "heads"), cfg, **kw)
        self.kv_a_proj_with_mqa = Dense(hidden, self.rank + self.rope, ("embed", None), cfg, **kw)
        self.kv_a_layernorm = latent_norm(self.rank, cfg, eager_sharding)
        self.kv_b_proj = Dense(
            self.rank, h * (self.nope + self.v_dim), ("embed", "heads"), cfg, **kw
        )
        self.o_proj = Dense(h * self.v_dim, hidden, ("heads", "embed"), cfg, **kw)

    def queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope [B, T, H, nope], rotated q_rot [B, T, H, rope])."""
        b, t, _ = x.shape
        if self.low_rank_q:
            lat = constrain(self.q_a_layernorm(self.q_a_proj(x)), ACT_LATENT)
            q = self.q_b_proj(lat)
        else:
            q = self.q_proj(x)
        q = checkpoint_name(constrain(q.reshape(b, t, self.num_heads, -1), ACT_HEADS), "q_proj")
        return q[..., : self.nope], rotate(q[..., self.nope :], cos, sin, self.interleave)

    def latents(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(normed latent [B, T, rank], rotated shared key [B, T, rope]): what a cache keeps."""
        c = checkpoint_name(constrain(self.kv_a_proj_with_mqa(x), ACT_LATENT), "k_proj")
        latent = self.kv_a_layernorm(c[..., : self.rank])
        k_rot = rotate(c[..., None, self.rank :], cos, sin, self.interleave)[:, :, 0]
        return latent, k_rot

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] -> (output [B, T, D], the new (latent, k_rot) cache when decoding).
        Training attends within segment ids with the configured kernel; decoding writes the
        T tokens' latents at `index` and attends under `mask` [B|1, T, S]."""
        q_nope, q_rot = self.queries(x, cos, sin)
        latent, k_rot = self.latents(x, cos, sin)
        if cache is None:
            out, new = self._expanded(q_nope, q_rot, latent, k_rot, segment_ids), None
        else:
            assert index is not None and mask is not None
            new = attention.write_cache(cache, latent[:, :, None], k_rot[:, :, None], index)
            out = self._absorbed(q_nope, q_rot, new[0][:, :, 0], new[1][:, :, 0], mask)
        b, t = x.shape[:2]
        out = checkpoint_name(constrain(out, ACT_HEADS), "attention_out")
        y = constrain(self.o_proj(out.reshape(b, t, self.num_heads * self.v_dim)), ACT_EMBED)
        return y, new

    def _expanded(
        self,
        q_nope: jax.Array,
        q_rot: jax.Array,
        latent: jax.Array,
        k_rot: jax.Array,
        segment_ids: jax.Array | None,
    ) -> jax.Array:
        """Per-head K/V from the latent, through `attention.attend` -> [B, T, H, v_dim]."""
        b, t, h, _ = q_nope.shape
        kv = constrain(self.kv_b_proj(latent).reshape(b, t, h, -1), ACT_HEADS)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        q = jnp.concatenate([q_nope, q_rot], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, :, None], q_rot.shape)], axis=-1)
        width = max(q.shape[-1], self.v_dim)
        q, k, v = (_pad_last(a, width) for a in (q, k, v))
        q, k, v = (constrain(a, ACT_HEADS) for a in (q, k, v))
        out = attention.attend(q, k, v, segment_ids, impl=self.impl, scale=self.scale)
        return out[..., : self.v_dim]

    def _absorbed(
        self, q_nope: jax.Array, q_rot: jax.Array, latent: jax.Array, k_rot: jax.Array, mask: Any
    ) -> jax.Array:
        """Attention in the latent space against the cache (latent [B, S, rank], k_rot
        [B, S, rope]): kv_b_proj's key half folded into the queries, its value half applied
        after the weighted sum -> [B, T, H, v_dim]."""
        cd = self.compute_dtype
        w = self.kv_b_proj.kernel[...].astype(cd).reshape(self.rank, self.num_heads, -1)
        w_k, w_v = w[..., : self.nope], w[..., self.nope :]
        latent, k_rot = latent.astype(cd), k_rot.astype(cd)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_k)
        f32 = jnp.float32
        scores = jnp.einsum("bthr,bsr->bhts", q_lat, latent, preferred_element_type=f32)
        scores += jnp.einsum("bthp,bsp->bhts", q_rot, k_rot, preferred_element_type=f32)
        scores = jnp.where(mask[:, None], scores * self.scale, jnp.finfo(f32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(cd)
        out_lat = jnp.einsum("bhts,bsr->bthr", probs, latent)
        return jnp.einsum("bthr,rhv->bthv", out_lat, w_v)


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    """x zero-padded on its last axis to `width`."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])
