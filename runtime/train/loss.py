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


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) at every position, [B, T] float32 (log-softmax taken in float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def clipped_pg_sums(
    logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    old_logprobs: jax.Array,
    clip_eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed PPO/GRPO-style clipped policy-gradient loss, the count of counted tokens, and the
    number of counted tokens whose ratio was clipped.

    Per token: ratio = exp(logp - old_logp) and objective = min(ratio * A, clip(ratio, 1 - eps,
    1 + eps) * A); the loss sum is minus the objective summed over counted positions, so
    sum / count is the mean per-token loss, exactly as for `cross_entropy_sums`. Masked positions
    contribute exactly zero to all three sums, whatever their inputs (inf and nan included).
    """
    counted = mask.astype(jnp.float32) > 0
    logp = token_logprobs(logits, targets)
    adv = advantages.astype(jnp.float32)
    # Masked positions get a zero log-ratio before exp(), so neither the value nor the gradient
    # of an unused position can be inf or nan (a nan behind where() still poisons the gradient).
    log_ratio = jnp.where(counted, logp - old_logprobs.astype(jnp.float32), 0.0)
    adv = jnp.where(counted, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    objective = jnp.minimum(unclipped, clipped)
    loss_sum = -jnp.sum(jnp.where(counted, objective, 0.0))
    # A token is clipped when the clipped branch is the (strictly smaller) one taken: its
    # gradient is then zero.
    was_clipped = jnp.where(counted & (clipped < unclipped), 1.0, 0.0)
    return loss_sum, jnp.sum(counted.astype(jnp.float32)), jnp.sum(was_clipped)
