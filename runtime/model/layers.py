"""The layers every decoder family builds from: dtypes, the normal initialiser, Dense, Embed,
RMSNorm and RoPE, the logical names of activations, and the stacking of layers for a scan.
Parameters and activations carry logical axis names only; mesh placement is sharding.py's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jobspec.families.model_config import ModelConfig
from runtime.model.attention.kernels import SPLASH_RESIDUALS
from runtime.model.sharding import constrain, context_size

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

#: Every logical axis name a parameter may carry.
LOGICAL_AXES: tuple[str, ...] = (
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "mlp",
    "norm",
    "expert",
    LAYERS_AXIS,
)

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
    """Projection with a [in, out] kernel; `bias=True` adds a bias [out] (HF
    `nn.Linear(bias=True)`, zero at init), sharded like the output axis."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        names: tuple[str, str],
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        eager_sharding: bool,
        bias: bool = False,
    ) -> None:
        self.kernel = normal_param(
            rngs, (d_in, d_out), names, cfg.init_std, dtype_of(cfg.param_dtype), eager_sharding
        )
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        if bias:
            self.bias = nnx.Param(
                jnp.zeros((d_out,), dtype_of(cfg.param_dtype)),
                out_sharding=(names[1],),
                eager_sharding=eager_sharding,
            )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...d,df->...f", x, self.kernel[...].astype(self.compute_dtype))
        if hasattr(self, "bias"):
            y = y + self.bias[...].astype(self.compute_dtype)
        return y


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
        table = self.embedding[...]
        if context_size() > 1:
            # Rows gathered from a table split along embed come out split along embed, which
            # the partitioner cannot move to [batch, length] shards but by replicating them:
            # gather the (compute-dtype) table instead, as FSDP gathers every weight.
            table = constrain(table.astype(self.compute_dtype), ("vocab", None))
        return jnp.take(table, inputs, axis=0).astype(self.compute_dtype)


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


def _offloaded(*names: str) -> Any:
    """A policy that keeps the activations `names` in host memory (pinned_host) for the backward
    pass, copied out in the forward pass and back in the backward, and recomputes the rest."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=names,
        offload_src="device",
        offload_dst="pinned_host",
    )


#: Policies per `model.remat` (the names ModelConfig.remat allows); "none" (absent) means no
#: checkpoint wrapper at all. Each keeps, per layer, what it names for the backward pass (besides the
#: block's input) and recomputes the rest from it.
REMAT_POLICIES: dict[str, Any] = {
    # Projection/MLP matmul outputs (dots without batch dims); the cheap rest is recomputed.
    "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # The splash kernel's output and log-sum-exp, so the backward pass does not run the kernel's
    # forward again (the rest of the block is recomputed); without splash, as "full".
    "attention": jax.checkpoint_policies.save_only_these_names(SPLASH_RESIDUALS),
    # The same kept in host memory: HBM as "full", and a copy out and back per layer and step.
    "attention_host": _offloaded(SPLASH_RESIDUALS),
    # Nothing but the block's inputs; the whole block is recomputed in the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
    # A run compiles "auto" as "attention" or "full" (runtime.train.program.remat_choices), each
    # its own config; a step traced with "auto" itself, as a fallback, is "full": never short of
    # memory, and the same numbers.
    "auto": jax.checkpoint_policies.nothing_saveable,
}

#: The policies under which the backward pass does not run the attention kernel's forward again
#: (its FLOPs counted once in the plan's step time).
KEEPS_ATTENTION_KERNEL = frozenset({"none", "attention", "attention_host"})


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


def _stacked_variable(template: nnx.Variable, value: Any, eager_sharding: bool) -> nnx.Variable:
    """A variable of `template`'s type and metadata holding `value` (the layers' values stacked
    along a new leading axis): `LAYERS_AXIS` is prepended to its out_sharding, and its
    eager_sharding (where it has one) is `eager_sharding`."""
    meta = dict(template.get_metadata())
    if meta.get("out_sharding") is not None:
        meta["out_sharding"] = (LAYERS_AXIS, *meta["out_sharding"])
    if "eager_sharding" in meta:
        meta["eager_sharding"] = eager_sharding
    return type(template)(value, **meta)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


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
        return _stacked_variable(vs[0], jnp.stack([v[...] for v in vs]), eager_sharding)

    stacked = jax.tree.map(stack, *states, is_leaf=_is_variable)
    return nnx.merge(graphdef, stacked)


def _draws_per_layer(
    make: Callable[[nnx.Rngs], nnx.Module], keys: dict[str, jax.Array]
) -> tuple[dict[str, int], nnx.GraphDef, Any]:
    """Build one layer abstractly from fresh streams (`keys`, counters at 0) -> (how many keys
    it draws from each stream, its graphdef, its abstract state). Only the counters are computed
    (they are concrete, `ensure_compile_time_eval`); the keys and parameters stay abstract."""
    found: dict[str, Any] = {}

    def dry(keys: dict[str, jax.Array]) -> Any:
        with jax.ensure_compile_time_eval():
            rngs = nnx.Rngs(**keys)
            layer = make(rngs)
            found["counts"] = {name: stream.count[...] for name, stream in rngs.items()}
        found["graphdef"], state = nnx.split(layer)
        return state

    template = jax.eval_shape(dry, keys)
    try:
        draws = {name: int(count) for name, count in found["counts"].items()}
    except jax.errors.ConcretizationTypeError as e:  # pragma: no cover - a flax change
        raise RuntimeError("build_stacked: the layer's RNG draw count is not static") from e
    return draws, found["graphdef"], template


#: PRNG implementations whose batched random bits (`jax.vmap`) are key by key those of a loop. A
#: batched `rng_bit_generator` (rbg, unsafe_rbg) draws the whole batch from its first key, so for
#: those `build_stacked` runs the layer's build in a `lax.map` (a loop, also of one copy).
_VMAP_EXACT_IMPLS = ("threefry2x32",)


def build_stacked(
    make: Callable[[nnx.Rngs], nnx.Module],
    rngs: nnx.Rngs,
    num: int,
    *,
    eager_sharding: bool = False,
) -> nnx.Module:
    """`stack_layers([make(rngs) for _ in range(num)], eager_sharding=...)`, bit for bit, by an
    init program whose size does not grow with `num`.

    An `nnx.RngStream` derives its n-th key as fold_in(key, count) and then counts up, so if one
    layer draws k keys from a stream, layer i of the loop draws counts c0 + i*k ... c0 + i*k + k-1
    (c0: the count before the first layer). Here `make` runs once for layer index i with each
    stream's counter started at c0 + i*k: under a trace (`build_model`'s jitted init) in a
    `lax.map` over the layers, a loop of one copy of every initialiser; eagerly under `jax.vmap`
    (threefry keys only, see `_VMAP_EXACT_IMPLS`). The loop is for the compile: XLA's TPU compile
    time grows with the size of each random array, and Qwen3-0.6B's init compiled in 3 s with
    the loop against 24 s with the layers batched (deviceless v5e). The streams are then advanced
    by num*k, so whatever draws after the layers (final norm, head) gets the same keys as after
    the per-layer build. k comes from an abstract build of one layer. `make` must build a fresh
    layer from the streams it is given (build the layers unsharded: the stacked variables are
    created with `eager_sharding`).
    """
    streams = dict(rngs.items())
    keys = {name: stream.key[...] for name, stream in streams.items()}
    vmap_exact = all(str(jax.random.key_impl(key)) in _VMAP_EXACT_IMPLS for key in keys.values())
    traced = any(isinstance(key, jax.core.Tracer) for key in keys.values())
    if any(stream.count.shape != () for stream in streams.values()) or not (vmap_exact or traced):
        # Split (batched) streams; or rbg keys outside a trace, where `lax.map` would compile the
        # layer's build (not bitwise the eager ops): keep the layer-by-layer build.
        return stack_layers([make(rngs) for _ in range(num)], eager_sharding=eager_sharding)
    starts = {name: stream.count[...] for name, stream in streams.items()}
    draws, graphdef, template = _draws_per_layer(make, keys)

    def one_layer(i: jax.Array) -> Any:
        layer_rngs = nnx.Rngs(**keys)
        for name, stream in layer_rngs.items():
            stream.count.set_value(starts[name] + i * jnp.uint32(draws[name]))
        return jax.tree.map(lambda v: v[...], nnx.state(make(layer_rngs)), is_leaf=_is_variable)

    indices = jnp.arange(num, dtype=jnp.uint32)
    if traced:
        values = lax.map(one_layer, indices)
    else:
        values = jax.vmap(one_layer)(indices)
    for name, stream in streams.items():
        stream.count.set_value(starts[name] + jnp.uint32(num * draws[name]))
    stacked = jax.tree.map(
        lambda t, v: _stacked_variable(t, v, eager_sharding), template, values, is_leaf=_is_variable
    )
    return nnx.merge(graphdef, stacked)
