"""The "gpt_oss" family: OpenAI's gpt-oss decoder, computing what HF `GptOssForCausalLM`
(transformers 5.23, `models/gpt_oss/modeling_gpt_oss.py`) does.

Every layer is pre-norm, `x + attn(input_layernorm(x))` then `x + moe(post_attention_layernorm(x))`
(RMSNorm in fp32, times its fp32 weight, cast back; the final norm alike), and differs from the
next only in its attention mask (`[model.gpt_oss] layer_types`, sliding and full alternating by
default):

- **Attention**: GQA with a bias on q, k, v and o (`attention_bias`), "rotate_half" RoPE on the
  whole head (YaRN by default, `rope_scaling`: transformers' `_compute_yarn_parameters` in the
  same fp32 steps, cos and sin times its attention factor), scale head_dim^-0.5, and a learned
  **sink** per head (`sinks` [H]): a logit in the softmax denominator that no value goes with,
  so a head may attend to nothing. Sliding layers see the `sliding_window` - 1 keys before each
  query; full layers are causal. Kernels (runtime/model/attention/kernels.py): on TPU splash for
  every layer (its `LocalMask` on sliding layers, `CausalMask` on full ones, the sinks its own
  argument), the einsum reference elsewhere; cudnn has no sinks and is refused by the config.
- **MoE** (every layer): the router `router.kernel` [D, E] plus a learned bias `router.bias`
  [E]; each token's top-k experts by those logits, weighted by the softmax over the k chosen
  logits (top-k renormalised by construction). Experts keep HF's fused layout: `gate_up_proj`
  [E, D, 2I] with gate and up INTERLEAVED along the last axis (column 2j is gate j, 2j + 1 up
  j), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, D], `down_proj_bias` [E, D]; the
  activation is the clamped SwiGLU (runtime/model/moe/layer.py `clamped_swiglu`: gate clamped
  above at `swiglu_limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(`swiglu_alpha` *
  gate)).
  Dense or sparse dispatch as `model.moe_dispatch` says (runtime/model/moe/dispatch.py, with
  the biases and the clamped activation as its options), experts over `mesh.expert`.

With `model.scan_layers` the layers scan in periods of their kinds (sliding, full:
runtime/model/decoder.py `Period`), paths `layers.blocks.{j}.…` with a leading [repetitions]
axis; without, `layers` is an `nnx.List`, paths `layers.{i}.…` mirroring HF's names (table in
hf_names.py); both hold the same values from the same seed. Decoding (`init_cache`/`decode`)
keeps max_len K/V slots on full layers and a ring of min(sliding_window, max_len) on sliding
ones (the token at time s in slot s % slots).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jobspec.families.gpt_oss import GptOssConfig, GptOssModelConfig, YarnRopeScaling
from jobspec.families.model_config import ModelConfig
from runtime.model.attention import kernels as attention
from runtime.model.decoder import DecoderBase, build_periods
from runtime.model.layers import (
    ACT_EMBED,
    ACT_EXPERT,
    ACT_EXPERT_MLP,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_ROPE,
    Dense,
    Embed,
    apply_rope,
    dtype_of,
    normal_param,
)
from runtime.model.moe import dispatch as moe_dispatch
from runtime.model.moe.layer import (
    MoEStats,
    _top_k_onehot,
    assignment_load,
    clamped_swiglu,
    run_experts,
)
from runtime.model.sharding import constrain


def settings(cfg: ModelConfig) -> GptOssConfig:
    """The family's own table ([model.gpt_oss])."""
    assert isinstance(cfg, GptOssModelConfig), "gpt_oss needs model.gpt_oss"
    return cfg.gpt_oss


def sliding_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer: is it a sliding-window attention layer?"""
    return [t == "sliding_attention" for t in settings(cfg).resolved_layer_types(cfg.num_layers)]


# ---- RoPE ---------------------------------------------------------------------------------------


def inv_freq(
    head_dim: int, theta: float, scaling: YarnRopeScaling | None
) -> tuple[np.ndarray, float]:
    """(fp32 inverse frequencies [head_dim / 2], the cos/sin factor): HF's default RoPE, or with
    `scaling` transformers' YaRN (`_compute_yarn_parameters`, in the same fp32 steps)."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = (np.float32(theta) ** exps).astype(np.float32)
    if scaling is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    s = scaling
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(s.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` turns in the original context.
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = (np.float32(1.0) - np.clip(ramp, 0, 1)).astype(np.float32)
    freq = (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)
    factor = 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0
    return freq, factor


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 cos/sin [B, T, head_dim] for integer positions [B, T], batch-sharded."""
    freq, factor = inv_freq(cfg.resolved_head_dim, cfg.rope_theta, settings(cfg).rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freq)
    emb = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(emb) * factor, jnp.sin(emb) * factor
    return constrain(cos, ACT_ROPE), constrain(sin, ACT_ROPE)


# ---- layers -------------------------------------------------------------------------------------


class Norm(nnx.Module):
    """HF GptOssRMSNorm: fp32 x * rsqrt(mean(x^2) + eps), times the weight in fp32, cast back."""

    def __init__(self, dim: int, cfg: ModelConfig, *, eager_sharding: bool) -> None:
        self.scale = nnx.Param(
            jnp.ones((dim,), dtype_of(cfg.param_dtype)),
            out_sharding=("norm",),
            eager_sharding=eager_sharding,
        )
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * y).astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention with biases, RoPE, per-head sinks and (sliding layers) a window."""

    def __init__(self, cfg: ModelConfig, sliding: bool, *, rngs: nnx.Rngs, eager_sharding: bool):
        g = settings(cfg)
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        kw = {"rngs": rngs, "eager_sharding": eager_sharding, "bias": g.attention_bias}
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.q_proj = Dense(d, h * hd, ("embed", "heads"), cfg, **kw)
        self.k_proj = Dense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
        self.v_proj = Dense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
        self.o_proj = Dense(h * hd, d, ("heads", "embed"), cfg, **kw)
        self.sinks = normal_param(
            rngs, (h,), ("heads",), cfg.init_std, dtype_of(cfg.param_dtype), eager_sharding
        )
        self.window = g.sliding_window if sliding else None
        self.impl = cfg.attention
        self.compute_dtype = dtype_of(cfg.compute_dtype)

    def _heads(self, y: jax.Array, n: int, names: tuple) -> jax.Array:
        b, t, _ = y.shape
        return constrain(y.reshape(b, t, n, self.head_dim), names)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] -> (output [B, T, D], the new cache or None). Training: causal within
        `segment_ids` (and the window) through the configured kernel; decoding: the cache."""
        q = apply_rope(self._heads(self.q_proj(x), self.num_heads, ACT_HEADS), cos, sin)
        k = apply_rope(self._heads(self.k_proj(x), self.num_kv_heads, ACT_KV_HEADS), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv_heads, ACT_KV_HEADS)
        sinks = self.sinks[...].astype(jnp.float32)
        new_cache = None
        if cache is None:
            out = attention.attend(
                q, k, v, segment_ids, impl=self.impl, window=self.window, sinks=sinks
            )
        else:
            assert index is not None
            keys, values, mask, new_cache = self._with_cache(k, v, cache, index)
            out = attention.masked_attention(q, keys, values, mask, sinks=sinks)
        b, t, h, hd = out.shape
        out = constrain(out, ACT_HEADS).reshape(b, t, h * hd)
        return constrain(self.o_proj(out), ACT_EMBED), new_cache

    def _with_cache(
        self, k: jax.Array, v: jax.Array, cache: tuple[jax.Array, jax.Array], index: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
        """(keys, values, mask [1, T, S'], new cache) for T new tokens at times index.. A full
        layer writes them into its max_len slots and attends to the slots up to each; a sliding
        layer's ring holds the last `slots` tokens before `index` (time s in slot s % slots):
        the new tokens attend to it plus themselves within the window, then the last
        min(T, slots) of them are written over the oldest."""
        ck, cv = cache
        t, slots, cd = k.shape[1], ck.shape[1], self.compute_dtype
        q_time = index + jnp.arange(t)
        if self.window is None:
            ck, cv = attention.write_cache((ck, cv), k, v, index)
            mask = (jnp.arange(slots)[None, :] <= q_time[:, None])[None]
            return ck.astype(cd), cv.astype(cd), mask, (ck, cv)
        last = index - 1
        ring_time = last - jnp.mod(last - jnp.arange(slots), slots)  # < 0: never written
        k_time = jnp.concatenate([ring_time, q_time])
        seen = jnp.concatenate([ring_time >= 0, jnp.ones((t,), bool)])
        mask = seen[None, :] & (k_time[None, :] <= q_time[:, None])
        mask = (mask & (k_time[None, :] > q_time[:, None] - self.window))[None]
        keys = jnp.concatenate([ck.astype(cd), k.astype(cd)], axis=1)
        values = jnp.concatenate([cv.astype(cd), v.astype(cd)], axis=1)
        kept = min(t, slots)
        dest = jnp.mod(index + t - kept + jnp.arange(kept), slots)
        ck = ck.at[:, dest].set(k[:, t - kept :].astype(ck.dtype))
        cv = cv.at[:, dest].set(v[:, t - kept :].astype(cv.dtype))
        return keys, values, mask, (ck, cv)


class Router(nnx.Module):
    """The router: `kernel` [D, E] and a learned `bias` [E] (HF `GptOssTopKRouter`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        e, pd = settings(cfg).num_local_experts, dtype_of(cfg.param_dtype)
        names = ("embed", "expert")
        self.kernel = normal_param(
            rngs, (cfg.hidden_size, e), names, cfg.init_std, pd, eager_sharding
        )
        self.bias = normal_param(rngs, (e,), ("expert",), cfg.init_std, pd, eager_sharding)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> fp32 logits [..., E] (bias included)."""
        w = self.kernel[...].astype(x.dtype)
        logits = jnp.einsum("...d,de->...e", x, w, preferred_element_type=jnp.float32)
        return logits + self.bias[...].astype(jnp.float32)


class Experts(nnx.Module):
    """E clamped-SwiGLU experts with biases, in HF's fused layout (gate/up interleaved)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        g = settings(cfg)
        e, d, f = g.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        pd = dtype_of(cfg.param_dtype)

        def param(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
            return normal_param(rngs, shape, names, cfg.init_std, pd, eager_sharding)

        def zeros(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
            return nnx.Param(
                jnp.zeros(shape, pd), out_sharding=names, eager_sharding=eager_sharding
            )

        self.gate_up_proj = param((e, d, 2 * f), ("expert", "embed", "mlp"))
        self.gate_up_proj_bias = zeros((e, 2 * f), ("expert", "mlp"))
        self.down_proj = param((e, f, d), ("expert", "mlp", "embed"))
        self.down_proj_bias = zeros((e, d), ("expert", "embed"))
        self.width = f
        self.limit, self.alpha = g.swiglu_limit, g.swiglu_alpha
        self.compute_dtype = dtype_of(cfg.compute_dtype)

    def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return clamped_swiglu(gate, up, self.limit, self.alpha)

    def _split(self, fused: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[..., 2I] interleaved -> (gate, up) [..., I] (a reshape, so a `tensor` split of the
        width carries over: each shard holds whole (gate, up) pairs)."""
        pairs = fused.reshape(*fused.shape[:-1], self.width, 2)
        return pairs[..., 0], pairs[..., 1]

    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """Dense dispatch: x [B, T, D], combine [B, T, E] (zero off each token's top-k)."""
        cd = self.compute_dtype
        h = jnp.einsum("btd,edf->btef", x, self.gate_up_proj[...].astype(cd))
        h = constrain(h + self.gate_up_proj_bias[...].astype(cd), ACT_EXPERT_MLP)
        a = self.glu(*self._split(h))
        # Weighting the hidden before the (linear) down projection: the same sum, no [B,T,E,D].
        a = constrain(a * combine[..., None].astype(cd), ACT_EXPERT_MLP)
        y = jnp.einsum("btef,efd->btd", a, self.down_proj[...].astype(cd))
        y = y + jnp.einsum("bte,ed->btd", combine.astype(cd), self.down_proj_bias[...].astype(cd))
        return constrain(y, ACT_EMBED)

    def kernels(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate, up [E, D, I], down [E, I, D]) in the compute dtype, for the sparse dispatch."""
        cd = self.compute_dtype
        gate, up = self._split(self.gate_up_proj[...].astype(cd))
        return gate, up, self.down_proj[...].astype(cd)

    def biases(self) -> moe_dispatch.ExpertBiases:
        cd = self.compute_dtype
        gate, up = self._split(self.gate_up_proj_bias[...].astype(cd))
        return moe_dispatch.ExpertBiases(gate, up, self.down_proj_bias[...].astype(cd))


class MoE(nnx.Module):
    """HF `GptOssMLP`: the biased router's top-k, softmax over the chosen logits, the experts."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.router = Router(cfg, **kw)
        self.experts = Experts(cfg, **kw)
        self.top_k = settings(cfg).num_experts_per_tok
        self.dispatch, self.capacity_factor = cfg.moe_dispatch, cfg.moe_capacity_factor

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        logits = constrain(self.router(x), ACT_EXPERT)
        onehot = _top_k_onehot(logits, self.top_k)  # [B, T, k, E], best first
        top = jax.nn.softmax(jnp.einsum("...e,...ke->...k", logits, onehot), axis=-1)
        dispatch = moe_dispatch.current(self.dispatch, self.capacity_factor)
        y, dropped = run_experts(
            x,
            top,
            onehot,
            dispatch,
            self.experts,
            self.experts.kernels,
            jax.nn.silu,  # unused: `glu` replaces activation(gate) * up
            glu=self.experts.glu,
            biases=self.experts.biases,
        )
        return y, MoEStats(assignment_load(onehot), dropped)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool, *, rngs: nnx.Rngs, eager_sharding: bool):
        d = cfg.hidden_size
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.input_layernorm = Norm(d, cfg, eager_sharding=eager_sharding)
        self.self_attn = Attention(cfg, sliding, **kw)
        self.post_attention_layernorm = Norm(d, cfg, eager_sharding=eager_sharding)
        self.mlp = MoE(cfg, **kw)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, MoEStats]:
        """-> (x, the new cache or None, the MoE stats); pinned to [batch, length, embed]."""
        x = constrain(x, ACT_EMBED)
        attn, new_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, segment_ids, cache, index
        )
        x = constrain(x + attn, ACT_EMBED)
        y, stats = self.mlp(self.post_attention_layernorm(x))
        return constrain(x + y, ACT_EMBED), new_cache, stats


class GptOssCache(NamedTuple):
    """Decoding state: per layer keys/values [B, slots, KV, hd] (max_len slots on full layers,
    a ring of min(sliding_window, max_len) on sliding ones) and the tokens already seen."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    index: jax.Array


class GptOssDecoder(DecoderBase):
    """gpt-oss causal LM: token ids in, float32 logits out."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False):
        self.cfg = cfg
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.embed_tokens = Embed(cfg, **kw)
        self.sliding = tuple(sliding_layers(cfg))
        if cfg.scan_layers:
            self.layers = build_periods(
                lambda s, r: Block(cfg, s, rngs=r, eager_sharding=False),
                self.sliding,
                rngs,
                eager_sharding=eager_sharding,
            )
        else:
            self.layers = nnx.List([Block(cfg, s, **kw) for s in self.sliding])
        self.norm = Norm(cfg.hidden_size, cfg, eager_sharding=eager_sharding)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, **kw)

    def forward_hidden(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """The final-normed hidden states [B, T, D] and the MoE stats stacked over layers."""
        cos, sin = rope_tables(self.cfg, positions)
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        x, stats = self.run_layers(x, cos, sin, segment_ids)
        return self.final_norm(x), stats

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> GptOssCache:
        dtype = self.compute_dtype if dtype is None else dtype
        window = settings(self.cfg).sliding_window
        shape = (self.cfg.num_kv_heads, self.cfg.resolved_head_dim)
        ks = [
            jnp.zeros((batch, min(window, max_len) if s else max_len, *shape), dtype)
            for s in self.sliding
        ]
        return GptOssCache(
            tuple(ks), tuple(jnp.zeros_like(k) for k in ks), jnp.zeros((), jnp.int32)
        )

    def decode(
        self, inputs: jax.Array, positions: jax.Array, cache: GptOssCache
    ) -> tuple[jax.Array, GptOssCache]:
        """T new tokens against the cache (a prefill or one step); the caller keeps
        index + T <= max_len."""
        cos, sin = rope_tables(self.cfg, positions)
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        new_k, new_v = [], []
        for block, ck, cv in zip(self.layer_list(), cache.k, cache.v, strict=True):
            x, (nk, nv), _ = block(x, cos, sin, None, (ck, cv), cache.index)
            new_k.append(nk)
            new_v.append(nv)
        t = inputs.shape[1]
        return self.logits(self.final_norm(x)), GptOssCache(
            tuple(new_k), tuple(new_v), cache.index + t
        )


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> GptOssDecoder:
    return GptOssDecoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
