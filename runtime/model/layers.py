"""The layers every decoder family builds from: dtypes, the normal initialiser, Dense, Embed,
RMSNorm and RoPE, the logical names of activations, and the stacking of layers for a scan.
Parameters and activations carry logical axis names only; mesh placement is sharding.py's."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jobspec.run_config import ModelConfig
from runtime.model.sharding import constrain

#: Logical names of the activations model code pins with `constrain` (one per dimension): the
#: residual stream, attention q / k,v per head, the MLP hidden, MoE per-expert hiddens, logits.
#: `batch` takes the slice x data x fsdp axes, so every chip holds 1/devices of the batch.
ACT_EMBED = ("batch", "length", "embed")
ACT_HEADS = ("batch", "length", "heads", None)
ACT_KV_HEADS = ("batch", "length", "kv_heads", None)
ACT_MLP = ("batch", "length", "mlp")
ACT_EXPERT = ("batch", "length", "expert")
ACT_EXPERT_MLP = ("batch", "length", "expert", "mlp")
ACT_VOCAB = ("batch", "length", "vocab")
ACT_ROPE = ("batch", "length", None)

#: The logical name of the leading axis of parameters stacked by `stack_layers`.
LAYERS_AXIS = "layers"

_DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str) -> Any:
    """The jnp dtype for a config dtype name ("float32" | "bfloat16")."""
    return _DTYPES[name]


def normal_param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    std: float,
    param_dtype: Any,
    eager_sharding: bool,
) -> nnx.Param:
    """A plain (not truncated) normal `nnx.Param`, like HF's `_init_weights`, with logical axis
    `names`. Drawn in fp32 and then cast, so a bf16-stored model holds the rounded values of the
    fp32 model with the same seed. (Here rather than in runtime.model, which imports this module.)
    """
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(param_dtype), out_sharding=names, eager_sharding=eager_sharding)


class Dense(nnx.Module):
    """Bias-free projection with a [in, out] kernel."""

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
        self.kernel = normal_param(
            rngs, (d_in, d_out), names, cfg.init_std, dtype_of(cfg.param_dtype), eager_sharding
        )
        self.compute_dtype = dtype_of(cfg.compute_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...d,df->...f", x, self.kernel[...].astype(self.compute_dtype))


class Embed(nnx.Module):
    """Token embedding table [vocab, hidden]; also the lm head when tied."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        self.embedding = normal_param(
            rngs,
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            cfg.init_std,
            dtype_of(cfg.param_dtype),
            eager_sharding,
        )
        self.compute_dtype = dtype_of(cfg.compute_dtype)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], inputs, axis=0).astype(self.compute_dtype)


class RMSNorm(nnx.Module):
    """HF Qwen3RMSNorm: statistics in fp32, result cast back to the input dtype, times weight.

    `zero_centred` is HF Qwen3NextRMSNorm instead: the weight is stored as w (initialised to 0)
    and applied as (1 + w), in fp32 before the cast back."""

    def __init__(
        self, dim: int, cfg: ModelConfig, *, eager_sharding: bool, zero_centred: bool = False
    ) -> None:
        init = jnp.zeros if zero_centred else jnp.ones
        self.scale = nnx.Param(
            init((dim,), dtype_of(cfg.param_dtype)),
            out_sharding=("norm",),
            eager_sharding=eager_sharding,
        )
        self.eps = cfg.rms_norm_eps
        self.zero_centred = zero_centred

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.zero_centred:
            return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


#: Policies per ModelConfig.remat; "none" (absent) means no checkpoint wrapper at all.
REMAT_POLICIES: dict[str, Any] = {
    # Keep projection/MLP matmul outputs (dots without batch dims), recompute the cheap rest.
    "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep nothing but the block's inputs; recompute the whole block in the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
}


def remat_call(policy: Any, fn: Any, module: nnx.Module, *args: Any) -> Any:
    """fn(module, *args) under `jax.checkpoint(policy)`, as a pure function of the module's split
    state: the forward mutates nothing, and this (unlike nnx.remat) does not write non-Param
    variables such as the MoE router bias back across trace levels."""
    graphdef, state = nnx.split(module)

    def pure(state: Any, *args: Any) -> Any:
        return fn(nnx.merge(graphdef, state), *args)

    return jax.checkpoint(pure, policy=policy, prevent_cse=True)(state, *args)


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma's final_logit_softcapping)."""
    return jnp.tanh(logits / cap) * cap


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, rotated: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """fp32 cos/sin [B, T, head_dim] for integer positions [B, T], HF default RoPE; with
    `rotated` r only the first r frequencies turn and the rest are 0 (identity): HF's
    proportional RoPE, which pairs dims [0, r) with [head_dim/2, head_dim/2 + r)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rotated is not None:
        inv_freq = jnp.where(jnp.arange(head_dim // 2) < rotated, inv_freq, 0.0)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


@functools.lru_cache(maxsize=16)
def _rotate_half_matrix(d: int) -> np.ndarray:
    """R [d, d] with x @ R = rotate_half(x) = [-x[d/2:], x[:d/2]]: one +-1 per column."""
    half = d // 2
    r = np.zeros((d, d), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, N, D] in the "rotate_half" convention; done in fp32, cast back.

    rotate_half is a product with a signed permutation matrix rather than two half-width slices
    and a concatenate: on TPU the halves of a 128-wide head fill half the vector lanes, and the
    slices cost more than the matmul. The product is exact (each output is one +-x term,
    accumulated in fp32 at HIGHEST precision, so also for an fp32 x and in the backward pass): the
    same values as the slices, bit for bit.
    """
    x32 = x.astype(jnp.float32)
    r = jnp.asarray(_rotate_half_matrix(x.shape[-1]))
    rotated = jnp.einsum("btnd,de->btne", x32, r, precision=lax.Precision.HIGHEST)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def constrain_logits(logits: jax.Array) -> jax.Array:
    """Pin logits (or a chunk of them along length) [B, T, vocab] to batch sharding, vocab over
    `tensor`; a no-op outside `sharding.activation_mesh`. For a loss that computes them itself."""
    return constrain(logits, ACT_VOCAB)


def stack_layers(layers: list[nnx.Module], *, eager_sharding: bool = False) -> nnx.Module:
    """One module of `layers[0]`'s structure whose every variable is the stack of the layers' own
    along a new leading axis (logical name `LAYERS_AXIS`, prepended to each Param's out_sharding,
    so `nnx.get_partition_spec` names it). Layer i of the stack holds exactly layer i's values,
    so a scanned model has the same parameters as the unrolled one built from the same seed.
    Each stacked variable is created anew with the layers' metadata; with `eager_sharding` a
    Param is placed by its stacked names at creation (the logical rules in context must then
    name `layers`, as sharding.py's do), so the layers themselves should be built unsharded.
    """
    graphdef, *_ = nnx.split(layers[0])
    states = [nnx.state(layer) for layer in layers]

    def stack(*vs: nnx.Variable) -> nnx.Variable:
        meta = dict(vs[0].get_metadata())
        if meta.get("out_sharding") is not None:
            meta["out_sharding"] = (LAYERS_AXIS, *meta["out_sharding"])
        if "eager_sharding" in meta:
            meta["eager_sharding"] = eager_sharding
        return type(vs[0])(jnp.stack([v[...] for v in vs]), **meta)

    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)
