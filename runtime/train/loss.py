"""Losses as (sum, count) pairs, so accumulation and cross-host reduction stay exact."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax

from runtime.model.layers import constrain_logits
from runtime.model.layers import softcap as apply_softcap
from runtime.model.sharding import constrain, current_mesh


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


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_matmul(h: jax.Array, kernel: jax.Array, out_dtype: str = "float32") -> jax.Array:
    return jnp.einsum("btd,dv->btv", h, kernel, preferred_element_type=jnp.dtype(out_dtype))


def _head_matmul_fwd(h: jax.Array, kernel: jax.Array, out_dtype: str) -> tuple[jax.Array, tuple]:
    return _head_matmul(h, kernel, out_dtype), (h, kernel)


def _head_matmul_bwd(out_dtype: str, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
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


def head_logits(h: jax.Array, kernel: jax.Array, dtype: str = "float32") -> jax.Array:
    """h [B, T, D] @ kernel [D, V] -> logits [B, T, V], accumulated in float32 and stored in
    `dtype` (float32: the same product as `FamilyModel.logits`; bfloat16: half the memory, as
    MaxText keeps them), with the vocab axis pinned to the tensor axis. Whatever `dtype`, the
    losses read them in float32."""
    return constrain_logits(_head_matmul(h, kernel, dtype))


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
    logits_dtype: str = "float32",
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

    logits_dtype "bfloat16" stores each chunk's logits (and the cross-entropy's logit gradient)
    in bfloat16, as MaxText does: half the memory, so the whole-sequence loss of a large
    vocabulary fits where float32 logits do not. The softmax is still taken in float32.
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

    if objective == "cross_entropy" and FUSED_CROSS_ENTROPY:
        # The whole sequence is one chunk of the fused loss: its logits are made once and their
        # gradient overwrites them, where autodiff would keep both.
        whole = chunk_size <= 0 or chunk_size >= h.shape[1]
        chunk = h.shape[1] if whole else chunk_size
        loss_sum, count = _fused_ce_sums(h, kernel, targets, mask, chunk, softcap, logits_dtype)
        return loss_sum, count, zero
    return _chunked_sums(h, kernel, tok, chunk_size, sums, (zero, zero, zero), logits_dtype)


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
    logits_dtype: str = "float32",
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
    return _chunked_sums(h, kernel, tok, chunk_size, sums, (zero, zero, zeros, zeros), logits_dtype)


#: Chunked cross-entropy computes its gradient in the forward pass (`_fused_ce_sums`); off, the
#: chunks are `jax.checkpoint`ed and autodiff recomputes each chunk's logits in the backward pass
#: (one more head matmul per chunk). A switch for bench/ A/B runs; the results are the same sums.
FUSED_CROSS_ENTROPY = True


def _context_chunk(t: int, chunk_size: int) -> tuple[int, int]:
    """(C, c): with the sequence split over C = mesh.context > 1 devices, each chunk takes c
    positions from every device's part (c the largest divisor of T / C up to chunk_size / C),
    so a chunk is C x c positions that stay where they are; (1, chunk_size) otherwise."""
    mesh = current_mesh()
    shards = 1 if mesh is None else int(mesh.shape["context"])
    if shards == 1 or t % shards:
        return 1, chunk_size
    part = t // shards
    c = max(d for d in range(1, max(1, chunk_size // shards) + 1) if part % d == 0)
    return shards, c


def _to_chunks(x: jax.Array, shards: int, c: int) -> jax.Array:
    """[B, T, ...] -> [n, B, shards * c, ...]: chunk i holds positions i*c..i*c+c-1 of each of
    the `shards` parts of the sequence (T = shards * n * c); the parts never move."""
    b, t = x.shape[:2]
    n = t // (shards * c)
    x = jnp.moveaxis(x.reshape(b, shards, n, c, *x.shape[2:]), 2, 0)
    return x.reshape(n, b, shards * c, *x.shape[4:])


def _from_chunks(xs: jax.Array, shards: int) -> jax.Array:
    """The inverse of `_to_chunks`: [n, B, shards * c, ...] -> [B, T, ...]."""
    n, b, sc = xs.shape[:3]
    x = jnp.moveaxis(xs.reshape(n, b, shards, sc // shards, *xs.shape[3:]), 0, 2)
    return x.reshape(b, n * sc, *xs.shape[3:])


def _split_chunks(x: jax.Array, chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """[B, T, ...] -> ([n, B, chunk, ...] of the first n * chunk positions, the rest [B, r, ...]);
    under `mesh.context` > 1, chunks of `_context_chunk` and no rest."""
    b, t = x.shape[:2]
    shards, c = _context_chunk(t, chunk_size)
    if shards > 1:
        return _to_chunks(x, shards, c), x[:, t:]
    n = t // chunk_size
    full = n * chunk_size
    head = jnp.moveaxis(x[:, :full].reshape(b, n, chunk_size, *x.shape[2:]), 1, 0)
    return head, x[:, full:]


def _ce_chunk_grads(
    hc: jax.Array,
    w: jax.Array,
    tc: jax.Array,
    mc: jax.Array,
    softcap: float | None,
    logits_dtype: str = "float32",
    parts: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One chunk's (loss sum, count, d loss_sum / d hc [B, c, D] in hc's dtype, d loss_sum / d w
    [D, V] float32): the logits are made once and their gradient taken in closed form,
    softmax(z) - onehot(target) at counted positions (z the soft-capped logits). With `parts`
    > 1 (the chunk is that many devices' positions under mesh.context) d w is [parts, D, V],
    each device's share apart: summed once after the chunks, not reduced in every chunk."""
    hc = constrain(hc, ("batch", "length", "embed"))
    logits = head_logits(hc, w, logits_dtype)  # [B, c, V]
    if logits.dtype != jnp.float32:
        # Barriers keep the widening out of the matmul's fusion and apart between the reductions
        # and the gradient, so each reads the narrow logits and widens them itself: otherwise
        # XLA keeps a float32 copy of the logits, the very memory a narrow dtype is to save.
        logits = jax.lax.optimization_barrier(logits)

    def capped(x: jax.Array) -> jax.Array:  # float32 whatever the logits' dtype
        x = x.astype(jnp.float32)
        return x if softcap is None else apply_softcap(x, softcap)

    counted = mc.astype(jnp.float32) > 0
    target_z = capped(jnp.take_along_axis(logits, tc[..., None].astype(jnp.int32), axis=-1)[..., 0])
    if logits.dtype == jnp.float32:
        z = capped(logits)
        lse = jax.nn.logsumexp(z, axis=-1)
    else:
        # The max taken in the narrow dtype (exact; the soft-cap is increasing), then one
        # reduction that widens as it reads: no float32 [B, c, V] array between the two.
        m = jax.lax.stop_gradient(capped(jnp.max(logits, axis=-1)))
        lse = m + jnp.log(jnp.sum(jnp.exp(capped(logits) - m[..., None]), axis=-1))
    loss_sum = jnp.sum(jnp.where(counted, lse - target_z, 0.0))
    if logits.dtype != jnp.float32:
        logits, lse = jax.lax.optimization_barrier((logits, lse))
        z = capped(logits)
    onehot = jax.nn.one_hot(tc, z.shape[-1], dtype=jnp.float32)
    g = jnp.where(counted[..., None], jnp.exp(z - lse[..., None]) - onehot, 0.0)
    if softcap is not None:  # d softcap * tanh(l / softcap) / dl = 1 - tanh(l / softcap)^2
        g = g * (1.0 - jnp.square(z / softcap))
    g = constrain_logits(g).astype(hc.dtype)
    # A masked row's hidden state must not reach dW even when it is inf or nan (0 * nan = nan).
    h_counted = jnp.where(counted[..., None], hc, jnp.zeros((), hc.dtype))
    dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(hc.dtype)
    if parts > 1:
        b, c = g.shape[:2]
        dw = jnp.einsum(
            "bjtd,bjtv->jdv",
            h_counted.reshape(b, parts, c // parts, -1),
            g.reshape(b, parts, c // parts, -1),
            preferred_element_type=jnp.float32,
        )
        dw = constrain(dw, ("length", "embed", "vocab"))
    else:
        dw = jnp.einsum("btd,btv->dv", h_counted, g, preferred_element_type=jnp.float32)
    return loss_sum, jnp.sum(counted.astype(jnp.float32)), dh, dw


def _fused_ce_forward(
    h: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    chunk_size: int,
    softcap: float | None,
    logits_dtype: str = "float32",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(loss sum, count, dh [B, T, D], dW [D, V] float32) over `chunk_size`-position chunks."""
    hs, h_rest = _split_chunks(h, chunk_size)
    ts, t_rest = _split_chunks(targets, chunk_size)
    ms, m_rest = _split_chunks(mask, chunk_size)

    shards = _context_chunk(h.shape[1], chunk_size)[0]

    def body(acc: tuple, xs: tuple) -> tuple[tuple, jax.Array]:
        loss, count, dw = acc
        l_c, n_c, dh_c, dw_c = _ce_chunk_grads(
            *xs[:1], kernel, *xs[1:], softcap, logits_dtype, parts=shards
        )
        return (loss + l_c, count + n_c, dw + dw_c), dh_c

    zero = jnp.zeros((), jnp.float32)
    dw0 = jnp.zeros(((shards,) if shards > 1 else ()) + kernel.shape, jnp.float32)
    (loss, count, dw), dhs = jax.lax.scan(body, (zero, zero, dw0), (hs, ts, ms))
    if shards > 1:
        dw = jnp.sum(dw, axis=0)  # the devices' shares, reduced once
        dh = _from_chunks(dhs, shards)
    else:
        dh = jnp.moveaxis(dhs, 0, 1).reshape(h.shape[0], hs.shape[0] * chunk_size, h.shape[-1])
    if h_rest.shape[1]:
        l_r, n_r, dh_r, dw_r = _ce_chunk_grads(
            h_rest, kernel, t_rest, m_rest, softcap, logits_dtype
        )
        loss, count, dw = loss + l_r, count + n_r, dw + dw_r
        dh = jnp.concatenate([dh, dh_r], axis=1)
    return loss, count, constrain(dh, ("batch", "length", "embed")), dw


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_ce_sums(
    h: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    chunk_size: int,
    softcap: float | None,
    logits_dtype: str = "float32",
) -> tuple[jax.Array, jax.Array]:
    """Chunked cross-entropy (loss sum, count) whose forward pass under autodiff also takes the
    gradient of the loss sum, chunk by chunk: three head matmuls per chunk (logits, dh, dW)
    instead of four (the checkpointed chunk's logits made again in the backward pass). The
    residuals are dh [B, T, D] in h's dtype and dW [D, V] in the kernel's; dW is summed over the
    chunks in float32, as `_chunked_sums` does."""
    return _fused_ce_forward(h, kernel, targets, mask, chunk_size, softcap, logits_dtype)[:2]


def _fused_ce_fwd(h, kernel, targets, mask, chunk_size, softcap, logits_dtype):  # noqa: ANN001, ANN202
    loss, count, dh, dw = _fused_ce_forward(
        h, kernel, targets, mask, chunk_size, softcap, logits_dtype
    )
    return (loss, count), (dh, dw.astype(kernel.dtype))


def _fused_ce_bwd(chunk_size, softcap, logits_dtype, res, g):  # noqa: ANN001, ANN202
    dh, dw = res
    g_loss = g[0]  # the count has no gradient
    dh = (dh.astype(jnp.float32) * g_loss).astype(dh.dtype)
    dw = (dw.astype(jnp.float32) * g_loss).astype(dw.dtype)
    return dh, dw, None, None


_fused_ce_sums.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def _chunked_sums(
    h: jax.Array,
    kernel: jax.Array,
    tok: dict[str, jax.Array],
    chunk_size: int,
    sums: Callable[[jax.Array, dict[str, jax.Array]], tuple[jax.Array, ...]],
    zeros: tuple[jax.Array, ...],
    logits_dtype: str = "float32",
) -> tuple[jax.Array, ...]:
    """`sums(logits, tok)` of the logits h @ kernel, `chunk_size` positions at a time (see
    `hidden_loss_sums`), added up chunk by chunk from `zeros` (shaped like `sums`' result)."""
    b, t, _ = h.shape
    if chunk_size <= 0 or chunk_size >= t:
        h = constrain(h, ("batch", "length", "embed"))
        return sums(head_logits(h, kernel, logits_dtype), tok)

    dtype = kernel.dtype

    @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def chunk(w: jax.Array, hc: jax.Array, tc: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        hc = constrain(hc, ("batch", "length", "embed"))
        return sums(head_logits(hc, w.astype(dtype), logits_dtype), tc)

    w = kernel.astype(jnp.promote_types(dtype, jnp.float32))
    shards = _context_chunk(t, chunk_size)[0]
    full = t if shards > 1 else t // chunk_size * chunk_size  # no rest under mesh.context

    def split(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, chunk, ...]
        return _split_chunks(x, chunk_size)[0]

    def body(acc: tuple, xs: tuple) -> tuple[tuple, None]:
        return tuple(a + s for a, s in zip(acc, chunk(w, *xs), strict=True)), None

    acc, _ = jax.lax.scan(body, zeros, (split(h), jax.tree.map(split, tok)))
    if full < t:
        rest = chunk(w, h[:, full:], jax.tree.map(lambda x: x[:, full:], tok))
        acc = tuple(a + s for a, s in zip(acc, rest, strict=True))
    return acc
