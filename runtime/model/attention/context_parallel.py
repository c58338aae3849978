"""The load-balanced sequence layout of context parallelism (`mesh.context` = C > 1).

Causal attention over a sequence split in C contiguous parts gives the last device C times the
first one's work wherever a kernel skips the masked blocks (splash). So the train and eval
steps lay each sequence out in 2C chunks and give device i chunks i and 2C-1-i: an early and a
late chunk each, the same work for every device. Everything position-wise (embeddings, norms,
MLPs, MoE, RoPE from the `positions` input, the loss sums) does not care where a token sits;
what does reads the layout from here while the step is traced:

- attention's causal mask compares tokens' original indices (`runtime/model/attention/kernels.py`);
- Gated DeltaNet's conv and recurrence run in the original order (`qwen3_next/decoder.py`).

`order[p]` is the original index of the token at position p of the laid-out sequence.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from runtime.model import sharding

_ORDER: contextvars.ContextVar[np.ndarray | None] = contextvars.ContextVar(
    "sequence_order", default=None
)


def balanced_order(t: int, shards: int) -> np.ndarray | None:
    """The layout for T tokens over `shards` devices: device i holds chunks i and 2C-1-i of
    T / 2C tokens; None where there is nothing to balance (one shard, or T not a multiple of
    2C: the parts stay contiguous)."""
    if shards <= 1 or t % (2 * shards):
        return None
    s = t // (2 * shards)
    chunks = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return np.concatenate([np.arange(c * s, (c + 1) * s) for c in chunks])


def sequence_order() -> np.ndarray | None:
    """The layout of the step being traced (None: the original order)."""
    return _ORDER.get()


def shard_chunks(t: int, shards: int, i: int) -> list[tuple[int, int]]:
    """(original start, length) of the chunks device i holds, in the order it holds them."""
    if balanced_order(t, shards) is None:
        return [(i * (t // shards), t // shards)]
    s = t // (2 * shards)
    return [(i * s, s), ((2 * shards - 1 - i) * s, s)]


def original(x: jax.Array, axis: int = 1) -> jax.Array:
    """x from the laid-out order back to the original one along `axis` (identity if none)."""
    order = _ORDER.get()
    return x if order is None else x.take(np.argsort(order), axis=axis)


def laid_out(x: jax.Array, axis: int = 1) -> jax.Array:
    """x from the original order to the layout along `axis` (identity if none)."""
    order = _ORDER.get()
    return x if order is None else x.take(order, axis=axis)


@contextlib.contextmanager
def balanced(batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Inside a step traced under a mesh with `context` > 1: the batch's [B, T, ...] arrays in
    the balanced layout, and the layout set for the model; otherwise the batch as it is."""
    t = batch["inputs"].shape[1]
    order = balanced_order(t, sharding.context_size())
    if order is None:
        yield batch
        return
    token = _ORDER.set(order)
    try:
        yield {
            k: v.take(order, axis=1) if v.ndim >= 2 and v.shape[1] == t else v
            for k, v in batch.items()
        }
    finally:
        _ORDER.reset(token)
