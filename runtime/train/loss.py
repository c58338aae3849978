"""Losses as (sum, count) pairs, so accumulation and cross-host reduction stay exact."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax

from runtime.model.layers import constrain_logits
from runtime.model.layers import softcap as apply_softcap
from runtime.model.sharding import constrain


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
    """log p(target) at every position, [B, T] float32 (computed in float32): the target's logit
    minus the logsumexp, with no [B, T, V] log-softmax array made."""
    logits = logits.astype(jnp.float32)
    target = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target - jax.nn.logsumexp(logits, axis=-1)


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


# --- Losses from final hidden states, one sequence chunk of logits at a time ------------------

LossSums = tuple[jax.Array, jax.Array, jax.Array]  # (loss sum, count, clipped count)


@jax.custom_vjp
def _head_matmul(h: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", h, kernel, preferred_element_type=jnp.float32)


def _head_matmul_fwd(h: jax.Array, kernel: jax.Array) -> tuple[jax.Array, tuple]:
    return _head_matmul(h, kernel), (h, kernel)


def _head_matmul_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    # The backward matmuls take the logits' gradient in the compute dtype and give the head's
    # partial gradient in it (accumulated in float32 inside the matmul): each chip's
    # [hidden, vocab] partial, which the data-parallel reduction needs whole, is then half the
    # size. In float32 compute this is exactly the plain transpose.
    h, kernel = res
    gc = g.astype(h.dtype)
    dh = jnp.einsum("btv,dv->btd", gc, kernel, preferred_element_type=jnp.float32)
    dk = jnp.einsum("btd,btv->dv", h, gc, preferred_element_type=kernel.dtype)
    return dh.astype(h.dtype), dk


_head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


def head_logits(h: jax.Array, kernel: jax.Array) -> jax.Array:
    """h [B, T, D] @ kernel [D, V] -> float32 logits [B, T, V], accumulated in float32: the
    same product as `Decoder.logits`, with the vocab axis pinned to the tensor axis."""
    return constrain_logits(_head_matmul(h, kernel))


def _objective_sums(
    logits: jax.Array,
    tok: dict[str, jax.Array],
    objective: str,
    clip_eps: float,
    softcap: float | None = None,
) -> LossSums:
    if softcap is not None:  # Gemma's final_logit_softcapping, as the model's own logits
        logits = apply_softcap(logits, softcap)
    if objective == "clipped_pg":
        return clipped_pg_sums(
            logits, tok["targets"], tok["mask"], tok["advantages"], tok["old_logprobs"], clip_eps
        )
    return (*cross_entropy_sums(logits, tok["targets"], tok["mask"]), jnp.zeros((), jnp.float32))


def hidden_loss_sums(
    h: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    chunk_size: int = 0,
    objective: str = "cross_entropy",
    advantages: jax.Array | None = None,
    old_logprobs: jax.Array | None = None,
    clip_eps: float = 0.2,
    softcap: float | None = None,
) -> LossSums:
    """(loss sum, count, clipped count) of `objective` on the logits h @ kernel (soft-capped to
    softcap * tanh(logits / softcap) when `softcap` is set), made and dropped
    `chunk_size` sequence positions at a time so that the [B, T, V] float32 logits never exist.

    h: final-normed hidden states [B, T, D]; kernel: the LM head [D, V] (both compute dtype);
    targets, mask (and for clipped_pg advantages, old_logprobs): [B, T]. Each chunk's sums are
    exactly `cross_entropy_sums` / `clipped_pg_sums` of that chunk's logits (clipped count 0 for
    cross-entropy), so masking semantics are theirs: a masked position adds exactly zero,
    whatever its inputs. The chunk function is `jax.checkpoint`ed with nothing saved, so the
    backward pass recomputes a chunk's logits rather than keeping all of them; the chunks run in
    a `lax.scan`, and a remainder of T % chunk_size positions is one more (shorter) chunk, so no
    position is padded or computed twice. chunk_size 0 or >= T is one chunk, the plain
    whole-sequence loss (no recomputation).

    The head gradient is a sum over chunks; it is accumulated in float32 (the kernel enters the
    scan as float32 and is cast back to its dtype inside), so a bf16 head is not rounded once per
    chunk.
    """
    if objective not in ("cross_entropy", "clipped_pg"):
        raise ValueError(f"unknown objective {objective!r}")
    tok = {"targets": targets, "mask": mask}
    if objective == "clipped_pg":
        if advantages is None or old_logprobs is None:
            raise ValueError("clipped_pg needs advantages and old_logprobs")
        tok |= {"advantages": advantages, "old_logprobs": old_logprobs}
    zero = jnp.zeros((), jnp.float32)

    def sums(logits: jax.Array, tc: dict[str, jax.Array]) -> LossSums:
        return _objective_sums(logits, tc, objective, clip_eps, softcap)

    return _chunked_sums(h, kernel, tok, chunk_size, sums, (zero, zero, zero))


def hidden_group_sums(
    h: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    groups: jax.Array,
    num_groups: int,
    *,
    chunk_size: int = 0,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Cross-entropy as `hidden_loss_sums` (the same chunks, the same sums), and also split by
    group: (loss sum, count, loss sum per group [G], count per group [G]), where groups [B, T]
    holds each position's group in 0..num_groups-1 (an eval's rows: their mixture source).

    The totals are the very sums `hidden_loss_sums` makes; each group's are summed from the same
    per-token losses by selection (no matmul, so no reduced-precision passes), and the groups'
    sums add up to the totals up to float32 rounding."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    ids = jnp.arange(num_groups)

    def sums(logits: jax.Array, tc: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        if softcap is not None:
            logits = apply_softcap(logits, softcap)
        # As cross_entropy_sums: where(), not a product, so a masked inf or nan never leaks.
        mask = tc["mask"].astype(jnp.float32)
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tc["targets"]
        )
        per_token = jnp.where(mask > 0, per_token, 0.0)
        in_group = tc["groups"][..., None] == ids  # [B, T, G]
        by_group = jnp.sum(jnp.where(in_group, per_token[..., None], 0.0), axis=(0, 1))
        counts = jnp.sum(jnp.where(in_group, mask[..., None], 0.0), axis=(0, 1))
        return jnp.sum(per_token), jnp.sum(mask), by_group, counts

    zero, zeros = jnp.zeros((), jnp.float32), jnp.zeros((num_groups,), jnp.float32)
    tok = {"targets": targets, "mask": mask, "groups": groups}
    return _chunked_sums(h, kernel, tok, chunk_size, sums, (zero, zero, zeros, zeros))


def _chunked_sums(
    h: jax.Array,
    kernel: jax.Array,
    tok: dict[str, jax.Array],
    chunk_size: int,
    sums: Callable[[jax.Array, dict[str, jax.Array]], tuple[jax.Array, ...]],
    zeros: tuple[jax.Array, ...],
) -> tuple[jax.Array, ...]:
    """`sums(logits, tok)` of the logits h @ kernel, `chunk_size` positions at a time (see
    `hidden_loss_sums`), added up chunk by chunk from `zeros` (shaped like `sums`' result)."""
    b, t, _ = h.shape
    if chunk_size <= 0 or chunk_size >= t:
        h = constrain(h, ("batch", "length", "embed"))
        return sums(head_logits(h, kernel), tok)

    dtype = kernel.dtype

    @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def chunk(w: jax.Array, hc: jax.Array, tc: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        hc = constrain(hc, ("batch", "length", "embed"))
        return sums(head_logits(hc, w.astype(dtype)), tc)

    w = kernel.astype(jnp.promote_types(dtype, jnp.float32))
    n = t // chunk_size
    full = n * chunk_size

    def split(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, chunk, ...]
        x = x[:, :full].reshape(b, n, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def body(acc: tuple, xs: tuple) -> tuple[tuple, None]:
        return tuple(a + s for a, s in zip(acc, chunk(w, *xs), strict=True)), None

    acc, _ = jax.lax.scan(body, zeros, (split(h), jax.tree.map(split, tok)))
    if full < t:
        rest = chunk(w, h[:, full:], jax.tree.map(lambda x: x[:, full:], tok))
        acc = tuple(a + s for a, s in zip(acc, rest, strict=True))
    return acc
