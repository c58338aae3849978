"""Losses as (sum, count) pairs, so accumulation and cross-host reduction stay exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy_sums(
    logits: jax.Array, targets: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over counted positions, and the number of them.

    Computed in float32 whatever the compute dtype; masked positions (padding, synthetic joins
    between packed documents) contribute exactly zero to both sums.
    """
    mask = mask.astype(jnp.float32)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    # where(), not a product: a masked position's value must not leak even if it is inf or nan.
    return jnp.sum(jnp.where(mask > 0, per_token, 0.0)), jnp.sum(mask)
