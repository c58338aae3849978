"""Attention over the keys a block at a time, in XLA: the einsum path's numbers without its
[T_q, T_k] score matrix.

Under `mesh.context` a device attends its part of the sequence to every key. The einsum path
would hold the scores of its queries against the whole sequence (for 8,192 queries of 131,072
keys and 32 heads, 128 GiB in fp32); GPUs have no fused kernel that takes a part's causal
offset through jax 0.10.2's public API. This takes the keys `block` at a time with a running
max and sum (the flash-attention recurrence), and its backward pass does the same from the
saved log-sum-exp, so it keeps [T_q, block] scores at a time and no per-block residuals.

    blockwise_attention(q, k, v, q_index, k_order, q_seg, k_seg, scale, window, sinks, block)
        q [B, Tq, H, D], k/v [B, Tk, KV, D] -> [B, Tq, H, D]

`q_index` [Tq] are the queries' original positions and `k_order` the keys' layout (the causal
mask and the window compare original positions), `q_seg` [B, Tq] / `k_seg` [B, Tk] the documents' ids or None, `sinks` [H]
or None (a logit in each head's denominator, as `kernels.attend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30  # a finite -inf: a block with no visible key leaves the running max unchanged


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """[B, Tk, ...] -> [n, B, block, ...] (Tk a multiple of block)."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)


def visible(qi, ki, qs, ks, window) -> jax.Array:
    """bool [B|1, Tq, Tk]: which keys (original indices ki [Tk], documents ks [B, Tk] or None)
    a query (qi [Tq], qs [B, Tq]) sees: causal, in its document, within `window` if given."""
    m = qi[:, None] >= ki[None, :]
    if window is not None:
        m = m & (ki[None, :] > qi[:, None] - window)
    m = m[None]
    if qs is not None:
        m = m & (qs[:, :, None] == ks[:, None, :])
    return m


def _scores(q, kb, qi, ki, qs, ks, scale, window) -> jax.Array:
    """fp32 [B, KV, G, Tq, block] scores of one key block, masked to _NEG."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, kb, preferred_element_type=jnp.float32) * scale
    vis = visible(qi, ki, qs, ks, window)[:, None, None]
    return jnp.where(vis, s, _NEG)


def _key_blocks(k, v, ks, block):
    """The scan's inputs: k/v (and their segment ids) a block at a time, with each block's
    number; a block's key indices are made from its number inside the loop (arrays derived
    from the inputs there may be hoisted out of it, all blocks at once, by the compiler)."""
    ks_b = None if ks is None else _blocks(ks, block)
    return (jnp.arange(k.shape[1] // block), _blocks(k, block), _blocks(v, block), ks_b)


def _forward(q, k, v, qi, qs, ks, sinks, scale, window, block):
    """(out [B, Tq, KV, G, D] fp32, lse [B, KV, G, Tq])."""
    b, tq, kvh, g, d = q.shape
    xs = _key_blocks(k, v, ks, block)

    def step(carry, x):
        j, kb, vb, ksb = x
        # Tied to the carry: otherwise XLA may make every block's mask before the loop, a
        # [Tk / block, B, heads, Tq, block] array (GPU: 64 GiB at 131,072 tokens over 8).
        (m, total, acc), j = jax.lax.optimization_barrier((carry, j))
        kib = j * block + jnp.arange(block)
        s = _scores(q, kb, qi, kib, qs, ksb, scale, window)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        keep = jnp.exp(m - m_new)
        acc = acc * keep[..., None] + jnp.einsum(
            "bkgqs,bskd->bkgqd", p, vb, preferred_element_type=jnp.float32
        )
        return (m_new, total * keep + p.sum(-1), acc), None

    m0 = jnp.full((b, kvh, g, tq), _NEG, jnp.float32)
    if sinks is not None:  # the sink starts each row's max and sum
        m0 = jnp.broadcast_to(sinks.reshape(kvh, g)[None, :, :, None], m0.shape)
    total0 = jnp.zeros_like(m0) if sinks is None else jnp.ones_like(m0)
    acc0 = jnp.zeros((b, kvh, g, tq, d), jnp.float32)
    (m, total, acc), _ = jax.lax.scan(step, (m0, total0, acc0), xs)
    out = acc / total[..., None]
    return jnp.moveaxis(out, 3, 1), m + jnp.log(total)  # [B, Tq, KV, G, D]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attend(q, k, v, qi, qs, ks, sinks, scale, window, block):
    return _forward(q, k, v, qi, qs, ks, sinks, scale, window, block)[0].astype(q.dtype)


def _attend_fwd(q, k, v, qi, qs, ks, sinks, scale, window, block):
    out, lse = _forward(q, k, v, qi, qs, ks, sinks, scale, window, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, qi, qs, ks, sinks, out, lse)


def _attend_bwd(scale, window, block, res, d_out):
    q, k, v, qi, qs, ks, sinks, out, lse = res
    do = jnp.moveaxis(d_out.astype(jnp.float32), 1, 3)  # [B, KV, G, Tq, D]
    o = jnp.moveaxis(out.astype(jnp.float32), 1, 3)
    delta = jnp.sum(do * o, -1)  # [B, KV, G, Tq]
    xs = _key_blocks(k, v, ks, block)

    def step(dq, x):
        j, kb, vb, ksb = x
        dq, j = jax.lax.optimization_barrier((dq, j))  # as in _forward: no mask made ahead
        kib = j * block + jnp.arange(block)
        s = _scores(q, kb, qi, kib, qs, ksb, scale, window)
        p = jnp.exp(s - lse[..., None])  # masked entries: exp(-1e30 - lse) = 0
        dv = jnp.einsum("bkgqs,bkgqd->bskd", p, do)
        dp = jnp.einsum("bkgqd,bskd->bkgqs", do, vb.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb.astype(jnp.float32))
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q.astype(jnp.float32))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), xs)
    b, tk = k.shape[:2]

    def unblock(x):  # [n, B, block, KV, D] -> [B, Tk, KV, D]
        return jnp.moveaxis(x, 0, 1).reshape(b, tk, *x.shape[3:])

    dsinks = None
    if sinks is not None:  # d out / d sink = -out * p_sink, p_sink = exp(sink - lse)
        p_sink = jnp.exp(sinks.reshape(lse.shape[1:3])[None, :, :, None] - lse)
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(sinks.shape).astype(sinks.dtype)
    return (dq.astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype),
            None, None, None, dsinks)  # fmt: skip


_attend.defvjp(_attend_fwd, _attend_bwd)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_index: jax.Array,
    k_order: np.ndarray | None,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    scale: float,
    window: int | None = None,
    sinks: jax.Array | None = None,
    block: int = 512,
) -> jax.Array:
    """Causal attention of q to k/v a key block at a time (module docstring); `block` must
    divide Tk (the whole of Tk otherwise). `k_order`: k/v's layout (`order[p]` the original
    index of position p; None: the original order): they are put back in order first."""
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    if k_order is not None:
        back = np.argsort(k_order)
        k, v = k.take(back, axis=1), v.take(back, axis=1)
        k_seg = None if k_seg is None else k_seg.take(back, axis=1)
    block = block if k.shape[1] % block == 0 else k.shape[1]
    qg = q.reshape(b, tq, kvh, h // kvh, d)
    sinks32 = None if sinks is None else sinks.astype(jnp.float32)
    out = _attend(qg, k, v, q_index, q_seg, k_seg, sinks32, scale, window, block)
    return out.reshape(b, tq, h, d)
