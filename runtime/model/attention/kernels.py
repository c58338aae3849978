"""Causal self-attention kernels behind `model.attention`, one entry point for the decoder.

    attend(q, k, v, segment_ids, impl=..., scale=None, window=None, sinks=None)
        q [B, T, H, D], k/v [B, T, KV, D] -> [B, T, H, D]

Attention is causal and, with segment ids [B, T], limited to equal ids (packed documents never
see each other); with a `window` W, a query also sees only itself and the W-1 keys before it
(HF's sliding window, `kv > q - W`). Query head h reads kv head h // (H / KV) (HF's repeat_kv
order); scale 1/sqrt(D) unless `scale` is given (Gemma 4 uses 1.0); softmax in fp32. With
`sinks` [H] (gpt-oss's attention sinks) each head's softmax denominator also holds exp(sink_h),
a logit no value goes with: probs = exp(s) / (sum exp(s) + exp(sink)). `xla` is the einsum
reference every other kernel is tested against; `masked_attention` is its dense-mask form,
which decoding against a KV cache uses.

The kernels:

- `xla`: scores for every (query, key) pair, masked, softmaxed: O(B·H·T²) temporaries.
- `splash`: the Pallas TPU splash-attention kernel (flash-style, blocks of the causal mask that
  are all zero are skipped; sinks are the kernel's own `sinks` argument, which starts each
  row's running max and denominator at the sink, exact forward and backward). Packed documents
  go in as `SegmentIds`, so no T x T mask is ever
  materialised; GQA is the kernel's own grouped form (k/v [KV, T, D], query head h reads kv
  head h // (H / KV)). Under a mesh (`sharding.current_mesh()`, set by the train step) it runs
  inside `jax.shard_map`: batch over the batch axes and heads over `tensor`, the same specs
  `sharding.mesh_spec` gives every other activation. Off TPU (tests on CPU) the kernel runs in
  Pallas interpret mode.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash
  attention, causal by `is_causal` (cuDNN skips the upper triangle). jax 0.10.2's public API has
  no segment ids: `query_seq_lengths`/`key_value_seq_lengths` only express right padding, one
  document per row. cuDNN's packed layout (per-row segment lengths and offsets) exists only in
  the private `jax._src.cudnn` module, needs a static bound on documents per row and a Hopper
  check that reads the local device (so cannot be compiled deviceless). So packed documents go
  in through the public `mask` argument: a bool [B, 1, T, T] equal-segment mask that jax turns
  into an additive bf16/fp16 bias the fused kernel reads blockwise. That costs B·T²·2 bytes of
  HBM per layer (32 MiB per 4,096-token row, shared by all heads) and a dbias output in the
  backward pass; with `segment_ids=None` no mask is passed and the kernel is causal only. It has
  no sinks: with `sinks` it is refused (`unsupported`), never approximated. Under
  `mesh.context` each chunk of a device's queries is one call against the keys it can see
  (`cudnn_chunk`): the kernel's causal mask is aligned to the top left, so the chunk's offset
  goes in as a mask too (n x (offset + n) for a chunk of n, not T x T). On CPU the same calls
  run through jax's XLA implementation (`implementation="xla"`), as splash runs in interpret
  mode there.
- `auto`: splash on TPU, cudnn on GPU (CUDA), xla elsewhere, by the platform of the devices
  being compiled for: the current mesh's devices when a mesh is active (so `runtime plan` on a
  CPU machine compiling for TPU picks splash), else JAX's default backend.

Shapes a kernel cannot take: with `model.attention` set explicitly to `splash` or `cudnn`, a
`ValueError` naming `model.attention` and the constraint; with `auto`, the step falls back to
`xla` for that call (auto means the fastest kernel that takes the shape). The constraints are
in `unsupported`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from runtime.model import sharding
from runtime.model.attention import context_parallel
from runtime.model.attention.blockwise import blockwise_attention, visible

IMPLS = ("auto", "xla", "cudnn", "splash")

# Splash block sizes: the largest of these that divides T; the kernel's kv compute block must be
# a multiple of the 128 TPU lanes. 1,024 (MaxText's default is 512) measured on a TPU v5e chip,
# Qwen3-0.6B at seq 2,048 x 8: 0.786 s a step against 0.816 s at 512; 2,048 does not compile
# there (its blocks overflow the kernel's VMEM).
_SPLASH_BLOCKS = (1024, 512, 256, 128)
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)

#: The `checkpoint_name` the splash kernel gives its output and log-sum-exp, which its backward
#: pass reads: a remat policy that keeps them (runtime/model/layers.py) spares the backward pass
#: the kernel's forward. (Our "attention_out" name is on a transpose of the output and leaves
#: out the log-sum-exp: keeping it, the kernel's forward still runs again.)
SPLASH_RESIDUALS = "attention_kernel_out"


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B,T,H,D], k/v [B,S,KV,D], mask bool [B|1, T, S] (True = may attend), sinks [H] or
    None -> [B,T,H,D]."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    # Grouped einsum instead of materialising repeat_kv: head h = g * rep + r reads kv head g.
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5 if scale is None else scale)
    # where (not an additive -inf) so a masked slot is exactly 0 after softmax.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        probs = softmax_with_sinks(scores, sinks.reshape(kvh, h // kvh))
    probs = probs.astype(q.dtype)
    return jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(b, t, h, hd)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """fp32 scores [B, G, R, T, S], sinks [G, R] (head g * R + r) -> probabilities [B, G, R, T, S]
    whose rows sum to 1 - the sink's share: the softmax over [scores, sink] with the sink's
    column dropped (HF GptOss's concat-softmax-slice), without materialising the extra column."""
    sink = sinks.astype(jnp.float32)[None, :, :, None, None]
    # The max is only a shift (the softmax does not depend on it), so it carries no gradient.
    m = lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
    e = jnp.exp(scores - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))


def write_cache(
    cache: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The KV cache (k, v [B,S,KV,D]) with the T new keys/values [B,T,KV,D] at slots
    index..index+T-1, in the cache's dtype (the caller keeps index + T <= S: the update would
    clamp, not fail)."""
    ck = lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, index, 0, 0))
    cv = lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, index, 0, 0))
    return ck, cv


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: tuple[jax.Array, jax.Array],
    index: jax.Array,
    mask: jax.Array,
    compute_dtype: Any,
    scale: float | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Decoding: the T new tokens' keys/values written into the cache at `index`, and q
    attending over every slot under `mask` [B|1,T,S] -> (output [B,T,H,D], the new cache)."""
    ck, cv = write_cache(cache, k, v, index)
    kc, vc = ck.astype(compute_dtype), cv.astype(compute_dtype)
    return masked_attention(q, kc, vc, mask, scale, sinks), (ck, cv)


def causal_mask(t: int, segment_ids: jax.Array | None, window: int | None = None) -> jax.Array:
    """bool [B|1, T, T]: causal, within equal segment ids when given, and within `window`; by
    the tokens' original indices when the step lays the sequence out for context parallelism."""
    order = context_parallel.sequence_order()
    idx = jnp.arange(t) if order is None or len(order) != t else jnp.asarray(order)
    return visible(idx, idx, segment_ids, segment_ids, window)


def xla_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    scale: float | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The reference: scores for every (query, key) pair, masked, softmaxed. Under a mesh with
    `context` > 1 each device holds a part of the queries and gathers every key and value (the
    queries' part of the T x T scores per device: no work idles, since none is skipped), from
    BLOCKWISE_FROM tokens on a key block at a time."""
    t = q.shape[1]
    if sharding.context_size() > 1:
        k = sharding.constrain(k, ("batch", None, "kv_heads", None))
        v = sharding.constrain(v, ("batch", None, "kv_heads", None))
        if t >= BLOCKWISE_FROM:  # a device's queries against every key, a block at a time
            order = context_parallel.sequence_order()
            idx = jnp.arange(t) if order is None else jnp.asarray(order)
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return blockwise_attention(
                q, k, v, idx, order, segment_ids, segment_ids, scale, window, sinks
            ).astype(q.dtype)
        mask = sharding.constrain(causal_mask(t, segment_ids, window), ("batch", "length", None))
        return masked_attention(q, k, v, mask, scale, sinks)
    return masked_attention(q, k, v, causal_mask(t, segment_ids, window), scale, sinks)


#: Under mesh.context > 1 the einsum path takes the keys a block at a time from this sequence
#: length on (runtime/model/attention/blockwise.py): the same numbers without [T/C, T] scores.
BLOCKWISE_FROM = 4096


# --- platform ---------------------------------------------------------------------------------


# `target_platform` lives with the mesh (runtime/model/sharding.py); the MoE dispatch picks by
# it too.
target_platform = sharding.target_platform


def resolve(impl: str, platform: str | None = None) -> str:
    """The kernel `impl` means on `platform` (default: the platform being compiled for)."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = platform or target_platform()
    if platform == "tpu":
        return "splash"
    if platform in ("cuda", "gpu"):
        return "cudnn"
    return "xla"


def unsupported(
    kernel: str,
    q: jax.Array,
    k: jax.Array,
    segment_ids: jax.Array | None,
    platform: str,
    sinks: bool = False,
) -> str | None:
    """Why `kernel` cannot take these inputs on `platform` (a sentence), or None if it can;
    `sinks`: the call has attention sinks."""
    if q.ndim != 4 or k.ndim != 4 or q.shape[2] % k.shape[2]:
        return f"q [B,T,H,D] and k/v [B,T,KV,D] with KV dividing H (got {q.shape}, {k.shape})"
    t, d = q.shape[1], q.shape[3]
    shards = sharding.context_size()
    if kernel == "splash":
        if platform not in ("tpu", "cpu"):
            return f"splash is a TPU kernel (interpret mode on CPU for tests), not for {platform}"
        if t % 128:
            return f"splash needs the sequence length to be a multiple of 128, got {t}"
        part = min(n for _, n in context_parallel.shard_chunks(t, shards, 0))
        if shards > 1 and (t % shards or part % 128):
            return (
                f"splash under mesh.context = {shards} needs each device's chunks of the "
                f"sequence to be multiples of 128 tokens, got {part}"
            )
    elif kernel == "cudnn":
        if sinks:
            return "cudnn cannot honour attention sinks (a learned logit per head in the softmax)"
        if platform not in ("cuda", "gpu", "cpu"):
            return f"cudnn runs on CUDA GPUs (jax's XLA form of the call on CPU), not {platform}"
        if platform == "cpu":  # the same call through jax's XLA path: no kernel limits
            return None
        if q.dtype not in _CUDNN_DTYPES:
            return f"cudnn needs bfloat16 or float16 q/k/v (model.compute_dtype), got {q.dtype}"
        limit = _cudnn_max_head_dim()
        if d % 8 or d > limit:
            return f"cudnn needs a head dim that is a multiple of 8 and at most {limit}, got {d}"
        if segment_ids is not None and t % 2:
            return f"cudnn with a document mask needs an even sequence length, got {t}"
    return None


def _cudnn_max_head_dim() -> int:
    """cuDNN's flash attention takes head dims up to 256 on Hopper or later, 128 before. JAX
    asks the local device; with none (a deviceless compile for GPU) it assumes 128, so do we."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_compute_capability

        return 256 if check_compute_capability("9.0") else 128
    except Exception:  # no CUDA device, or a JAX without the helper: the safe bound
        return 128


# --- splash (TPU) -----------------------------------------------------------------------------


def splash_block(t: int) -> int:
    """Splash's block size (query and key, forward and backward) for T tokens: the largest of
    _SPLASH_BLOCKS dividing T, else T itself (a plan's estimate for a length the kernel would
    refuse: it takes multiples of 128)."""
    return next((b for b in _SPLASH_BLOCKS if t % b == 0), t)


@functools.lru_cache(maxsize=64)
def _splash_kernel(
    heads: int,
    t: int,
    interpret: bool,
    window: int | None = None,
    kv_len: int | None = None,
    offset: int = 0,
):
    """The splash kernel for `heads` local query heads over T tokens, causal, and local to
    `window` keys when given (built once per shape: the mask's block structure is computed in
    numpy at construction, and blocks outside the window are skipped). With `kv_len` the queries
    are T tokens starting at `offset` of a sequence of kv_len keys (a device's part under
    context parallelism)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    kv = t if kv_len is None else kv_len
    bq, bkv = splash_block(t), splash_block(kv)
    block_sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    if window is None:
        one = sa.CausalMask((t, kv), offset=offset)
    else:
        one = sa.LocalMask((t, kv), window_size=(window - 1, 0), offset=offset)
    mask = sa.MultiHeadMask([one for _ in range(heads)])
    # Built at trace time: the mask tables must be concrete, and are kept as numpy so the cached
    # kernel holds no jax value of any one trace or device (they become constants of the step).
    with jax.ensure_compile_time_eval():
        kernel = sa.make_splash_mha(
            mask,
            block_sizes=block_sizes,
            head_shards=1,
            q_seq_shards=1,
            residual_checkpoint_name=SPLASH_RESIDUALS,
            interpret=interpret,
        )
    return jax.tree.map(np.asarray, kernel)


def _splash_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    interpret: bool,
    scale: float | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
    offset: int = 0,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Splash on one device's shard: q [b,T,h,D], k/v [b,T,kv,D], segment_ids [b,T] | None,
    sinks [h] | None (the kernel's own argument: logits, as the scores after the scale). Under
    context parallelism k/v [b,S,kv,D] hold the whole sequence, q its T tokens from `offset`,
    and `kv_segment_ids` [b,S] the keys' segment ids."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    _, t, h, d = q.shape
    s = k.shape[1]
    kernel = _splash_kernel(h, t, interpret, window, None if s == t else s, offset)
    # The kernel takes heads-major [H, T, D] per example and applies no scale of its own.
    scale = d**-0.5 if scale is None else scale
    qh = jnp.swapaxes(q if scale == 1.0 else q * jnp.asarray(scale, q.dtype), 1, 2)
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    extra = {} if sinks is None else {"sinks": sinks.astype(jnp.float32)}
    if segment_ids is None:
        out = jax.vmap(lambda a, b, c: kernel(a, b, c, **extra))(qh, kh, vh)
    else:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        out = jax.vmap(
            lambda a, b, c, sq, sk: kernel(a, b, c, segment_ids=SegmentIds(sq, sk), **extra)
        )(qh, kh, vh, segment_ids, kv_seg)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def _head_specs(q: jax.Array, k: jax.Array, v: jax.Array, mesh, length: str | None = None):
    """(q spec, kv spec, k, v) for a kernel under shard_map: batch over the batch axes, heads over
    `tensor`, q's length over `length` (context) and k/v's whole. Query heads split over `tensor`
    but KV heads too few to split: every query head gets its own copy of its kv head (repeat_kv
    order), so each shard's groups line up."""
    q_spec = sharding.mesh_spec(("batch", length, "heads", None), q.shape, mesh)
    kv_spec = sharding.mesh_spec(("batch", None, "kv_heads", None), k.shape, mesh)
    if q_spec[2] is not None and kv_spec[2] != q_spec[2]:
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        kv_spec = sharding.mesh_spec(("batch", None, "heads", None), k.shape, mesh)
    return q_spec, kv_spec, k, v


def per_shard(
    local,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    sinks: jax.Array | None = None,
):
    """`local(q, k, v, segment_ids)` (with sinks [H]: `local(q, k, v, segment_ids, sinks=…)`)
    inside `jax.shard_map` over the current mesh (batch over the batch axes, heads and their
    sinks over `tensor`, the specs the rest of the model uses), or directly when no mesh is
    current. Fused kernels are custom calls the partitioner cannot split on its own."""
    mesh = sharding.current_mesh()
    if sinks is not None:
        return _per_shard_with_sinks(local, q, k, v, segment_ids, sinks, mesh)
    if mesh is None:
        return local(q, k, v, segment_ids)
    q_spec, kv_spec, k, v = _head_specs(q, k, v, mesh)
    seg_spec = PartitionSpec(q_spec[0], None)
    if segment_ids is None:
        fn = jax.shard_map(
            lambda a, b, c: local(a, b, c, None),
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec),
            out_specs=q_spec,
            check_vma=False,
        )
        return fn(q, k, v)
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return fn(q, k, v, segment_ids)


def _per_shard_with_sinks(
    local,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    sinks: jax.Array,
    mesh: jax.sharding.Mesh | None,
) -> jax.Array:
    """`per_shard` with the sinks [H] as one more input, split over `tensor` like the heads."""
    if mesh is None:
        return local(q, k, v, segment_ids, sinks=sinks)
    q_spec, kv_spec, k, v = _head_specs(q, k, v, mesh)
    args, specs = [q, k, v, sinks], [q_spec, kv_spec, kv_spec, PartitionSpec(q_spec[2])]
    if segment_ids is not None:
        args.append(segment_ids)
        specs.append(PartitionSpec(q_spec[0], None))

    def body(a: jax.Array, b: jax.Array, c: jax.Array, s: jax.Array, *seg: jax.Array) -> jax.Array:
        return local(a, b, c, seg[0] if seg else None, sinks=s)

    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec, check_vma=False)
    return fn(*args)


def _per_context_chunk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    sinks: jax.Array | None,
    local,
) -> jax.Array:
    """A fused kernel under `mesh.context` = C > 1: each device attends its queries (the
    chunks of `context_parallel.shard_chunks`: one early and one late part of the sequence in
    the balanced layout) to every key and value, gathered over `context` and put back in the
    original order, one kernel call per chunk with that chunk's causal offset
    (`local(q_chunk, k, v, seg_chunk, offset=..., kv_segment_ids=...)`). The device's index
    is only known when the step runs, so each device picks its calls with a `lax.switch` over
    the C devices' static offsets."""
    mesh = sharding.current_mesh()
    c, t = int(mesh.shape["context"]), q.shape[1]
    order = context_parallel.sequence_order()
    back = None if order is None else np.argsort(order)
    q_spec, kv_spec, k, v = _head_specs(q, k, v, mesh, "length")
    args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
    if segment_ids is not None:
        args += [segment_ids, segment_ids]
        specs += [PartitionSpec(q_spec[0], q_spec[1]), PartitionSpec(q_spec[0], None)]
    if sinks is not None:
        args.append(sinks)
        specs.append(PartitionSpec(q_spec[2]))

    def device(i: int):
        def run(ql, kf, vf, *rest):
            seg_q, seg_kv = (rest[0], rest[1]) if segment_ids is not None else (None, None)
            sk = rest[-1] if sinks is not None else None
            outs, at = [], 0
            for start, n in context_parallel.shard_chunks(t, c, i):
                extra = {} if sk is None else {"sinks": sk}
                outs.append(local(
                    ql[:, at : at + n], kf, vf, None if seg_q is None else seg_q[:, at : at + n],
                    offset=start, kv_segment_ids=seg_kv, **extra,
                ))  # fmt: skip
                at += n
            return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)

        return run

    def body(ql, kf, vf, *rest):
        if back is not None:  # keys, values and their segment ids in the original order
            kf, vf = kf.take(back, axis=1), vf.take(back, axis=1)
            if segment_ids is not None:
                rest = (rest[0], rest[1].take(back, axis=1), *rest[2:])
        branches = [device(i) for i in range(c)]
        return jax.lax.switch(jax.lax.axis_index("context"), branches, ql, kf, vf, *rest)

    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec, check_vma=False)
    return fn(*args)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    interpret: bool = False,
    scale: float | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Splash attention; inside `jax.shard_map` over the current mesh when there is one."""
    local = functools.partial(_splash_local, interpret=interpret, scale=scale, window=window)
    if sharding.context_size() > 1:
        return _per_context_chunk(q, k, v, segment_ids, sinks, local)
    return per_shard(local, q, k, v, segment_ids, sinks)


# --- cudnn (GPU) ------------------------------------------------------------------------------


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """bool [B, 1, T, T]: key s is in query t's document (causality is applied separately)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    implementation: str = "cudnn",
    scale: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """cuDNN fused attention through `jax.nn.dot_product_attention` (GQA native, layout BTNH).
    `implementation="xla"` runs the very same call through jax's XLA path, which is how the
    arguments are checked on a machine without a GPU."""
    mask = None if segment_ids is None else document_mask(segment_ids)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )
    return out.astype(q.dtype)


def cudnn_chunk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    offset: int,
    kv_segment_ids: jax.Array | None,
    implementation: str = "cudnn",
    scale: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """cuDNN for one chunk of a sequence split over `mesh.context`: queries q [B, n, H, D] at
    original positions offset..offset+n-1, keys and values [B, T, KV, D] in the original order.
    The kernel's causal mask is aligned to the top left (query 0 with key 0), so the offset
    goes in as a mask over the keys the chunk can see at all (from offset - window + 1 with a
    window, up to offset + n - 1), sliced to them: n x (offset + n) at most, no wasted rows."""
    n = q.shape[1]
    lo, hi = (0 if window is None else max(0, offset - window + 1)), offset + n
    q_at, k_at = offset + jnp.arange(n), lo + jnp.arange(hi - lo)
    seen = k_at[None, :] <= q_at[:, None]
    if window is not None:
        seen &= q_at[:, None] - k_at[None, :] < window
    mask = seen[None, None]
    if segment_ids is not None:
        assert kv_segment_ids is not None
        same = segment_ids[:, :, None] == kv_segment_ids[:, None, lo:hi]
        mask = mask & same[:, None]
    out = jax.nn.dot_product_attention(
        q, k[:, lo:hi], v[:, lo:hi], mask=mask, scale=scale, implementation=implementation
    )
    return out.astype(q.dtype)


# --- entry point ------------------------------------------------------------------------------


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    impl: str = "xla",
    scale: float | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal (and segment-limited, and window-limited) attention with the chosen kernel;
    `sinks` [H]: per-head attention sinks (the module docstring)."""
    platform = target_platform()
    kernel = resolve(impl, platform)
    if kernel != "xla":
        reason = unsupported(kernel, q, k, segment_ids, platform, sinks is not None)
        if reason is not None:
            if impl == "auto":
                kernel = "xla"
            else:
                raise ValueError(
                    f"model.attention = {impl!r} cannot take this attention call: {reason}; "
                    "set model.attention to 'xla' or 'auto' (which falls back to xla)"
                )
    if kernel == "splash":
        return splash_attention(
            q,
            k,
            v,
            segment_ids,
            interpret=platform != "tpu",
            scale=scale,
            window=window,
            sinks=sinks,
        )
    if kernel == "cudnn":
        # On CPU, jax's XLA form of the very same call (as splash's interpret mode).
        how = {"implementation": "cudnn" if platform != "cpu" else "xla"}
        if sharding.context_size() > 1:
            local = functools.partial(cudnn_chunk, scale=scale, window=window, **how)
            return _per_context_chunk(q, k, v, segment_ids, None, local)
        local = functools.partial(cudnn_attention, scale=scale, window=window, **how)
        return per_shard(local, q, k, v, segment_ids)
    return xla_attention(q, k, v, segment_ids, scale, window, sinks)
