"""Causal self-attention kernels behind `model.attention`, one entry point for the decoder.

    attend(q, k, v, segment_ids, impl=...)   q [B, T, H, D], k/v [B, T, KV, D] -> [B, T, H, D]

Attention is causal and, with segment ids [B, T], limited to equal ids (packed documents never
see each other). Query head h reads kv head h // (H / KV) (HF's repeat_kv order); scale
1/sqrt(D); softmax in fp32. `xla` is the einsum reference every other kernel is tested against;
`masked_attention` is its dense-mask form, which decoding against a KV cache uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "cudnn", "splash")


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D], mask bool [B|1, T, S] (True = may attend) -> [B,T,H,D]."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    # Grouped einsum instead of materialising repeat_kv: head h = g * rep + r reads kv head g.
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5)
    # where (not an additive -inf) so a masked slot is exactly 0 after softmax.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(b, t, h, hd)


def causal_mask(t: int, segment_ids: jax.Array | None) -> jax.Array:
    """bool [B|1, T, T]: causal, and within equal segment ids when given."""
    idx = jnp.arange(t)
    mask = (idx[:, None] >= idx[None, :])[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def xla_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None
) -> jax.Array:
    """The reference: scores for every (query, key) pair, masked, softmaxed."""
    return masked_attention(q, k, v, causal_mask(q.shape[1], segment_ids))


def resolve(impl: str, platform: str | None = None) -> str:
    """The kernel `impl` means on `platform` (default: JAX's default backend)."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    return "xla"  # per-platform choice filled in with the kernels


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    impl: str = "xla",
) -> jax.Array:
    """Causal (and segment-limited) attention with the chosen kernel."""
    kernel = resolve(impl)
    if kernel == "xla":
        return xla_attention(q, k, v, segment_ids)
    raise NotImplementedError(f"model.attention = {kernel!r} is not built yet")
