"""The "gemma4_text" family: Gemma 4's text decoder, computing what HF `Gemma4ForCausalLM` does.

Per layer (HF `Gemma4TextDecoderLayer`), with sandwich norms around attention and the MLP:

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    h = mlp(pre_feedforward_layernorm(x))                       # gelu-tanh(gate) * up -> down
    with enable_moe_block:
        h = post_feedforward_layernorm_1(h)
          + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), router(x)))
    x = x + post_feedforward_layernorm(h)
    with per-layer inputs:  x = x + post_per_layer_input_norm(per_layer_projection(
                                    gelu-tanh(per_layer_input_gate(x)) * per_layer_input[i]))
    x = x * layer_scalar

Attention: q and k RMSNorm (with weight), a scale-free v RMSNorm, scaling 1.0. Sliding layers
(`head_dim`, `num_kv_heads`) use full-rotary RoPE with the local theta and a sliding window of
`sliding_window` keys; full layers use `global_head_dim`, `num_global_kv_heads` and
*proportional* RoPE: only the first `partial_rotary_factor * d / 2` frequencies turn (1 /
theta^(2i/d)), the rest are 0 (identity), and rotate_half pairs dim j with j + d/2.
`attention_k_eq_v`: full layers take the raw K projection as V (no v_proj). KV sharing: the last
`num_kv_shared_layers` layers have no k/v weights and attend to the keys/values (after norm and
RoPE) of the last non-shared layer of their own type (`sources`).

Per-layer inputs: the packed table `embed_tokens_per_layer` [Vp, L*P] (times sqrt(P)) plus the
RMS-normed projection of the scaled embedding (`per_layer_model_projection`, times D^-0.5), both
[B, T, L, P], summed and times 2^-0.5; layer i takes slice i. The MoE router: scale-free RMSNorm
of the block's pre-MLP residual, times `router.scale` and D^-0.5, projected, softmax (fp32), top-k,
renormalised, times `per_expert_scale`; experts are fused gelu-tanh stacks kept in HF's layout
(`gate_up_proj` [E, 2I, D] with gate first, `down_proj` [E, D, I]) and densely dispatched.
Embeddings are scaled by sqrt(D) (in the parameter dtype, as HF), logits optionally soft-capped,
the head tied unless `tie_word_embeddings = false`.

`layer_scalar` is HF's persistent buffer: here a Param (so it is imported, checkpointed and
exported) that the forward reads through `stop_gradient`, so its gradient is exactly zero and
AdamW (no weight decay on 1-D parameters) leaves it bit-for-bit unchanged.

The layers are never scanned (they differ in head dim, K/V ownership and MLP width): `layers` is
an `nnx.List`, paths `layers.{i}.…` mirroring HF's names (table in hf_names.py).
Decoding keeps a cache only for layers that own K/V (`Gemma4Cache`): full layers `max_len`
slots, sliding layers a ring of min(sliding_window, max_len) slots; shared layers reuse their
source's keys, values and mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jobspec.families.gemma4_text import Gemma4Config, Gemma4TextModelConfig, gemma4_kv_sources
from jobspec.families.model_config import ModelConfig
from runtime.model.attention import kernels as attention
from runtime.model.decoder import DecoderBase
from runtime.model.layers import (
    ACT_EMBED,
    ACT_EXPERT,
    ACT_EXPERT_MLP,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_MLP,
    ACT_ROPE,
    Dense,
    dtype_of,
    normal_param,
    rope_tables,
)
from runtime.model.moe import dispatch as moe_dispatch
from runtime.model.moe.layer import (
    MoEStats,
    _top_k_onehot,
    assignment_load,
    run_experts,
    stack_stats,
)
from runtime.model.sharding import constrain

#: The per-layer inputs [batch, length, layer, per-layer width].
ACT_PER_LAYER = ("batch", "length", None, None)


def settings(cfg: ModelConfig) -> Gemma4Config:
    """The family's own table ([model.gemma4])."""
    assert isinstance(cfg, Gemma4TextModelConfig), "gemma4_text needs model.gemma4"
    return cfg.gemma4


def _gelu(x: jax.Array) -> jax.Array:
    # HF "gelu_pytorch_tanh".
    return jax.nn.gelu(x, approximate=True)


def _param(cfg: ModelConfig, rngs: nnx.Rngs, shape, names, eager: bool) -> nnx.Param:
    return normal_param(rngs, shape, names, cfg.init_std, dtype_of(cfg.param_dtype), eager)


class Norm(nnx.Module):
    """HF Gemma4RMSNorm: fp32 x * (mean(x^2) + eps)^-0.5, times the fp32 weight, cast back;
    `with_scale=False` has no weight (v_norm, the router's norm)."""

    def __init__(
        self, dim: int, cfg: ModelConfig, *, eager_sharding: bool, with_scale: bool = True
    ):
        self.eps = cfg.rms_norm_eps
        if with_scale:
            self.scale = nnx.Param(
                jnp.ones((dim,), dtype_of(cfg.param_dtype)),
                out_sharding=("norm",),
                eager_sharding=eager_sharding,
            )
        else:
            self.scale = None

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jnp.power(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps, -0.5)
        if self.scale is not None:
            y = y * self.scale[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope(positions: jax.Array, dim: int, theta: float, rotated: int) -> tuple[jax.Array, jax.Array]:
    """fp32 cos/sin [B, T, dim] with `rotated` turning frequencies, batch-sharded."""
    cos, sin = rope_tables(positions, dim, theta, rotated)
    return constrain(cos, ACT_ROPE), constrain(sin, ACT_ROPE)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """rotate_half RoPE on x [B, T, N, D], with cos/sin cast to x's dtype first (as HF)."""
    c, s = cos.astype(x.dtype)[:, :, None, :], sin.astype(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * c + rotated * s


class Table(nnx.Module):
    """An embedding table `embedding` [rows, width] (HF `….weight`)."""

    def __init__(self, cfg: ModelConfig, rows: int, width: int, *, rngs, eager_sharding):
        names = ("vocab", "embed")
        self.embedding = _param(cfg, rngs, (rows, width), names, eager_sharding)


class LayerShape(NamedTuple):
    """What differs between layers: attention type, head dim, KV heads, K/V source, MLP width."""

    sliding: bool
    head_dim: int
    kv_heads: int
    source: int  # the layer whose K/V this one attends to (itself when it owns them)
    k_eq_v: bool
    mlp_width: int


def layer_shapes(cfg: ModelConfig) -> list[LayerShape]:
    g = settings(cfg)
    types = g.resolved_layer_types(cfg.num_layers)
    sources = gemma4_kv_sources(types, g.num_kv_shared_layers)
    out = []
    for i, kind in enumerate(types):
        sliding = kind == "sliding_attention"
        shared = sources[i] != i
        out.append(
            LayerShape(
                sliding=sliding,
                head_dim=cfg.resolved_head_dim if sliding else g.global_head_dim,
                kv_heads=cfg.num_kv_heads
                if sliding
                else (g.num_global_kv_heads or cfg.num_kv_heads),
                source=sources[i],
                k_eq_v=g.attention_k_eq_v and not sliding,
                mlp_width=cfg.intermediate_size * (2 if g.use_double_wide_mlp and shared else 1),
            )
        )
    return out


class Attention(nnx.Module):
    """One layer's attention; a K/V-shared layer has only q_proj, q_norm and o_proj."""

    def __init__(self, cfg: ModelConfig, shape: LayerShape, owns_kv: bool, *, rngs, eager_sharding):
        d, h, hd, kvh = cfg.hidden_size, cfg.num_heads, shape.head_dim, shape.kv_heads
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.window = settings(cfg).sliding_window if shape.sliding else None
        self.impl = cfg.attention
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.q_proj = Dense(d, h * hd, ("embed", "heads"), cfg, **kw)
        self.q_norm = Norm(hd, cfg, eager_sharding=eager_sharding)
        self.owns_kv = owns_kv
        if owns_kv:
            self.k_proj = Dense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
            self.v_proj = (
                None if shape.k_eq_v else Dense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
            )
            self.k_norm = Norm(hd, cfg, eager_sharding=eager_sharding)
            self.v_norm = Norm(hd, cfg, eager_sharding=eager_sharding, with_scale=False)
        self.o_proj = Dense(h * hd, d, ("heads", "embed"), cfg, **kw)

    def _heads(self, y: jax.Array, n: int, names, name: str) -> jax.Array:
        b, t, _ = y.shape
        return checkpoint_name(constrain(y.reshape(b, t, n, self.head_dim), names), name)

    def kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (k_norm, RoPE) and values (scale-free v_norm) [B, T, KV, hd] from x."""
        k_raw = self._heads(self.k_proj(x), self.num_kv_heads, ACT_KV_HEADS, "k_proj")
        v_raw = k_raw
        if self.v_proj is not None:
            v_raw = self._heads(self.v_proj(x), self.num_kv_heads, ACT_KV_HEADS, "v_proj")
        return _apply_rope(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        shared: tuple | None = None,
        cache: tuple | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple, tuple | None]:
        """-> (output [B, T, D], (k, v, mask) for layers sharing these K/V, new cache | None).

        Training: mask is None and attention is causal within segment ids (and the window).
        Decoding (`cache` given, or `shared` with a mask): the dense `mask` [1, T, S] over the
        cached and new keys."""
        q = self._heads(self.q_proj(x), self.num_heads, ACT_HEADS, "q_proj")
        q = _apply_rope(self.q_norm(q), cos, sin)
        new_cache = None
        if shared is not None:
            k, v, mask = shared
        else:
            k, v = self.kv(x, cos, sin)
            mask = None
            if cache is not None:
                assert index is not None
                k, v, mask, new_cache = self._with_cache(k, v, cache, index)
        if mask is None:
            out = attention.attend(
                q, k, v, segment_ids, impl=self.impl, scale=1.0, window=self.window
            )
        else:
            out = attention.masked_attention(q, k, v, mask, scale=1.0)
        b, t, h, hd = out.shape
        out = checkpoint_name(constrain(out, ACT_HEADS), "attention_out")
        return constrain(self.o_proj(out.reshape(b, t, h * hd)), ACT_EMBED), (k, v, mask), new_cache

    def _with_cache(self, k: jax.Array, v: jax.Array, cache: tuple, index: jax.Array):
        """Keys/values/mask over cache + new tokens, and the updated cache. A full layer writes
        the T new tokens at slots index..index+T-1 of its max_len slots; a sliding layer keeps a
        ring (token at time s in slot s % slots), attends to the old ring plus the new tokens,
        then writes the last min(T, slots) of them."""
        ck, cv = cache
        t, slots = k.shape[1], ck.shape[1]
        q_time = index + jnp.arange(t)
        cd = self.compute_dtype
        if self.window is None:
            ck, cv = attention.write_cache((ck, cv), k, v, index)
            mask = (jnp.arange(slots)[None, :] <= q_time[:, None])[None]
            return ck.astype(cd), cv.astype(cd), mask, (ck, cv)
        last = index - 1
        old_time = last - jnp.mod(last - jnp.arange(slots), slots)  # < 0: slot still empty
        k_time = jnp.concatenate([old_time, q_time])
        valid = jnp.concatenate([old_time >= 0, jnp.ones((t,), bool)])
        mask = valid[None, :] & (k_time[None, :] <= q_time[:, None])
        mask = (mask & (k_time[None, :] > q_time[:, None] - self.window))[None]
        keys = jnp.concatenate([ck.astype(cd), k.astype(cd)], axis=1)
        values = jnp.concatenate([cv.astype(cd), v.astype(cd)], axis=1)
        m = min(t, slots)
        dest = jnp.mod(index + t - m + jnp.arange(m), slots)
        ck = ck.at[:, dest].set(k[:, t - m :].astype(ck.dtype))
        cv = cv.at[:, dest].set(v[:, t - m :].astype(cv.dtype))
        return keys, values, mask, (ck, cv)


class MLP(nnx.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, width: int, *, rngs, eager_sharding):
        d = cfg.hidden_size
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.gate_proj = Dense(d, width, ("embed", "mlp"), cfg, **kw)
        self.up_proj = Dense(d, width, ("embed", "mlp"), cfg, **kw)
        self.down_proj = Dense(width, d, ("mlp", "embed"), cfg, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = constrain(self.gate_proj(x), ACT_MLP)
        up = constrain(self.up_proj(x), ACT_MLP)
        return constrain(self.down_proj(constrain(_gelu(gate) * up, ACT_MLP)), ACT_EMBED)


class Router(nnx.Module):
    """HF Gemma4TextRouter: `proj.kernel` [D, E], `scale` [D], `per_expert_scale` [E]."""

    def __init__(self, cfg: ModelConfig, *, rngs, eager_sharding):
        g = settings(cfg)
        d, e = cfg.hidden_size, g.num_experts
        self.top_k = g.top_k_experts
        self.norm = Norm(d, cfg, eager_sharding=eager_sharding, with_scale=False)
        self.proj = Dense(d, e, ("embed", "expert"), cfg, rngs=rngs, eager_sharding=eager_sharding)
        pd = dtype_of(cfg.param_dtype)
        self.scale = nnx.Param(
            jnp.ones((d,), pd), out_sharding=("norm",), eager_sharding=eager_sharding
        )
        self.per_expert_scale = nnx.Param(
            jnp.ones((e,), pd), out_sharding=("expert",), eager_sharding=eager_sharding
        )
        self.root = d**-0.5

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (weights [B, T, k] fp32 (per-expert scale applied), one-hot choices
        [B, T, k, E])."""
        h = self.norm(x) * self.scale[...].astype(x.dtype) * jnp.asarray(self.root, x.dtype)
        scores = constrain(self.proj(h), ACT_EXPERT)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        onehot = _top_k_onehot(probs, self.top_k)  # [B, T, k, E]
        top = jnp.einsum("...e,...ke->...k", probs, onehot)
        top = top / jnp.sum(top, axis=-1, keepdims=True)
        top = top * jnp.einsum(
            "e,...ke->...k", self.per_expert_scale[...].astype(jnp.float32), onehot
        )
        return top, onehot


class Experts(nnx.Module):
    """Fused gelu-tanh experts in HF's layout, every expert run on every token (dense dispatch)."""

    def __init__(self, cfg: ModelConfig, *, rngs, eager_sharding):
        g = settings(cfg)
        e, d, f = g.num_experts, cfg.hidden_size, g.moe_intermediate_size
        self.width = f
        self.gate_up_proj = _param(
            cfg, rngs, (e, 2 * f, d), ("expert", "mlp", "embed"), eager_sharding
        )
        self.down_proj = _param(cfg, rngs, (e, d, f), ("expert", "embed", "mlp"), eager_sharding)
        self.compute_dtype = dtype_of(cfg.compute_dtype)

    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        cd, f = self.compute_dtype, self.width
        w = self.gate_up_proj[...].astype(cd)
        gate = constrain(jnp.einsum("btd,efd->btef", x, w[:, :f]), ACT_EXPERT_MLP)
        up = constrain(jnp.einsum("btd,efd->btef", x, w[:, f:]), ACT_EXPERT_MLP)
        h = constrain(_gelu(gate) * up * combine[..., None].astype(cd), ACT_EXPERT_MLP)
        return constrain(jnp.einsum("btef,edf->btd", h, self.down_proj[...].astype(cd)), ACT_EMBED)

    def kernels(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate, up [E, D, F], down [E, F, D]) in the compute dtype, for the sparse dispatch
        (HF's fused [E, 2F, D] gate_up and [E, D, F] down, transposed)."""
        cd, f = self.compute_dtype, self.width
        w = self.gate_up_proj[...].astype(cd)
        down = self.down_proj[...].astype(cd)
        return w[:, :f].transpose(0, 2, 1), w[:, f:].transpose(0, 2, 1), down.transpose(0, 2, 1)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, i: int, shape: LayerShape, *, rngs, eager_sharding):
        g = settings(cfg)
        d = cfg.hidden_size
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}

        def norm() -> Norm:
            return Norm(d, cfg, eager_sharding=eager_sharding)

        self.self_attn = Attention(cfg, shape, shape.source == i, **kw)
        self.mlp = MLP(cfg, shape.mlp_width, **kw)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nnx.Param(
            jnp.ones((1,), dtype_of(cfg.param_dtype)),
            out_sharding=("norm",),
            eager_sharding=eager_sharding,
        )
        self.per_layer = g.hidden_size_per_layer_input > 0
        if self.per_layer:
            p = g.hidden_size_per_layer_input
            self.per_layer_input_gate = Dense(d, p, ("embed", None), cfg, **kw)
            self.per_layer_projection = Dense(p, d, (None, "embed"), cfg, **kw)
            self.post_per_layer_input_norm = norm()
        self.moe = g.enable_moe_block
        if self.moe:
            self.router = Router(cfg, **kw)
            self.experts = Experts(cfg, **kw)
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.moe_dispatch = cfg.moe_dispatch
            self.moe_capacity_factor = cfg.moe_capacity_factor

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        per_layer_input: jax.Array | None,
        shared: tuple | None = None,
        cache: tuple | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple, tuple | None, jax.Array | None]:
        """-> (x, published (k, v, mask), new cache | None, expert load [E] | None)."""
        x = constrain(x, ACT_EMBED)
        attn, published, new_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, segment_ids, shared, cache, index
        )
        x = constrain(x + self.post_attention_layernorm(attn), ACT_EMBED)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        load = None
        if self.moe:
            top, onehot = self.router(x)
            dispatch = moe_dispatch.current(self.moe_dispatch, self.moe_capacity_factor)
            moe, dropped = run_experts(
                self.pre_feedforward_layernorm_2(x),
                top,
                onehot,
                dispatch,
                self.experts,
                self.experts.kernels,
                _gelu,
            )
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
            load = MoEStats(assignment_load(onehot), dropped)
        x = constrain(x + self.post_feedforward_layernorm(h), ACT_EMBED)
        if self.per_layer:
            assert per_layer_input is not None
            gate = _gelu(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        scalar = lax.stop_gradient(self.layer_scalar[...]).astype(x.dtype)
        return constrain(x * scalar, ACT_EMBED), published, new_cache, load


class Gemma4Cache(NamedTuple):
    """Decoding state: keys/values of the layers that own K/V only (in layer order; shared
    layers keep none), [B, slots, KV, hd] each, and the number of tokens already seen. Full
    layers have max_len slots, sliding layers min(sliding_window, max_len) (a ring)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    index: jax.Array


def _block_forward(block: Block, x, cos, sin, seg, pli, shared):
    out, published, _, load = block(x, cos, sin, seg, pli, shared)
    return out, published[:2], load


class Gemma4TextDecoder(DecoderBase):
    """Gemma 4 causal LM: token ids in, float32 logits out, soft-capped when configured."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False):
        g = settings(cfg)
        self.cfg = cfg
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.shapes = tuple(layer_shapes(cfg))
        self.sources = tuple(s.source for s in self.shapes)
        self.logit_softcap = g.final_logit_softcapping
        d, n = cfg.hidden_size, cfg.num_layers
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.embed_tokens = Table(cfg, cfg.vocab_size, d, **kw)
        self.per_layer_width = g.hidden_size_per_layer_input
        if self.per_layer_width:
            p = self.per_layer_width
            vp = g.vocab_size_per_layer_input or cfg.vocab_size
            self.embed_tokens_per_layer = Table(cfg, vp, n * p, **kw)
            self.per_layer_model_projection = Dense(d, n * p, ("embed", "mlp"), cfg, **kw)
            self.per_layer_projection_norm = Norm(p, cfg, eager_sharding=eager_sharding)
        self.layers = nnx.List([Block(cfg, i, s, **kw) for i, s in enumerate(self.shapes)])
        self.norm = Norm(d, cfg, eager_sharding=eager_sharding)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense(d, cfg.vocab_size, ("embed", "vocab"), cfg, **kw)

    # ---- embeddings ---------------------------------------------------------------------

    def _scaled_lookup(self, table: jax.Array, ids: jax.Array, scale: float) -> jax.Array:
        # HF multiplies in the weight dtype (sqrt(3072) becomes 55.5 in bf16).
        rows = jnp.take(table, ids, axis=0)
        return (rows * jnp.asarray(scale, table.dtype)).astype(self.compute_dtype)

    def _embed(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """x [B, T, D] and the per-layer inputs [B, T, L, P] (None without them)."""
        d = self.cfg.hidden_size
        x = constrain(
            self._scaled_lookup(self.embed_tokens.embedding[...], inputs, d**0.5), ACT_EMBED
        )
        if not self.per_layer_width:
            return x, None
        b, t = inputs.shape
        n, p = self.cfg.num_layers, self.per_layer_width
        tok = self._scaled_lookup(self.embed_tokens_per_layer.embedding[...], inputs, p**0.5)
        tok = constrain(tok.reshape(b, t, n, p), ACT_PER_LAYER)
        proj = self.per_layer_model_projection(x) * jnp.asarray(d**-0.5, x.dtype)
        proj = self.per_layer_projection_norm(constrain(proj.reshape(b, t, n, p), ACT_PER_LAYER))
        return x, constrain((proj + tok) * jnp.asarray(2.0**-0.5, x.dtype), ACT_PER_LAYER)

    # ---- forward ------------------------------------------------------------------------

    def _ropes(self, positions: jax.Array) -> dict[bool, tuple[jax.Array, jax.Array]]:
        """cos/sin per attention type (key: sliding?) for the types present."""
        g = settings(self.cfg)
        out = {}
        for sliding in sorted({s.sliding for s in self.shapes}):
            if sliding:
                hd = self.cfg.resolved_head_dim
                out[True] = rope(positions, hd, g.sliding_rope_theta, hd // 2)
            else:
                hd = g.global_head_dim
                rotated = int(g.global_partial_rotary_factor * hd // 2)
                out[False] = rope(positions, hd, g.global_rope_theta, rotated)
        return out

    def forward_hidden(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """Final-normed hidden states [B, T, D] and the MoE stats stacked over layers (load
        [L, E], dropped [L]; None without MoE)."""
        x, pli = self._embed(inputs)
        ropes = self._ropes(positions)
        fn = self.remat(_block_forward)
        published: dict[int, tuple] = {}
        loads = []
        for i, block in enumerate(self.layers):
            src = self.sources[i]
            shared = None if src == i else (*published[src], None)
            cos, sin = ropes[self.shapes[i].sliding]
            x, kv, load = fn(
                block, x, cos, sin, segment_ids, None if pli is None else pli[:, :, i], shared
            )
            if src == i and i in self.sources[i + 1 :]:
                published[i] = kv
            loads.append(load)
        return self.final_norm(x), stack_stats(loads)

    # ---- decoding -----------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> Gemma4Cache:
        dtype = self.compute_dtype if dtype is None else dtype
        ks = []
        for i, s in enumerate(self.shapes):
            if s.source != i:
                continue
            slots = min(settings(self.cfg).sliding_window, max_len) if s.sliding else max_len
            ks.append(jnp.zeros((batch, slots, s.kv_heads, s.head_dim), dtype))
        return Gemma4Cache(
            k=tuple(ks), v=tuple(jnp.zeros_like(k) for k in ks), index=jnp.zeros((), jnp.int32)
        )

    def decode(
        self, inputs: jax.Array, positions: jax.Array, cache: Gemma4Cache
    ) -> tuple[jax.Array, Gemma4Cache]:
        """T new tokens against the cache (prefill or one step), like
        qwen3.decoder.Qwen3Decoder.decode; the caller keeps index + T <= max_len."""
        x, pli = self._embed(inputs)
        ropes = self._ropes(positions)
        published: dict[int, tuple] = {}
        new_k, new_v = list(cache.k), list(cache.v)
        slot = 0
        for i, block in enumerate(self.layers):
            src = self.sources[i]
            cos, sin = ropes[self.shapes[i].sliding]
            p = None if pli is None else pli[:, :, i]
            if src == i:
                c = (cache.k[slot], cache.v[slot])
                x, published[i], (nk, nv), _ = block(x, cos, sin, None, p, None, c, cache.index)
                new_k[slot], new_v[slot] = nk, nv
                slot += 1
            else:
                x, _, _, _ = block(x, cos, sin, None, p, published[src])
        t = inputs.shape[1]
        return self.logits(self.final_norm(x)), Gemma4Cache(
            tuple(new_k), tuple(new_v), cache.index + t
        )


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Gemma4TextDecoder:
    return Gemma4TextDecoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
