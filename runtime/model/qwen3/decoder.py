"""The Qwen3 decoder in Flax NNX, which the dense "qwen3" family builds with SwiGLU MLPs and
qwen3_moe and qwen2 build with their own MLP or attention.

The math follows Hugging Face `Qwen3ForCausalLM` exactly (a later parity test checks logits to
1e-4): fp32 RMSNorm `x * rsqrt(mean(x^2) + eps) * weight`, q/k RMSNorm over head_dim per head
before RoPE, "rotate_half" RoPE (first half / second half), GQA with query head h reading kv head
h // (num_heads / num_kv_heads), scale 1/sqrt(head_dim), SwiGLU, no biases, final norm, tied or
separate lm head.

Parameters carry LOGICAL axis names as flax `out_sharding` metadata (see `LOGICAL_AXES`); model
code never names mesh axes. `runtime/model/sharding.py` maps logical names to mesh axes, e.g.::

    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))

Kernels are stored [in, out] so an HF `weight` maps in by a plain transpose. Paths mirror HF:
`embed_tokens.embedding`, `layers[i].self_attn.{q,k,v,o}_proj.kernel`,
`layers[i].self_attn.{q,k}_norm.scale`, `layers[i].{input,post_attention}_layernorm.scale`,
`layers[i].mlp.{gate,up,down}_proj.kernel`, `norm.scale`, `lm_head.kernel` (untied only).

`model.scan_layers` (the default) stacks the blocks instead: `layers` is ONE `Block` whose every
variable has a leading [num_layers] axis (logical name "layers", replicated), so the paths lose
the index (`layers.self_attn.q_proj.kernel` [L, hidden, heads*head_dim]) and slice i is layer i
of the unrolled model built from the same seed (`layers.stack_layers`). The forward pass is one
`jax.lax.scan` over that stacked state (the remat policy wraps the scanned body), so compile time
does not grow with depth; decoding scans too, with the KV cache stacked [L, ...]. With
`scan_layers = false` `layers` is an `nnx.List` of per-layer Blocks, as before.

Activations are pinned with `sharding.constrain` (a no-op outside `activation_mesh`) at every
block boundary ([batch, length, embed]), on q/k/v and the attention output (per head), on the MLP
hidden, on the embedding output, the final hidden states and the logits, so GSPMD keeps 1/devices
of the batch on every chip and gathers weights (FSDP) instead of activations.

The layer MLP and attention are per-family choices (`Qwen3Decoder(..., mlp_factory=...,
attention_factory=...)`): dense SwiGLU `MLP` and q/k-normed `Attention` here;
`runtime/model/qwen3_moe/` passes `runtime.model.moe.layer.SparseMoE` (paths documented there),
whose per-layer expert loads `Qwen3Decoder.forward_with_loads` also returns, and
`runtime/model/qwen2/` its biased attention. Model code never tests the family string;
`runtime/model/registry.py` maps family names to builders. The logits, the expert-load forward
and the remat'd layer loop are `runtime/model/decoder.py`'s.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jobspec.families.model_config import ModelConfig
from runtime.model.attention import kernels as attention
from runtime.model.decoder import DecoderBase, cache_mask, layer_forward
from runtime.model.layers import (
    ACT_EMBED,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_MLP,
    ACT_ROPE,
    REMAT_POLICIES,
    Dense,
    Embed,
    RMSNorm,
    apply_rope,
    build_stacked,
    dtype_of,
    rope_tables,
)
from runtime.model.moe.layer import MoEStats
from runtime.model.sharding import constrain

#: `checkpoint_name`s on the attention activations, for a name-based remat policy
#: (`jax.checkpoint_policies.save_only_these_names`): the q/k/v projections (before q/k norm and
#: RoPE, which are cheap to redo) and the attention output (the o_proj input).
ATTENTION_CHECKPOINT_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "attention_out")


class KVCache(NamedTuple):
    """Decoding state: per-layer keys/values [B, max_len, kv_heads, head_dim] and the fill index.

    Unscanned layers keep a tuple of per-layer arrays; scanned layers (`model.scan_layers`) one
    stacked array [num_layers, B, max_len, kv_heads, head_dim] each for k and v (so `k[i]` is
    layer i's either way). `index` (int32 scalar) is the number of slots already written; the
    next `decode` call writes its T tokens at slots index..index+T-1. A pytree, so it passes
    through jit and loops.
    """

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    index: jax.Array


class Attention(nnx.Module):
    """GQA self-attention with per-head q/k RMSNorm before RoPE.

    A family whose attention differs only there sets the class attributes (qwen2: biased q/k/v
    projections, no q/k norm): `qkv_bias` gives q/k/v_proj a bias (o_proj never has one),
    `qk_norm` says whether q_norm/k_norm exist and apply."""

    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        d, hd = cfg.hidden_size, cfg.resolved_head_dim
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = hd
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        qkv_kw = {**kw, "bias": self.qkv_bias}
        self.q_proj = Dense(d, cfg.num_heads * hd, ("embed", "heads"), cfg, **qkv_kw)
        self.k_proj = Dense(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg, **qkv_kw)
        self.v_proj = Dense(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg, **qkv_kw)
        self.o_proj = Dense(cfg.num_heads * hd, d, ("heads", "embed"), cfg, **kw)
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, cfg, eager_sharding=eager_sharding)
            self.k_norm = RMSNorm(hd, cfg, eager_sharding=eager_sharding)
        self.impl = cfg.attention

    def heads(self, proj: nnx.Module, x: jax.Array, n: int, names: tuple, name: str) -> jax.Array:
        """proj(x) [B, T, n * hd] as n heads [B, T, n, hd], pinned per head, named for remat."""
        b, t, _ = x.shape
        return checkpoint_name(constrain(proj(x).reshape(b, t, n, self.head_dim), names), name)

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values [B, T, heads, hd] before RoPE (q and k normed if qk_norm)."""
        q = self.heads(self.q_proj, x, self.num_heads, ACT_HEADS, "q_proj")
        k = self.heads(self.k_proj, x, self.num_kv_heads, ACT_KV_HEADS, "k_proj")
        v = self.heads(self.v_proj, x, self.num_kv_heads, ACT_KV_HEADS, "v_proj")
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

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
        """x [B,T,D]; training: causal within `segment_ids` [B,T] via the configured kernel.
        Decoding: kv (cache arrays [B,S,KV,hd]) at `index`, with the dense `mask` [B|1,T,S]."""
        q, k, v = self.qkv(x)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        if kv is None:
            out = attention.attend(q, k, v, segment_ids, impl=self.impl)
            return self._out(out), None
        assert index is not None and mask is not None
        out, new_kv = attention.cached_attention(q, k, v, kv, index, mask, self.compute_dtype)
        return self._out(out), new_kv

    def _out(self, out: jax.Array) -> jax.Array:
        """The attention output [B, T, H, hd] (pinned per head, named for remat) -> o_proj."""
        b, t, h, hd = out.shape
        out = checkpoint_name(constrain(out, ACT_HEADS), "attention_out")
        return constrain(self.o_proj(out.reshape(b, t, h * hd)), ACT_EMBED)


class LayerFactory(Protocol):
    """Builds a layer's attention or MLP from the config (an MLP module maps x [B, T, D] to
    (y [B, T, D], MoE stats | None))."""

    def __call__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> nnx.Module: ...


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); no expert load (returns (y, None)). `width` defaults
    to cfg.intermediate_size (another width: e.g. Qwen3-Next's shared expert)."""

    def __init__(
        self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool, width: int | None = None
    ) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size if width is None else width
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.gate_proj = Dense(d, f, ("embed", "mlp"), cfg, **kw)
        self.up_proj = Dense(d, f, ("embed", "mlp"), cfg, **kw)
        self.down_proj = Dense(f, d, ("mlp", "embed"), cfg, **kw)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        gate = constrain(self.gate_proj(x), ACT_MLP)
        up = constrain(self.up_proj(x), ACT_MLP)
        hidden = constrain(jax.nn.silu(gate) * up, ACT_MLP)
        return constrain(self.down_proj(hidden), ACT_EMBED), None


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)).

    The attention and the MLP come from `attention_factory` and `mlp_factory`: q/k-normed
    `Attention` and SwiGLU `MLP` for the dense family, the family's choice otherwise (e.g. the
    sparse MoE block).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        eager_sharding: bool,
        mlp_factory: LayerFactory = MLP,
        attention_factory: LayerFactory = Attention,
    ) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg, eager_sharding=eager_sharding)
        self.self_attn = attention_factory(cfg, rngs=rngs, eager_sharding=eager_sharding)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg, eager_sharding=eager_sharding)
        self.mlp = mlp_factory(cfg, rngs=rngs, eager_sharding=eager_sharding)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, MoEStats | None]:
        """-> (x, new_kv, stats): the MoE block's `MoEStats`, None for a dense MLP.

        The block's input, residual and output are pinned to [batch, length, embed]."""
        x = constrain(x, ACT_EMBED)
        attn, new_kv = self.self_attn(
            self.input_layernorm(x), cos, sin, segment_ids, kv, index, mask
        )
        x = constrain(x + attn, ACT_EMBED)
        y, load = self.mlp(self.post_attention_layernorm(x))
        return constrain(x + y, ACT_EMBED), new_kv, load


def _scan_blocks(
    policy: Any,
    stacked: Block,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    segment_ids: jax.Array | None,
) -> tuple[jax.Array, MoEStats | None]:
    """The stacked blocks as one `lax.scan` over their split state (layer i's slice per step):
    -> (x after the last block, the MoE stats stacked [L, ...] or None). `policy` (None: no remat) wraps the body,
    so the backward pass keeps only what it names per layer (at least each block's input)."""
    graphdef, state = nnx.split(stacked)

    def body(x: jax.Array, layer_state: Any) -> tuple[jax.Array, MoEStats | None]:
        return layer_forward(nnx.merge(graphdef, layer_state), x, cos, sin, segment_ids)

    if policy is not None:
        # Inside scan, CSE across iterations cannot undo the remat, so prevent_cse can be off.
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return lax.scan(body, x, state)


class Qwen3Decoder(DecoderBase):
    """Qwen3 causal LM: token ids in, float32 logits out.

    `eager_sharding=False` (default) only records logical names, so the model builds without a
    mesh; shard by jitting the init with out_shardings from `nnx.get_partition_spec` under logical
    axis rules. `True` lets flax shard each Param at creation (needs a mesh and rules in context).
    `mlp_factory` and `attention_factory` build every layer's MLP and attention (see `Block`).
    `cfg.scan_layers` stacks the blocks into one scanned `Block` (see the module docstring).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        eager_sharding: bool = False,
        mlp_factory: LayerFactory = MLP,
        attention_factory: LayerFactory = Attention,
    ) -> None:
        self.cfg = cfg
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        self.embed_tokens = Embed(cfg, rngs=rngs, eager_sharding=eager_sharding)
        parts = {"mlp_factory": mlp_factory, "attention_factory": attention_factory}
        if cfg.scan_layers:
            # The unrolled model's draws, in its order, by one build looped over the layers
            # (`build_stacked`: the init program does not grow with depth); when eager, the
            # stack is sharded as a whole, so the layers themselves are not.
            self.layers = build_stacked(
                lambda r: Block(cfg, eager_sharding=False, rngs=r, **parts),
                rngs,
                cfg.num_layers,
                eager_sharding=eager_sharding,
            )
        else:
            blocks = [
                Block(cfg, rngs=rngs, eager_sharding=eager_sharding, **parts)
                for _ in range(cfg.num_layers)
            ]
            self.layers = nnx.List(blocks)
        self.norm = RMSNorm(cfg.hidden_size, cfg, eager_sharding=eager_sharding)
        if not cfg.tie_word_embeddings:
            kw = {"rngs": rngs, "eager_sharding": eager_sharding}
            self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, **kw)

    def forward_hidden(
        self,
        inputs: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, MoEStats | None]:
        """The final-normed hidden states [B, T, D] (compute dtype, pinned to batch sharding)
        and the MoE layers' stats stacked over layers (`runtime.model.moe.layer.MoEStats`: load
        [L, E], dropped [L]; None for a dense MLP); the loss applies `head_kernel` to the states
        chunk by chunk instead of materialising all logits."""
        cos, sin = self._rope(positions)
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        if self.cfg.scan_layers:
            policy = REMAT_POLICIES.get(self.cfg.remat)
            x, stacked = _scan_blocks(policy, self.layers, x, cos, sin, segment_ids)
        else:
            x, stacked = self.run_layers(x, cos, sin, segment_ids)
        return self.final_norm(x), stacked

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE cos/sin [B, T, head_dim], batch-sharded like the activations they rotate."""
        cos, sin = rope_tables(positions, self.cfg.resolved_head_dim, self.cfg.rope_theta)
        return constrain(cos, ACT_ROPE), constrain(sin, ACT_ROPE)

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty cache of max_len slots per sequence (dtype defaults to compute_dtype); k and v
        stacked [num_layers, ...] for scanned layers, per-layer tuples otherwise."""
        dtype = self.compute_dtype if dtype is None else dtype
        shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.resolved_head_dim)
        n = self.cfg.num_layers
        if self.cfg.scan_layers:
            zeros = jnp.zeros((n, *shape), dtype)
            return KVCache(k=zeros, v=zeros, index=jnp.zeros((), jnp.int32))
        return KVCache(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
            index=jnp.zeros((), jnp.int32),
        )

    def decode(
        self, inputs: jax.Array, positions: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """Run T new tokens against the cache: prefill (T = prompt length) or a step (T = 1).

        The tokens go to slots cache.index..index+T-1; each attends to every slot up to its own.
        Fixed shapes, so one jit serves every step. The caller keeps index + T <= max_len
        (dynamic_update_slice would clamp, not fail). Scanned layers scan over (layer state,
        layer cache) and return the stacked cache.
        """
        t = inputs.shape[1]
        mask = cache_mask(cache.index, t, cache.k[0].shape[1])
        cos, sin = self._rope(positions)
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        if self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x: jax.Array, xs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
                layer_state, ck, cv = xs
                block = nnx.merge(graphdef, layer_state)
                x, new_kv, _ = block(x, cos, sin, None, (ck, cv), cache.index, mask)
                return x, new_kv

            x, (new_k, new_v) = lax.scan(body, x, (state, cache.k, cache.v))
            return self.logits(self.final_norm(x)), KVCache(new_k, new_v, cache.index + t)
        new_k, new_v = [], []
        for block, ck, cv in zip(self.layers, cache.k, cache.v, strict=True):
            x, (nk, nv), _ = block(x, cos, sin, None, (ck, cv), cache.index, mask)
            new_k.append(nk)
            new_v.append(nv)
        return self.logits(self.final_norm(x)), KVCache(tuple(new_k), tuple(new_v), cache.index + t)


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> Qwen3Decoder:
    """The dense Qwen3 decoder (SwiGLU MLP in every layer)."""
    return Qwen3Decoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
