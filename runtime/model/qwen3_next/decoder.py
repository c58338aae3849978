"""The "qwen3_next" family: Qwen3-Next's hybrid decoder, computing what HF `Qwen3NextForCausalLM`
(transformers 5.23, `models/qwen3_next/modeling_qwen3_next.py`) does.

Every layer is pre-norm, `x + mixer(input_layernorm(x))` then `x + mlp(post_attention_layernorm(x))`,
with zero-centred RMSNorms (weight stored as w, applied as 1 + w, in fp32; also the final norm and
the full-attention q/k norms). The token mixer is one of (`[model.qwen3_next] layer_types`, by
default every `full_attention_interval`-th layer full):

- **Gated DeltaNet** (`linear_attn`): `in_proj_qkvz` and `in_proj_ba` are fused projections in
  HF's per-key-head-group layout: for each of the Hk key heads, [q (dk) | k (dk) | v (r*dv) |
  z (r*dv)] and [b (r) | a (r)], r = Hv / Hk value heads per key head. q, k and v go through a
  depthwise causal conv of width K (`conv1d.kernel` [K, C], channels [q | k | v], no bias) and
  SiLU; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
  (runtime/model/deltanet.py: q/k L2-normalised and repeated to the value heads, q scaled by
  dk^-0.5, fp32 state) gives [B, T, Hv, dv]; per head an RMSNorm with a plain fp32 weight, times
  SiLU(z); then `out_proj`.
- **Gated full attention** (`self_attn`): `q_proj` carries [q | gate] per head (2 * head_dim
  each); zero-centred q/k norms, RoPE on the first `partial_rotary_factor * head_dim` dims only,
  GQA with scale head_dim^-0.5, output times sigmoid(gate), then `o_proj`.

The MLP is the MoE with a shared expert (runtime/model/moe/layer.py's router, top-k, norm_topk_prob,
stacked experts and aux-loss-free router bias, plus a SwiGLU `shared_expert` scaled by
sigmoid(`shared_expert_gate`)) on layers that are MoE by HF's rule (experts set, not in
`mlp_only_layers`, (i + 1) % `decoder_sparse_step` == 0), else the dense SwiGLU of width
`intermediate_size`. The head is untied unless `tie_word_embeddings`.

Packed documents (segment ids): full attention is masked per document as in every family; in the
DeltaNet layers the conv does not reach across a document start and the recurrent state resets
there, so each document's logits equal that document run alone.

Decoding (`init_cache`/`decode`, what `sample` runs): attention layers keep a KV cache of max_len
slots; DeltaNet layers keep the last K-1 conv inputs and the fp32 recurrent state [B, Hv, dk, dv].
A prefill runs the chunked rule from the cached state, a one-token step the recurrent rule.

With `model.scan_layers` the layers scan in periods of their kinds (mixer and MLP; every
`full_attention_interval` layers by default: runtime/model/decoder.py `Period`), paths
`layers.blocks.{j}.…` with a leading [repetitions] axis; without, `layers` is an `nnx.List`,
paths `layers.{i}.…` mirroring HF's names (table in hf_names.py). Both hold the same values
from the same seed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jobspec.families.model_config import ModelConfig
from jobspec.families.qwen3_next import Qwen3NextConfig, Qwen3NextModelConfig
from runtime.model.attention import context_parallel
from runtime.model.attention import kernels as attention
from runtime.model.decoder import DecoderBase, build_periods, cache_mask
from runtime.model.deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule
from runtime.model.layers import (
    ACT_EMBED,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_ROPE,
    Dense,
    Embed,
    RMSNorm,
    apply_rope,
    dtype_of,
    normal_param,
    rope_tables,
)
from runtime.model.moe.layer import MoEStats, SparseMoE
from runtime.model.qwen3.decoder import MLP
from runtime.model.sharding import constrain

#: Per-head values flattened over one axis in the DeltaNet layers [batch, length, heads(*dim)]:
#: the gates and decays [B, T, Hv], and each of q, k, v as the conv sees it [B, T, H * d].
ACT_HEAD_GATES = ("batch", "length", "heads")


def settings(cfg: ModelConfig) -> Qwen3NextConfig:
    """The family's own table ([model.qwen3_next])."""
    assert isinstance(cfg, Qwen3NextModelConfig), "qwen3_next needs model.qwen3_next"
    return cfg.qwen3_next


class LayerKind(NamedTuple):
    """What differs between layers: the token mixer and the MLP."""

    linear: bool  # Gated DeltaNet (else gated full attention)
    moe: bool  # routed experts + shared expert (else the dense MLP)


def layer_kinds(cfg: ModelConfig) -> list[LayerKind]:
    q = settings(cfg)
    types = q.resolved_layer_types(cfg.num_layers)
    moe = q.moe_layers(cfg.num_layers, cfg.num_experts)
    return [LayerKind(t == "linear_attention", m) for t, m in zip(types, moe, strict=True)]


def rotary_dim(cfg: ModelConfig) -> int:
    """Dims of the full-attention head that RoPE turns (HF: int(head_dim * factor))."""
    return int(cfg.resolved_head_dim * settings(cfg).partial_rotary_factor)


# ---- Gated DeltaNet -----------------------------------------------------------------------------


class CausalConv(nnx.Module):
    """Depthwise causal conv, no bias: `kernel` [K, C] (HF `conv1d.weight` [C, 1, K]); tap K-1
    reads the current token, tap i the token K-1-i before it."""

    def __init__(self, cfg: ModelConfig, channels: int, *, rngs: nnx.Rngs, eager_sharding: bool):
        k = settings(cfg).linear_conv_kernel_dim
        pd = dtype_of(cfg.param_dtype)
        self.kernel = normal_param(
            rngs, (k, channels), (None, None), cfg.init_std, pd, eager_sharding
        )

    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None,
        state: jax.Array,
        channels: tuple[int, int],
    ) -> tuple[jax.Array, jax.Array]:
        """x [B, T, c] (channels lo..hi of the kernel), state [B, K-1, c] (the inputs before x;
        zeros at a sequence start) -> (silu(conv) [B, T, c] in x's dtype, computed in fp32; the
        last K-1 inputs, the next state). With segment ids a tap never reads a token of another
        document. The channels are convolved in parts (q, k, v) so each keeps its head sharding."""
        w = self.kernel[...][:, channels[0] : channels[1]].astype(jnp.float32)
        k, t = w.shape[0], x.shape[1]
        xs = jnp.concatenate([state.astype(x.dtype), x], axis=1)
        y = jnp.zeros(x.shape, jnp.float32)
        for i in range(k):
            src = xs[:, i : i + t].astype(jnp.float32)  # the token k-1-i before each position
            lag = k - 1 - i
            if segment_ids is not None and lag:
                before = jnp.pad(segment_ids, ((0, 0), (lag, 0)), constant_values=-1)[:, :t]
                src = jnp.where((before == segment_ids)[..., None], src, 0.0)
            y = y + src * w[i]
        return jax.nn.silu(y).astype(x.dtype), xs[:, xs.shape[1] - (k - 1) :]


class GatedNorm(nnx.Module):
    """HF Qwen3NextRMSNormGated: per-head RMSNorm with a plain weight (initialised to 1), times
    SiLU(gate); the statistics, weight and gate in fp32, the result cast back."""

    def __init__(self, dim: int, cfg: ModelConfig, *, eager_sharding: bool):
        self.scale = nnx.Param(
            jnp.ones((dim,), dtype_of(cfg.param_dtype)),
            out_sharding=("norm",),
            eager_sharding=eager_sharding,
        )
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        y = y.astype(x.dtype).astype(jnp.float32) * self.scale[...].astype(jnp.float32)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """One DeltaNet token mixer (module docstring); heads shard over `tensor` as attention's do:
    the fused projections' outputs are laid out per key-head group, so contiguous shards of them
    are whole groups when `tensor` divides the key heads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        q = settings(cfg)
        d = cfg.hidden_size
        self.hk, self.hv = q.linear_num_key_heads, q.linear_num_value_heads
        self.dk, self.dv = q.linear_key_head_dim, q.linear_value_head_dim
        self.r = self.hv // self.hk
        self.chunk_size = q.chunk_size
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.init_projections(cfg, **kw)
        self.conv1d = CausalConv(cfg, 2 * hk * dk + hv * dv, **kw)
        pd = dtype_of(cfg.param_dtype)
        # HF's init: dt_bias 1, A = uniform(0.01, 16) (kept away from 0 so log A is finite).
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(
            jnp.log(a).astype(pd), out_sharding=("heads",), eager_sharding=eager_sharding
        )
        self.dt_bias = nnx.Param(
            jnp.ones((hv,), pd), out_sharding=("heads",), eager_sharding=eager_sharding
        )
        self.norm = GatedNorm(dv, cfg, eager_sharding=eager_sharding)
        self.out_proj = Dense(hv * dv, d, ("heads", "embed"), cfg, **kw)

    def init_projections(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        """The input projections: HF's fused per-key-head-group `in_proj_qkvz` and `in_proj_ba`
        (a subclass with another layout overrides this and `project`)."""
        d, hk, dk, dv, r = cfg.hidden_size, self.hk, self.dk, self.dv, self.r
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.in_proj_qkvz = Dense(d, hk * (2 * dk + 2 * r * dv), ("embed", "heads"), cfg, **kw)
        self.in_proj_ba = Dense(d, hk * 2 * r, ("embed", "heads"), cfg, **kw)

    def project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [B, T, D] -> (q, k [B, T, Hk, dk], v, z [B, T, Hv, dv], b, a [B, T, Hv]), raw: before
        the conv and the gates."""
        b, t, _ = x.shape
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.r
        qkvz = self.in_proj_qkvz(x).reshape(b, t, hk, 2 * dk + 2 * r * dv)
        ba = self.in_proj_ba(x).reshape(b, t, hk, 2 * r)
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(b, t, hv, dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(b, t, hv, dv)
        beta_in, a = ba[..., :r].reshape(b, t, hv), ba[..., r:].reshape(b, t, hv)
        return qkvz[..., :dk], qkvz[..., dk : 2 * dk], v, z, beta_in, a

    def init_state(self, batch: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
        """(conv state [B, K-1, C] in `dtype`, recurrent state [B, Hv, dk, dv] fp32), zeros."""
        k, c = self.conv1d.kernel.shape
        return (
            jnp.zeros((batch, k - 1, c), dtype),
            jnp.zeros((batch, self.hv, self.dk, self.dv), jnp.float32),
        )

    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] -> (output [B, T, D], the new (conv, recurrent) state when `cache` is
        given). Training passes no cache: both states start at zero (and reset per document).
        A sequence laid out for context parallelism runs in its original order (the conv and
        the recurrence carry their state from token to token, across the devices' parts)."""
        if cache is None and context_parallel.sequence_order() is not None:
            seg = None if segment_ids is None else context_parallel.original(segment_ids)
            y, _ = self.mix(context_parallel.original(x), seg, None)
            return context_parallel.laid_out(y), None
        return self.mix(x, segment_ids, cache)

    def mix(
        self,
        x: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """`__call__` in the tokens' original order."""
        b, t, _ = x.shape
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        q, k, v, z, beta_in, a = self.project(x)
        z = constrain(z, ACT_HEADS)
        beta = jax.nn.sigmoid(beta_in)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        g, beta = constrain(g, ACT_HEAD_GATES), constrain(beta, ACT_HEAD_GATES)

        # The conv's channels are [q | k | v] (HF's order); each part is convolved on its own.
        conv_state, rec_state = cache if cache is not None else self.init_state(b, x.dtype)
        bounds = (0, hk * dk, 2 * hk * dk, 2 * hk * dk + hv * dv)
        convolved, states = [], []
        for i, part in enumerate((q, k, v)):
            lo, hi = bounds[i], bounds[i + 1]
            flat = constrain(part.reshape(b, t, hi - lo), ACT_HEAD_GATES)
            y, st = self.conv1d(flat, segment_ids, conv_state[..., lo:hi], (lo, hi))
            convolved.append(constrain(y.reshape(part.shape), ACT_HEADS))
            states.append(st)
        q, k, v = convolved
        conv_state = jnp.concatenate(states, axis=-1)

        initial = rec_state if cache is not None else None
        if cache is not None and t == 1:
            out, rec_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial)
        else:
            out, rec_state = chunked_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                chunk_size=self.chunk_size,
                initial_state=initial,
                segment_ids=segment_ids,
            )
        out = checkpoint_name(constrain(self.norm(out, z), ACT_HEADS), "attention_out")
        y = constrain(self.out_proj(out.reshape(b, t, hv * dv)), ACT_EMBED)
        return y, ((conv_state, rec_state) if cache is not None else None)


# ---- gated full attention -----------------------------------------------------------------------


def _partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE (rotate_half within the rotated dims) on the first cos.shape[-1] dims of x."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)


class GatedAttention(nnx.Module):
    """GQA self-attention with an output gate and zero-centred q/k norms (module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.impl = cfg.attention
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.q_proj = Dense(d, h * hd * 2, ("embed", "heads"), cfg, **kw)
        self.k_proj = Dense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
        self.v_proj = Dense(d, kvh * hd, ("embed", "kv_heads"), cfg, **kw)
        self.o_proj = Dense(h * hd, d, ("heads", "embed"), cfg, **kw)
        self.q_norm = RMSNorm(hd, cfg, eager_sharding=eager_sharding, zero_centred=True)
        self.k_norm = RMSNorm(hd, cfg, eager_sharding=eager_sharding, zero_centred=True)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """As qwen3.Attention: training attends within segment ids with the configured kernel;
        decoding writes k/v into the cache arrays at `index` and attends under `mask`."""
        b, t, _ = x.shape
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qg = constrain(self.q_proj(x).reshape(b, t, h, 2 * hd), ACT_HEADS)
        q = checkpoint_name(qg[..., :hd], "q_proj")
        gate = qg[..., hd:]
        k = checkpoint_name(
            constrain(self.k_proj(x).reshape(b, t, kvh, hd), ACT_KV_HEADS), "k_proj"
        )
        v = checkpoint_name(
            constrain(self.v_proj(x).reshape(b, t, kvh, hd), ACT_KV_HEADS), "v_proj"
        )
        q = _partial_rope(self.q_norm(q), cos, sin)
        k = _partial_rope(self.k_norm(k), cos, sin)
        new_kv = None
        if kv is None:
            out = attention.attend(q, k, v, segment_ids, impl=self.impl)
        else:
            assert index is not None and mask is not None
            cd = self.compute_dtype
            out, new_kv = attention.cached_attention(q, k, v, kv, index, mask, cd)
        out = checkpoint_name(constrain(out * jax.nn.sigmoid(gate), ACT_HEADS), "attention_out")
        return constrain(self.o_proj(out.reshape(b, t, h * hd)), ACT_EMBED), new_kv


# ---- MLP ----------------------------------------------------------------------------------------


class SharedExpertMoE(SparseMoE):
    """HF Qwen3NextSparseMoeBlock: SparseMoE's routed experts (paths `gate`, `experts`,
    `router_bias`, as qwen3_moe's) plus `shared_expert` (SwiGLU of shared_expert_intermediate_size)
    times sigmoid(`shared_expert_gate`(x)), a [hidden, 1] projection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        super().__init__(cfg, rngs=rngs, eager_sharding=eager_sharding)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.shared_expert = MLP(cfg, width=settings(cfg).shared_expert_intermediate_size, **kw)
        self.shared_expert_gate = Dense(cfg.hidden_size, 1, ("embed", None), cfg, **kw)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        routed, load = super().__call__(x)
        shared, _ = self.shared_expert(x)
        y = routed + jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
        return constrain(y, ACT_EMBED), load


# ---- decoder ------------------------------------------------------------------------------------


class Block(nnx.Module):
    """One decoder layer: the mixer its kind names, the MoE or dense MLP, two zero-centred norms."""

    #: The DeltaNet mixer's class (a family with another projection layout swaps it).
    deltanet: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs, eager_sharding: bool):
        d = cfg.hidden_size
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.linear = kind.linear
        if kind.linear:
            self.linear_attn = self.deltanet(cfg, **kw)
        else:
            self.self_attn = GatedAttention(cfg, **kw)
        self.mlp = SharedExpertMoE(cfg, **kw) if kind.moe else MLP(cfg, **kw)
        self.input_layernorm = RMSNorm(d, cfg, eager_sharding=eager_sharding, zero_centred=True)
        self.post_attention_layernorm = RMSNorm(
            d, cfg, eager_sharding=eager_sharding, zero_centred=True
        )

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple | None = None,
        index: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple | None, jax.Array | None]:
        """-> (x, the layer's new cache when decoding, expert load [E] or None for a dense MLP).
        `cache`: (k, v) for attention layers, (conv, recurrent) states for DeltaNet layers."""
        x = constrain(x, ACT_EMBED)
        h = self.input_layernorm(x)
        if self.linear:
            mixed, new_cache = self.linear_attn(h, segment_ids, cache)
        else:
            mixed, new_cache = self.self_attn(h, cos, sin, segment_ids, cache, index, mask)
        x = constrain(x + mixed, ACT_EMBED)
        y, load = self.mlp(self.post_attention_layernorm(x))
        return constrain(x + y, ACT_EMBED), new_cache, load


class Qwen3NextCache(NamedTuple):
    """Decoding state, per layer in layer order: `k`/`v` [B, max_len, KV, hd] for the attention
    layers; `conv` [B, K-1, C] (the last conv inputs) and `state` [B, Hv, dk, dv] (fp32) for the
    DeltaNet layers; `index`, the number of tokens already seen."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]
    index: jax.Array


class Qwen3NextDecoder(DecoderBase):
    """Qwen3-Next causal LM: token ids in, float32 logits out."""

    #: The decoder layer's class (a family with another DeltaNet layout swaps it).
    block: type[Block] = Block

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False):
        self.cfg = cfg
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.kinds = tuple(layer_kinds(cfg))
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.embed_tokens = Embed(cfg, **kw)
        if cfg.scan_layers:
            self.layers = build_periods(
                lambda kind, r: self.block(cfg, kind, rngs=r, eager_sharding=False),
                self.kinds,
                rngs,
                eager_sharding=eager_sharding,
            )
        else:
            self.layers = nnx.List([self.block(cfg, kind, **kw) for kind in self.kinds])
        self.norm = RMSNorm(cfg.hidden_size, cfg, eager_sharding=eager_sharding, zero_centred=True)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, **kw)

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos/sin [B, T, rotary dims] of the full-attention layers, batch-sharded."""
        cos, sin = rope_tables(positions, rotary_dim(self.cfg), self.cfg.rope_theta)
        return constrain(cos, ACT_ROPE), constrain(sin, ACT_ROPE)

    def forward_hidden(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """Final-normed hidden states [B, T, D] and the stats of the M MoE layers stacked in
        layer order (load [M, E], the rows `moe.update_router_bias` expects; dropped [M]), None
        without any."""
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        cos, sin = self._rope(positions)
        x, stats = self.run_layers(x, cos, sin, segment_ids)
        return self.final_norm(x), stats

    # ---- decoding -----------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> Qwen3NextCache:
        """An empty cache: max_len KV slots per attention layer, zero states per DeltaNet layer
        (the conv window in `dtype`, default compute_dtype; the recurrent state fp32)."""
        dtype = self.compute_dtype if dtype is None else dtype
        kv_shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.resolved_head_dim)
        ks, convs, states = [], [], []
        for block in self.layer_list():
            if block.linear:
                conv, state = block.linear_attn.init_state(batch, dtype)
                convs.append(conv)
                states.append(state)
            else:
                ks.append(jnp.zeros(kv_shape, dtype))
        return Qwen3NextCache(
            k=tuple(ks),
            v=tuple(jnp.zeros_like(k) for k in ks),
            conv=tuple(convs),
            state=tuple(states),
            index=jnp.zeros((), jnp.int32),
        )

    def decode(
        self, inputs: jax.Array, positions: jax.Array, cache: Qwen3NextCache
    ) -> tuple[jax.Array, Qwen3NextCache]:
        """T new tokens against the cache (a prefill, or a step with T = 1), like
        qwen3.decoder.Qwen3Decoder.decode; the caller keeps index + T <= max_len."""
        t = inputs.shape[1]
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        cos, sin = self._rope(positions)
        mask = cache_mask(cache.index, t, cache.k[0].shape[1]) if cache.k else None
        ks, vs, convs, states = list(cache.k), list(cache.v), list(cache.conv), list(cache.state)
        a = d = 0
        for block in self.layer_list():
            if block.linear:
                x, (convs[d], states[d]), _ = block(x, cos, sin, None, (convs[d], states[d]))
                d += 1
            else:
                x, (ks[a], vs[a]), _ = block(x, cos, sin, None, (ks[a], vs[a]), cache.index, mask)
                a += 1
        new = Qwen3NextCache(tuple(ks), tuple(vs), tuple(convs), tuple(states), cache.index + t)
        return self.logits(self.final_norm(x)), new


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Qwen3NextDecoder:
    return Qwen3NextDecoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
