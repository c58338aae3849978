"""The "deepseek_v3" family: DeepSeek-V3's decoder, computing what HF `DeepseekV3ForCausalLM`
(transformers 5.23, `models/deepseek_v3/modeling_deepseek_v3.py`) does.

Every layer is pre-norm, `x + self_attn(input_layernorm(x))` then
`x + mlp(post_attention_layernorm(x))`, with plain RMSNorms (weight times the fp32-normed input).
The attention is multi-head latent attention (mla.py); the MLP is the dense SwiGLU of width
`intermediate_size` on the first `first_k_dense_replace` layers and the MoE with shared experts
(moe.py) on the rest. The head is untied unless `tie_word_embeddings`. Multi-token-prediction
layers are not built (`num_nextn_predict_layers`: their HF tensors are skipped on import).

Packed documents (segment ids) are masked per document by the attention kernel, as in every
family; positions restart per document and feed RoPE only.

Decoding (`init_cache`/`decode`, what `sample` runs): per layer the normed KV latent
[B, max_len, 1, kv_lora_rank] and the rotated shared key [B, max_len, 1, qk_rope_head_dim]
(compute dtype; stacked per group when scanned), attended in the latent space (mla.py).

`model.scan_layers` (the default) stacks the layers in two groups, since dense and MoE layers
differ: `layers.dense` (the first `first_k_dense_replace`) and `layers.moe` (the rest), each one
`Block` whose every variable has a leading [group size] axis (logical name "layers"), each run
as one `jax.lax.scan` (under the remat policy), so compile time does not grow with depth; layer
i is slice i of `layers.dense`, or slice i - first_k_dense_replace of `layers.moe` (a group
without layers is absent). The router bias is then `layers.moe.mlp.router_bias` [M, E], the
stacked form `moe.update_router_bias` steps. With `scan_layers = false` `layers` is an
`nnx.List`, paths `layers.{i}.…` mirroring HF's names (table in hf_names.py). Both build the
same values from the same seed (the groups follow each other in layer order).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jobspec.families.model_config import ModelConfig
from runtime.model.decoder import DecoderBase, cache_mask, layer_forward
from runtime.model.deepseek_v3.mla import MLA, rope_tables, settings
from runtime.model.deepseek_v3.moe import DeepseekMoE
from runtime.model.layers import (
    ACT_EMBED,
    REMAT_POLICIES,
    Dense,
    Embed,
    RMSNorm,
    build_stacked,
    dtype_of,
)
from runtime.model.moe.layer import MoEStats
from runtime.model.qwen3.decoder import MLP
from runtime.model.sharding import constrain


def moe_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer: MoE (else the dense MLP)."""
    return settings(cfg).moe_layers(cfg.num_layers)


class Block(nnx.Module):
    """One decoder layer: latent attention, the MoE or dense MLP, two RMSNorms."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs, eager_sharding: bool):
        d = cfg.hidden_size
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.self_attn = MLA(cfg, **kw)
        self.mlp = DeepseekMoE(cfg, **kw) if moe else MLP(cfg, **kw)
        self.input_layernorm = RMSNorm(d, cfg, eager_sharding=eager_sharding)
        self.post_attention_layernorm = RMSNorm(d, cfg, eager_sharding=eager_sharding)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        cache: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, MoEStats | None]:
        """-> (x, the layer's new (latent, k_rot) cache when decoding, MoE stats or None)."""
        x = constrain(x, ACT_EMBED)
        attn, new_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, segment_ids, cache, index, mask
        )
        x = constrain(x + attn, ACT_EMBED)
        y, stats = self.mlp(self.post_attention_layernorm(x))
        return constrain(x + y, ACT_EMBED), new_cache, stats


class LayerGroups(nnx.Module):
    """The scanned layers (module docstring): `dense` and `moe`, each a stacked `Block` or None."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool):
        moe = moe_layers(cfg)
        for name, kind in (("dense", False), ("moe", True)):
            n = sum(1 for m in moe if m == kind)
            stacked = None
            if n:
                stacked = build_stacked(
                    lambda r, kind=kind: Block(cfg, kind, rngs=r, eager_sharding=False),
                    rngs,
                    n,
                    eager_sharding=eager_sharding,
                )
            setattr(self, name, stacked)

    def groups(self) -> Iterator[Block]:
        """The stacked groups in layer order."""
        yield from (g for g in (self.dense, self.moe) if g is not None)


def _scan(policy: Any, stacked: Block, x: jax.Array, *args: Any) -> tuple[jax.Array, Any]:
    """The stacked blocks as one `lax.scan` over their split state (layer i's slice per step),
    the remat `policy` (None: none) around the body -> (x, the MoE stats stacked or None)."""
    graphdef, state = nnx.split(stacked)

    def body(x: jax.Array, layer_state: Any) -> tuple[jax.Array, MoEStats | None]:
        return layer_forward(nnx.merge(graphdef, layer_state), x, *args)

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return lax.scan(body, x, state)


class MLACache(NamedTuple):
    """Decoding state: `latent` [B, max_len, 1, kv_lora_rank] and `k_rot`
    [B, max_len, 1, qk_rope_head_dim] per layer (unrolled), or per group stacked
    [group size, B, ...] (scanned); `index`, the number of tokens already seen."""

    latent: tuple[jax.Array, ...]
    k_rot: tuple[jax.Array, ...]
    index: jax.Array


class DeepseekV3Decoder(DecoderBase):
    """DeepSeek-V3 causal LM: token ids in, float32 logits out."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False):
        self.cfg = cfg
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding}
        self.embed_tokens = Embed(cfg, **kw)
        if cfg.scan_layers:
            self.layers = LayerGroups(cfg, **kw)
        else:
            self.layers = nnx.List([Block(cfg, moe, **kw) for moe in moe_layers(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg, eager_sharding=eager_sharding)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, **kw)

    def forward_hidden(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """Final-normed hidden states [B, T, D] and the stats of the MoE layers stacked in layer
        order (load [M, E], the rows `moe.update_router_bias` expects), None without any."""
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        cos, sin = rope_tables(self.cfg, positions)
        if not self.cfg.scan_layers:
            x, stats = self.run_layers(x, cos, sin, segment_ids)
            return self.final_norm(x), stats
        policy = REMAT_POLICIES.get(self.cfg.remat)
        found = []
        for group in self.layers.groups():
            x, group_stats = _scan(policy, group, x, cos, sin, segment_ids)
            found.append(group_stats)
        stats = [s for s in found if s is not None]
        return self.final_norm(x), stats[0] if stats else None

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> MLACache:
        """An empty cache of max_len slots per layer (dtype defaults to compute_dtype)."""
        dtype = self.compute_dtype if dtype is None else dtype
        d = settings(self.cfg)
        moe = moe_layers(self.cfg)
        sizes = [sum(1 for m in moe if m == k) for k in (False, True)]
        lead = [(n,) for n in sizes if n] if self.cfg.scan_layers else [()] * len(moe)

        def zeros(width: int) -> tuple[jax.Array, ...]:
            return tuple(jnp.zeros((*pre, batch, max_len, 1, width), dtype) for pre in lead)

        return MLACache(zeros(d.kv_lora_rank), zeros(d.qk_rope_head_dim), jnp.zeros((), jnp.int32))

    def decode(
        self, inputs: jax.Array, positions: jax.Array, cache: MLACache
    ) -> tuple[jax.Array, MLACache]:
        """T new tokens against the cache (a prefill, or a step with T = 1), like
        qwen3.decoder.Qwen3Decoder.decode; the caller keeps index + T <= max_len."""
        t = inputs.shape[1]
        x = constrain(self.embed_tokens(inputs), ACT_EMBED)
        cos, sin = rope_tables(self.cfg, positions)
        mask = cache_mask(cache.index, t, cache.latent[0].shape[-3])
        step = (cos, sin, None)
        blocks = self.layers.groups() if self.cfg.scan_layers else self.layers
        latents, k_rots = [], []
        for block, lat, rot in zip(blocks, cache.latent, cache.k_rot, strict=True):
            if self.cfg.scan_layers:
                x, (lat, rot) = _scan_decode(block, x, (lat, rot), step, cache.index, mask)
            else:
                x, (lat, rot), _ = block(x, *step, (lat, rot), cache.index, mask)
            latents.append(lat)
            k_rots.append(rot)
        new = MLACache(tuple(latents), tuple(k_rots), cache.index + t)
        return self.logits(self.final_norm(x)), new


def _scan_decode(
    stacked: Block, x: jax.Array, cache: tuple, step: tuple, index: jax.Array, mask: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """A stacked group's decode: one scan over (layer state, its cache slices)."""
    graphdef, state = nnx.split(stacked)

    def body(x: jax.Array, xs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        layer_state, lat, rot = xs
        x, new, _ = nnx.merge(graphdef, layer_state)(x, *step, (lat, rot), index, mask)
        return x, new

    return lax.scan(body, x, (state, *cache))


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> DeepseekV3Decoder:
    return DeepseekV3Decoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
