"""Gated DeltaNet (Qwen3-Next's linear attention) in pure JAX: a chunked form and a per-token scan.

Per value head, with state S [dk, dv], decay a_t = exp(g_t) and write strength beta_t:

    S_t = a_t S_{t-1} + k_t beta_t (v_t - a_t S_{t-1}^T k_t)^T      out_t = S_t^T q_t

Input contract (both functions; HF `torch_chunk_gated_delta_rule` semantics):

    q, k        [B, T, Hk, dk]    raw: l2-normalised inside when `use_qk_l2norm` (HF's
                                  `use_qk_l2norm_in_kernel=True`, what Qwen3-Next passes), and q
                                  is then ALWAYS multiplied by `scale` (default dk**-0.5, which HF
                                  always applies). A caller that normalised and scaled q/k itself
                                  passes `use_qk_l2norm=False, scale=1.0`.
    v           [B, T, Hv, dv]    Hv a multiple of Hk: value head h reads q/k head h // (Hv // Hk)
                                  (HF's repeat_interleave grouping).
    g, beta     [B, T, Hv]        g is the log-decay (<= 0; Qwen3-Next: -exp(A_log) *
                                  softplus(a + dt_bias)); beta the write strength (sigmoid(b)).
    initial_state [B, Hv, dk, dv] optional, zeros when None.
    segment_ids [B, T] int        optional; 0 = padding, documents numbered 1, 2, ...

Returns (out [B, T, Hv, dv] in v's dtype, final_state [B, Hv, dk, dv] fp32). Everything inside
(l2norm, scale, state, triangular solve) is fp32 whatever the input dtype, and the matmuls run at
`precision` (default HIGHEST: full fp32 on TPU too).

Segments: the state resets at every document start, a position whose id is nonzero and differs
from the last nonzero id before it, so each document's outputs equal that document run alone from
a zero state. The row's first document continues `initial_state` (a prefill or decode step that
resumes a cached state). Padding (id 0) is an identity step (no decay, no write) whose output is
0, so it affects no other token, and the final state is the state after the row's last real
token, which right-padded prompts want.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

L2NORM_EPS = 1e-6  # HF/FLA's l2norm: x * rsqrt(sum(x^2) + eps)

Precision = lax.Precision | str | None


def _l2norm(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _document_starts(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, padding), bool [B, T]: where a new document begins, and where the row is padding.

    A start is a nonzero id that differs from the last nonzero id before it; the first document
    of a row is not a start (it continues the initial state), and padding between documents
    neither starts nor ends one: the next nonzero id decides.
    """
    t = segment_ids.shape[1]
    real = segment_ids != 0
    # Index of the last real position at or before each t (-1 when none): a cumulative max.
    last = lax.cummax(jnp.where(real, jnp.arange(t), -1), axis=1)
    prev = jnp.pad(last[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    prev_id = jnp.where(
        prev >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(prev, 0), axis=1), 0
    )
    starts = real & (prev_id != 0) & (segment_ids != prev_id)
    return starts, ~real


def _prepare(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None,
    segment_ids: jax.Array | None,
    use_qk_l2norm: bool,
    scale: float | None,
) -> tuple[jax.Array, ...]:
    """fp32 q, k (grouped to Hv heads, normalised, q scaled), v, g, beta, the initial state,
    and the document starts and padding masks [B, T] (all False without segment ids)."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (b, t) or hv % hk:
        raise ValueError(
            f"gated delta rule: q {q.shape} and k {k.shape} must be [B, T, Hk, dk] and v "
            f"{v.shape} [B, T, Hv, dv] with Hv a multiple of Hk"
        )
    if g.shape != (b, t, hv) or beta.shape != (b, t, hv):
        raise ValueError(
            f"gated delta rule: g {g.shape} and beta {beta.shape} must be {(b, t, hv)}"
        )
    if initial_state is not None and initial_state.shape != (b, hv, dk, dv):
        raise ValueError(
            f"gated delta rule: initial_state {initial_state.shape} must be {(b, hv, dk, dv)}"
        )
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if hv != hk:
        q, k = (jnp.repeat(x, hv // hk, axis=2) for x in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (dk**-0.5 if scale is None else scale)
    state = jnp.zeros((b, hv, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    if segment_ids is None:
        starts = padding = jnp.zeros((b, t), bool)
    else:
        starts, padding = _document_starts(segment_ids)
        # Padding is an identity step: no decay, no write, so the state passes through it intact.
        g = jnp.where(padding[..., None], 0.0, g)
        beta = jnp.where(padding[..., None], 0.0, beta)
    return q, k, v, g, beta, state, starts, padding


def _unit_lower_inverse(a: jax.Array, precision: Precision) -> jax.Array:
    """(I + a)^-1 for `a` [..., C, C] strictly lower triangular, exactly, by blocked inversion.

    Inverses of diagonal blocks double in size each level ([[X11, 0], [X21, X22]] with
    X21 = -X22 a21 X11), so it is log2(C) levels of batched matmuls: MXU-friendly, no custom
    call. (`solve_triangular` on XLA CPU calls LAPACK through scipy's OpenBLAS, whose own
    threads fight XLA's: 20x slower here, and once stalled for 15 minutes on 2 busy cores.)
    C is padded to a power of two with identity.
    """
    c = a.shape[-1]
    p = 1 << (c - 1).bit_length()
    lead = a.shape[:-2]
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, p - c), (0, p - c)])
    inv = jnp.ones((*lead, p, 1, 1), a.dtype)  # the 1x1 diagonal blocks of a unit triangle
    b = 1
    while b < p:  # log2(C) static levels
        m = p // (2 * b)
        # a21 of each pair of blocks: block row 2j+1, block column 2j, as [..., m, b, b].
        blocks = a.reshape(*lead, m, 2, b, m, 2, b)[..., :, 1, :, :, 0, :]
        a21 = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)
        pairs = inv.reshape(*lead, m, 2, b, b)
        x11, x22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        x21 = -jnp.matmul(x22, jnp.matmul(a21, x11, precision=precision), precision=precision)
        top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([x21, x22], axis=-1)], axis=-2)
        b *= 2
    return inv[..., 0, :c, :c]


def _finish(out: jax.Array, padding: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return jnp.where(padding[..., None, None], 0.0, out).astype(dtype)


def chunked_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    precision: Precision = lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over chunks of `chunk_size` tokens (module docstring: the contract).

    Within a chunk, the delta-rule writes form a unit lower-triangular system (the WY/UT transform)
    solved exactly in fp32 (blocked inversion; any `chunk_size`, powers of two waste nothing); a
    `lax.scan` carries the [B, Hv, dk, dv] state across chunks. T is padded to a multiple of
    `chunk_size` with identity steps. `precision`: HIGHEST keeps fp32 matmuls fp32 on TPU (JAX's
    default there, one bf16 pass, left errors of ~0.7% of the outputs' scale on a v5e; HIGHEST
    2e-6 for about 1.35x the time, "high" 3e-5). On CPU the choice costs nothing."""
    out_dtype = v.dtype
    q, k, v, g, beta, state, starts, padding = _prepare(
        q, k, v, g, beta, initial_state, segment_ids, use_qk_l2norm, scale
    )
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    extra = n * c - t

    def chunks(x: jax.Array) -> jax.Array:
        # [B, T, H, ...] -> [N, B, H, C, ...]: chunks lead for the scan, positions sit next to
        # the features they are contracted with.
        x = jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), (1, 2), (0, 3))

    # Padded tail steps: g = beta = 0 and no start, so they leave the state untouched.
    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))  # gc, bc: [N, B, H, C]
    # Documents begun inside the chunk up to each position, [N, B, 1, C] (1: shared by heads).
    doc = jnp.cumsum(chunks(starts[..., None].astype(jnp.int32)), axis=-1)

    # Log-decay from the chunk start through each position. Only differences G_r - G_s with
    # s <= r (<= 0) and G itself (<= 0) are ever exponentiated, so nothing overflows.
    cum = jnp.cumsum(gc, axis=-1)
    causal = jnp.tril(jnp.ones((c, c), bool))
    # Decay from s to r, zero where s > r or where a document starts in (s, r]: no flow across.
    same = causal & (doc[..., :, None] == doc[..., None, :])
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)  # inner where: finite grads
    from_start = jnp.where(doc == 0, jnp.exp(cum), 0.0)  # carried state -> r, [N, B, H, C]
    to_end = jnp.where(doc == doc[..., -1:], jnp.exp(cum[..., -1:] - cum), 0.0)  # r -> chunk end
    carry_decay = from_start[..., -1]  # [N, B, H]: the carried state's decay over the chunk

    def mm(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.einsum(spec, x, y, precision=precision)

    # u = beta (v - a_r S_0^T k_r - sum_{s<r} decay_rs (k_r . k_s) u_s): solve (I + A) u = rhs,
    # A strictly lower. The S_0 part is linear, so solve once for it and apply S_0 in the scan.
    kb = kc * bc[..., None]
    a = mm("...rd,...sd->...rs", kb, kc) * decay * ~jnp.eye(c, dtype=bool)
    rhs = jnp.concatenate([vc * bc[..., None], kb * from_start[..., None]], axis=-1)
    sol = mm("...rs,...sd->...rd", _unit_lower_inverse(a, precision), rhs)
    u_base, w = sol[..., :dv], sol[..., dv:]
    attn = mm("...rd,...sd->...rs", qc, kc) * decay  # within-chunk reads, diagonal included
    q_in = qc * from_start[..., None]
    k_out = kc * to_end[..., None]

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u_base, w, attn, q_in, k_out, carry_decay = xs
        u = u_base - mm("bhrk,bhkv->bhrv", w, s)
        out = mm("bhrk,bhkv->bhrv", q_in, s) + mm("bhrs,bhsv->bhrv", attn, u)
        s = carry_decay[..., None, None] * s + mm("bhrk,bhrv->bhkv", k_out, u)
        return s, out

    state, out = lax.scan(step, state, (u_base, w, attn, q_in, k_out, carry_decay))
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, n * c, h, dv)[:, :t]
    return _finish(out, padding, out_dtype), state


def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    precision: Precision = lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (`lax.scan` over T): the reference the chunked
    form is tested against, and the decode step (T=1 with the cached state as `initial_state`).
    Same contract and results as `chunked_gated_delta_rule`."""
    out_dtype = v.dtype
    q, k, v, g, beta, state, starts, padding = _prepare(
        q, k, v, g, beta, initial_state, segment_ids, use_qk_l2norm, scale
    )

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t, start_t = xs
        s = jnp.where(start_t[:, None, None, None], 0.0, s * jnp.exp(g_t)[..., None, None])
        read = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=precision)
        s = s + k_t[..., None] * ((v_t - read) * b_t[..., None])[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=precision)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts))
    state, out = lax.scan(step, state, xs)
    return _finish(jnp.moveaxis(out, 0, 1), padding, out_dtype), state
