"""The forward plumbing every family's decoder shares (the interface is `spec.FamilyModel`).

A family's decoder subclasses `DecoderBase` and builds `embed_tokens` (an `embedding` table
[vocab, hidden]), `layers`, `norm` and, untied, `lm_head`; it implements `forward_hidden`,
`init_cache` and `decode`. Given those, the base supplies the logits (the head, tied or not, and
an optional soft-cap), the plain and the expert-load forward, the layers run one by one under
the configured remat, and the causal mask over a decoding cache.

Layers whose kinds repeat (gpt-oss's sliding and full attention, Qwen3-Next's three DeltaNet
layers and one attention layer) scan in periods: `period_of` finds the shortest period P of the
kinds, `build_periods` stacks the R = L / P repetitions of a `Period` (P blocks, one per kind,
each variable with a leading [R] axis named "layers"), and `run_layers` runs one `lax.scan` over
them, each block under the remat policy, so compile time grows with P, not with depth. Layer i
is block i % P of repetition i // P; the stacks are built from the seed in layer order, so the
values are the unrolled model's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from runtime.model.layers import (
    ACT_EMBED,
    REMAT_POLICIES,
    build_stacked,
    constrain_logits,
    remat_call,
    softcap,
)
from runtime.model.moe.layer import MoEStats, stack_stats
from runtime.model.sharding import constrain


def cache_mask(index: jax.Array, t: int, slots: int) -> jax.Array:
    """[1, T, slots]: each of the T new tokens (at slots index..index+T-1) sees the slots up to
    its own."""
    q_slots = index + jnp.arange(t)
    return (jnp.arange(slots)[None, :] <= q_slots[:, None])[None]


def layer_forward(layer: nnx.Module, x: jax.Array, *args: Any) -> tuple[jax.Array, Any]:
    """A layer that returns (x, its decoding cache, its MoE stats or None) -> (x, stats)."""
    out, _, stats = layer(x, *args)
    return out, stats


def period_of(kinds: Sequence[Hashable]) -> int:
    """The shortest P that divides len(kinds) with kinds[i] == kinds[i % P] for every i (the
    length itself when nothing repeats)."""
    n = len(kinds)
    for p in range(1, n):
        if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
            return p
    return n


class Period(nnx.Module):
    """One repetition of a period of layers: `blocks`, one per kind, in layer order. Stacked
    (`build_periods`), every variable has a leading [repetitions] axis."""

    def __init__(self, blocks: list[nnx.Module]) -> None:
        self.blocks = nnx.List(blocks)


def build_periods(
    make: Callable[[Any, nnx.Rngs], nnx.Module],
    kinds: Sequence[Hashable],
    rngs: nnx.Rngs,
    *,
    eager_sharding: bool = False,
) -> Period:
    """The layers of `kinds` (period_of(kinds) must be below len(kinds) for a scan to gain
    anything; any period is correct) as one stacked `Period`; make(kind, rngs) builds one layer
    unsharded (the stack is sharded as a whole when eager)."""
    p = period_of(kinds)
    one = list(kinds[:p])
    return build_stacked(
        lambda r: Period([make(kind, r) for kind in one]),
        rngs,
        len(kinds) // p,
        eager_sharding=eager_sharding,
    )


def unstack_periods(stacked: Period) -> list[nnx.Module]:
    """The layers of a stacked `Period` one by one, in layer order (decoding loops over them)."""
    graphdef, state = nnx.split(stacked)
    repeats = jax.tree.leaves(state)[0].shape[0]
    out = []
    for r in range(repeats):
        period = nnx.merge(graphdef, jax.tree.map(lambda v, r=r: v[r], state))
        out += list(period.blocks)
    return out


def _interleave(stats: list[MoEStats]) -> MoEStats | None:
    """Per MoE block of a period, its stats over the repetitions [R, ...] -> [R * M, ...] in
    layer order (repetition r's blocks before r + 1's)."""
    if not stats:
        return None
    return jax.tree.map(lambda *a: jnp.stack(a, axis=1).reshape(-1, *a[0].shape[1:]), *stats)


class DecoderBase(nnx.Module):
    """Token ids in, float32 logits out; a family sets `cfg` (its ModelConfig) and
    `compute_dtype`, and adds what the module docstring lists."""

    #: Logits become c * tanh(logits / c) when set (Gemma 4's final_logit_softcapping); the
    #: train step's chunked loss reads it too.
    logit_softcap: float | None = None

    def forward_hidden(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        raise NotImplementedError(type(self).__name__)

    def head_kernel(self) -> jax.Array:
        """The LM head as [hidden, vocab] in compute dtype (the embedding's transpose when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.embedding[...].astype(self.compute_dtype).T
        return self.lm_head.kernel[...].astype(self.compute_dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, D] -> float32 logits [B, T, vocab], pinned to batch
        sharding (vocab over `tensor`); T may be a chunk of the sequence."""
        # fp32 accumulation and output: the loss is computed in fp32 whatever compute_dtype is.
        out = jnp.einsum("btd,dv->btv", h, self.head_kernel(), preferred_element_type=jnp.float32)
        if self.logit_softcap is not None:
            out = softcap(out, self.logit_softcap)
        return constrain_logits(out)

    def __call__(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """inputs, positions, segment_ids: int32 [B, T] -> float32 logits [B, T, vocab].

        Attention is causal over the T axis and, given segment_ids, limited to equal segment ids;
        positions only feed RoPE (the caller restarts them per packed document).
        """
        return self.forward_with_loads(inputs, positions, segment_ids)[0]

    def forward_with_loads(
        self, inputs: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """Like `__call__`, plus the expert loads: fp32 [MoE layers, experts], each row the
        fraction of that layer's token->expert assignments per expert; None without MoE."""
        h, stats = self.forward_hidden(inputs, positions, segment_ids)
        return self.logits(h), None if stats is None else stats.load

    def final_norm(self, x: jax.Array) -> jax.Array:
        return constrain(self.norm(x), ACT_EMBED)

    def remat(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn(layer, ...) under the configured remat policy (`model.remat`); fn itself without."""
        policy = REMAT_POLICIES.get(self.cfg.remat)
        return fn if policy is None else partial(remat_call, policy, fn)

    def run_layers(self, x: jax.Array, *args: Any) -> tuple[jax.Array, MoEStats | None]:
        """x through every layer of `layers` (each called as layer(x, *args, ...) -> (x, cache,
        stats)) under the remat policy -> (x, the MoE layers' stats stacked in layer order).
        A stacked `Period` runs as one scan over its repetitions."""
        forward = self.remat(layer_forward)
        if isinstance(self.layers, Period):
            return _scan_periods(forward, self.layers, x, *args)
        stats = []
        for layer in self.layers:
            x, s = forward(layer, x, *args)
            stats.append(s)
        return x, stack_stats(stats)

    def layer_list(self) -> list[nnx.Module]:
        """The layers one by one, in layer order (a stacked `Period` sliced per layer)."""
        if isinstance(self.layers, Period):
            return unstack_periods(self.layers)
        return list(self.layers)


def _scan_periods(
    forward: Callable[..., tuple[jax.Array, Any]], stacked: Period, x: jax.Array, *args: Any
) -> tuple[jax.Array, MoEStats | None]:
    """One `lax.scan` over the repetitions of a stacked `Period`: each step runs the period's
    blocks in order, each through `forward` (the remat-wrapped layer call)."""
    graphdef, state = nnx.split(stacked)

    def body(x: jax.Array, period_state: Any) -> tuple[jax.Array, tuple]:
        period = nnx.merge(graphdef, period_state)
        stats = []
        for block in period.blocks:
            x, s = forward(block, x, *args)
            stats.append(s)
        return x, tuple(stats)

    x, stats = lax.scan(body, x, state)
    return x, _interleave([s for s in stats if s is not None])
