"""Sparse MoE dispatch: every token visits only its top-k experts, and experts shard over the
`expert` mesh axis (expert parallelism).

Per device, inside one `shard_map` over the whole mesh (tokens split over the batch axes, each
device holding E / mesh.expert experts, their hidden width over `tensor`):

1. The token -> expert assignments (routing is done before, by the caller) are sorted by expert.
   With a capacity factor, an expert takes at most C = ceil(factor x tokens x k / E) of this
   device's assignments, first come first served; the rest are dropped and counted.
2. Each device sends every expert's rows to the device holding that expert (`exchange`):
   `ragged_all_to_all` on TPU/GPU; on CPU, where XLA has no ragged all-to-all, a fixed-size
   `all_to_all` whose slots are sized so that no row is ever dropped. Both place the rows in the
   same layout, so everything after is one code path.
3. The received rows are grouped by local expert and go through the SwiGLU (or GELU) MLP as
   grouped matmuls (optionally with per-expert biases on gate, up and the output, and another
   gated activation of (gate, up), e.g. gpt-oss's clamped SwiGLU: `ExpertBiases`, `glu`):
   megablox (the Pallas TPU kernel, with tiles fitted to the shapes) on TPU, `lax.ragged_dot`
   elsewhere, or, on GPU with a capacity factor, batched matmuls over each expert's fixed slots
   (XLA:GPU expands `ragged_dot` densely over every group). Partial sums over the
   `tensor`-sharded hidden width are summed across `tensor`.
4. The results travel back the same way (the exchange's transpose), return to their assignments'
   positions and are summed over each token's k experts with the router weights.

Every permutation of rows (the sort by expert, the local regroup and their reverses) is a gather
whose gradient is the inverse gather, and the per-expert counts are a compare-and-sum: the step
has no scatter, forward or backward (scatters were the slowest ops of the permute on TPU).

Dropless by default: the receive buffer holds mesh.expert x (the most rows one device can send
one expert shard: tokens x min(k, experts per shard)), so no routing can overflow it. The
exchange is its own VJP's building block (the backward exchange is the forward one with the
sender/receiver sizes transposed), written as a `custom_vjp` so neither collective needs a
transpose rule of its own.

Without a mesh (or on one device) the same per-device function runs unsharded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.model.sharding import LOGICAL_RULES, activation_mesh, current_mesh, target_platform

_RAGGED_PLATFORMS = ("tpu", "cuda", "rocm", "gpu")


@dataclass(frozen=True)
class Dispatch:
    """How an MoE block's experts run (what diagnostics/runtime.json records)."""

    kind: str  # "dense" | "dropless" | "capacity"
    exchange: str  # "none" | "ragged_all_to_all" | "all_to_all"
    matmul: str  # "einsum" | "ragged_dot" | "megablox" | "einsum_slots"
    expert_shards: int
    capacity_factor: float | None

    @property
    def sparse(self) -> bool:
        return self.kind != "dense"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve(
    setting: str, capacity_factor: float | None, expert_shards: int, platform: str
) -> Dispatch:
    """The dispatch `model.moe_dispatch` means on `platform` with `mesh.expert` shards."""
    sparse = setting == "sparse" or (
        setting == "auto"
        and (expert_shards > 1 or capacity_factor is not None or platform in _RAGGED_PLATFORMS)
    )
    if not sparse:
        return Dispatch("dense", "none", "einsum", expert_shards, None)
    if expert_shards == 1:
        exchange = "none"
    else:
        exchange = "ragged_all_to_all" if platform in _RAGGED_PLATFORMS else "all_to_all"
    kind = "dropless" if capacity_factor is None else "capacity"
    if platform == "tpu":
        matmul = "megablox"
    elif platform in _RAGGED_PLATFORMS and capacity_factor is not None:
        matmul = "einsum_slots"
    else:
        matmul = "ragged_dot"
    return Dispatch(kind, exchange, matmul, expert_shards, capacity_factor)


def current(setting: str, capacity_factor: float | None) -> Dispatch:
    """`resolve` for the trace in progress: its mesh's expert axis and target platform."""
    mesh = current_mesh()
    shards = int(mesh.shape.get("expert", 1)) if mesh is not None else 1
    return resolve(setting, capacity_factor, shards, target_platform())


def for_mesh(setting: str, capacity_factor: float | None, mesh: Mesh) -> Dispatch:
    """What a step traced on `mesh` runs (`current` under that mesh)."""
    with activation_mesh(mesh):
        return current(setting, capacity_factor)


def describe(model: Any, mesh: Mesh) -> dict[str, Any] | None:
    """What runtime.json and the plan report say of a model's MoE dispatch on `mesh` (None for a
    model without MoE layers); `model` is a ModelConfig."""
    if model.routed_experts is None:
        return None
    return for_mesh(model.moe_dispatch, model.moe_capacity_factor, mesh).as_dict()


class ExpertBiases(NamedTuple):
    """Per-expert biases of the expert MLP (gpt-oss's): y = (glu(x @ gate + b_gate,
    x @ up + b_up)) @ down + b_down for the expert a row went to."""

    gate: jax.Array  # [E, F]
    up: jax.Array  # [E, F]
    down: jax.Array  # [E, D]


def capacity(capacity_factor: float | None, tokens: int, k: int, experts: int) -> int | None:
    """Assignments one expert takes from one device's `tokens`, or None (dropless)."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * tokens * k / experts))


def sparse_experts(
    x: jax.Array,
    expert_index: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    dispatch: Dispatch,
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    biases: ExpertBiases | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Run each token through its top-k experts.

    x [B, T, D]; expert_index [B, T, k] int; weights [B, T, k] (the combine weights, x's dtype);
    gate, up [E, D, F]; down [E, F, D] (global arrays; sharded as the mesh says).
    -> (y [B, T, D] = sum_k weights * down(activation(x @ gate) * (x @ up)), the number of
    assignments the capacity factor dropped (int32 scalar, 0 when dropless)). `glu(gate, up)`
    replaces `activation(gate) * up` when given; `biases` adds each expert's biases.
    """
    options = {name: v for name, v in (("glu", glu), ("biases", biases)) if v is not None}
    b, t, d = x.shape
    k = expert_index.shape[-1]
    n = b * t
    tokens = x.reshape(n, d)
    index = expert_index.reshape(n, k).astype(jnp.int32)
    w = weights.reshape(n, k)
    num_experts = gate.shape[0]
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        cap = capacity(dispatch.capacity_factor, n, k, num_experts)
        y, dropped = _per_device(
            tokens, index, w, gate, up, down, activation, cap, None, None,
            kernel=dispatch.matmul, **options,
        )  # fmt: skip
        return y.reshape(b, t, d), dropped[0]

    # Token rows [B*T] split over the batch axes and, inside each row, `context` (B-major, as
    # the activation [B, T, D] is laid out): each device routes the tokens it holds.
    batch_axes = tuple(a for a in (*LOGICAL_RULES["batch"], "context") if mesh.shape[a] > 1)
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    pad = -n % shards
    if pad:  # padding rows choose expert E: they sort last and are never sent
        tokens = jnp.pad(tokens, ((0, pad), (0, 0)))
        index = jnp.pad(index, ((0, pad), (0, 0)), constant_values=num_experts)
        w = jnp.pad(w, ((0, pad), (0, 0)))
    ep = int(mesh.shape["expert"])
    if num_experts % ep:
        raise ValueError(f"mesh.expert ({ep}) must divide the {num_experts} routed experts")
    tp = int(mesh.shape["tensor"])
    f = gate.shape[-1]
    expert_axis = "expert" if ep > 1 else None
    tensor_axis = "tensor" if tp > 1 and f % tp == 0 else None
    w_in = PartitionSpec(expert_axis, None, tensor_axis)
    w_out = PartitionSpec(expert_axis, tensor_axis, None)
    # The expert kernels enter with their `embed` axis whole: GSPMD gathers the fsdp shards here
    # (and reduce-scatters their gradients), as it does for every dense layer.
    gate = jax.lax.with_sharding_constraint(gate, NamedSharding(mesh, w_in))
    up = jax.lax.with_sharding_constraint(up, NamedSharding(mesh, w_in))
    down = jax.lax.with_sharding_constraint(down, NamedSharding(mesh, w_out))
    # Biases split like their kernels' outputs: gate/up's over the hidden width, down's whole.
    b_specs = ExpertBiases(
        *(PartitionSpec(expert_axis, a) for a in (tensor_axis, tensor_axis, None))
    )
    if biases is not None:
        biases = ExpertBiases(
            *(
                jax.lax.with_sharding_constraint(b, NamedSharding(mesh, spec))
                for b, spec in zip(biases, b_specs, strict=True)
            )
        )
    rows = PartitionSpec(batch_axes or None, None)
    local = (n + pad) // shards
    cap = capacity(dispatch.capacity_factor, local, k, num_experts)
    ragged = dispatch.exchange == "ragged_all_to_all"
    body = functools.partial(
        _per_device,
        activation=activation,
        cap=cap,
        expert_axis=expert_axis,
        tensor_axis=tensor_axis,
        ragged=ragged,
        kernel=dispatch.matmul,
        **({"glu": glu} if glu is not None else {}),
    )
    args, specs = [tokens, index, w, gate, up, down], [rows, rows, rows, w_in, w_in, w_out]
    if biases is not None:  # one more input, sharded like its kernels (b_specs)
        args.append(biases)
        specs.append(b_specs)
        with_biases = body

        def body(*a: Any) -> tuple[jax.Array, jax.Array]:
            return with_biases(*a[:6], biases=a[6])

    y, dropped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=(rows, PartitionSpec(batch_axes or None)),
        # Pallas kernels (megablox) carry no varying-axes types; the gradients were checked
        # against a dense reference on every layout (tests/test_expert_parallel.py).
        check_vma=False,
    )(*args)
    return y[:n].reshape(b, t, d), jnp.sum(dropped)


def _per_device(
    tokens: jax.Array,
    index: jax.Array,
    w: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
    cap: int | None,
    expert_axis: str | None,
    tensor_axis: str | None,
    ragged: bool = False,
    kernel: str = "ragged_dot",
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    biases: ExpertBiases | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One device's share: tokens [n, D], index/w [n, k], its experts' kernels [E_l, ...] (and
    biases [E_l, ...]); `glu(gate, up)` defaults to activation(gate) * up."""
    n, d = tokens.shape
    k = index.shape[1]
    m = n * k
    local_experts = gate.shape[0]
    ep = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    num_experts = local_experts * ep

    flat = index.reshape(m)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = _expert_counts(flat, num_experts)
    dropped = jnp.zeros((), jnp.int32)
    if cap is not None:
        starts = jnp.cumsum(counts) - counts
        pos = jnp.arange(m) - starts[jnp.minimum(sorted_e, num_experts - 1)]
        keep = (sorted_e < num_experts) & (pos < cap)
        # Kept rows stay grouped by expert in token order; dropped ones move behind them.
        order = order[jnp.argsort(jnp.where(keep, sorted_e, num_experts), stable=True)]
        kept = jnp.minimum(counts, cap)
        dropped = jnp.sum(counts - kept)
        counts = kept
    inverse = _inverse(order)
    rows = _dispatch_rows(tokens, order, inverse, k)  # [m, D] = tokens[order // k], by expert

    if ep == 1:
        received, group_sizes = rows, counts
    else:
        assert expert_axis is not None
        per_shard = jax.lax.all_gather(counts, expert_axis).reshape(ep, ep, local_experts)
        sizes = jnp.sum(per_shard, axis=-1)  # [source, destination] rows
        # The most rows one device can send one shard: every token at most once per expert.
        bound = min(m, n * local_experts)
        if cap is not None:
            bound = min(bound, local_experts * cap)
        send = _exchange(n * k, ep * bound, bound, expert_axis, ragged)
        received = send(rows, sizes)  # [ep * bound, D]: by source, then by expert
        me = jax.lax.axis_index(expert_axis)
        mine = jnp.take(per_shard, me, axis=1)  # [source, local expert] rows received
        ends = jnp.cumsum(mine.reshape(-1))
        segment = jnp.searchsorted(ends, jnp.arange(ep * bound), side="right")
        local_e = jnp.where(segment < ep * local_experts, segment % local_experts, local_experts)
        regroup = jnp.argsort(local_e, stable=True)
        unregroup = _inverse(regroup)
        received = _permute(received, regroup, unregroup)
        group_sizes = jnp.sum(mine, axis=0)

    group_sizes = group_sizes.astype(jnp.int32)
    valid = jnp.arange(received.shape[0]) < jnp.sum(group_sizes)
    if cap is not None and ep == 1:
        # The dropped rows sit past the groups, where megablox writes nothing, not even in the
        # backward: masked here, that garbage never reaches the tokens' gradient.
        received = jnp.where(valid[:, None], received, jnp.zeros((), received.dtype))
    glu = glu or functools.partial(_gated, activation)
    if kernel == "einsum_slots":
        assert cap is not None, "the slotted matmul needs a capacity factor"
        out = _slotted_mlp(received, group_sizes, gate, up, down, glu, ep * cap, biases)
    else:
        gmm = functools.partial(_grouped_matmul, group_sizes=group_sizes, kernel=kernel)
        g, u = gmm(received, gate), gmm(received, up)
        if biases is not None:
            rows_of = _group_onehot(group_sizes, received.shape[0], received.dtype)
            g, u = g + rows_of @ biases.gate, u + rows_of @ biases.up
        out = gmm(glu(g, u), down)
    if tensor_axis is not None:
        out = jax.lax.psum(out, tensor_axis)
    if biases is not None:  # after the psum: added once, not once per `tensor` shard
        out = out + _group_onehot(group_sizes, out.shape[0], out.dtype) @ biases.down
    out = jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))

    if ep > 1:
        out = _permute(out, unregroup, regroup)
        out = send_back(n * k, ep * bound, bound, expert_axis, ragged)(out, sizes)
    per_assignment = _permute(out, inverse, order).reshape(n, k, d)
    y = jnp.einsum("nkd,nk->nd", per_assignment, w.astype(per_assignment.dtype))
    return y, dropped.reshape(1)


# Measured on one v5e (bench/tpu/results/2026-12-07-moe-profile.md): 512-row tiles reload each
# weight tile 4x less often than 128-row ones; 256 and 1024 rows were slower.
ROW_TILE = 512
# The widest contracted or output tile: on v5e a 2048-wide tile overflows the kernel's scoped
# VMEM (CompileTimeScopedVmemOom); 1024 compiles there and is the fastest width measured.
TILE_WIDTH = 1024


def fit_tile(width: int, cap: int) -> int:
    """The whole width when it fits, else the largest multiple of 128 that divides it and is at
    most `cap` (no masked remainder tile), else `cap`."""
    if width <= cap:
        return width
    return max((t for t in range(128, cap + 1, 128) if width % t == 0), default=cap)


@functools.cache
def megablox_tiling(row_tile: int, cap: int) -> Callable[[int, int, int], tuple[int, int, int]]:
    """megablox's tiling function `(m, k, n) -> (tm, tk, tn)`, called for the forward `gmm` and
    both VJP kernels. Cached: the kernels take it as a static argument, compared by identity."""

    def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
        return min(row_tile, m), fit_tile(k, cap), fit_tile(n, cap)

    return tiling


def _grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, kernel: str) -> jax.Array:
    """x [R, K] rows grouped by expert (group g: the next group_sizes[g] rows), w [G, K, N] ->
    [R, N]; rows past the groups come out as garbage or zeros (the caller masks them).

    `megablox`: the Pallas grouped matmul of jax.experimental (TPU), whose VJP computes the
    weight gradient as a grouped matmul too (`tgmm`); XLA's own transpose of `ragged_dot` for
    the weights is a dense masked product over every group, E_l times the work. `ragged_dot`:
    `lax.ragged_dot` (GPU, and CPU for tests)."""
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes)
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    r = x.shape[0]
    tile_m = ROW_TILE if r >= ROW_TILE else -(-r // 8) * 8
    pad = -r % tile_m
    rows = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    tiling = megablox_tiling(tile_m, TILE_WIDTH)
    # Off a TPU (tests on CPU) the kernel runs in Pallas' interpreter.
    interpret = target_platform() != "tpu"
    out = gmm(rows, w, group_sizes, x.dtype, tiling, None, None, False, interpret)
    return out[:r] if pad else out


def _gated(
    activation: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array
) -> jax.Array:
    """The plain gated MLP hidden: activation(gate) * up."""
    return activation(gate) * up


def _group_onehot(group_sizes: jax.Array, rows: int, dtype: Any) -> jax.Array:
    """[rows, G] in `dtype`: row r's group (the rows come grouped, group g the next
    group_sizes[g] of them) as a one-hot row; rows past the groups are all zero. A bias gathered
    by this product has a matmul, not a scatter, for its gradient."""
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")
    return (group[:, None] == jnp.arange(group_sizes.shape[0])[None, :]).astype(dtype)


def _slotted_mlp(
    rows: jax.Array,
    group_sizes: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    glu: Callable[[jax.Array, jax.Array], jax.Array],
    slots: int,
    biases: ExpertBiases | None = None,
) -> jax.Array:
    """The expert MLP as batched matmuls over [E_l, slots, D]: each local expert's rows (at most
    `slots`, which the capacity guarantees) copied into its own slots, and back. The work is
    E_l x slots rows, the capacity, where XLA:GPU's `ragged_dot` computes every group over
    every row. With `biases`, their gate and up parts (the caller adds the output's)."""
    local_experts = gate.shape[0]
    starts = jnp.cumsum(group_sizes) - group_sizes
    j = jnp.arange(slots)
    src = starts[:, None] + j[None, :]  # [E_l, slots]
    filled = j[None, :] < group_sizes[:, None]
    x = jnp.where(filled[..., None], rows[jnp.clip(src, 0, rows.shape[0] - 1)], 0)
    g, u = jnp.einsum("esd,edf->esf", x, gate), jnp.einsum("esd,edf->esf", x, up)
    if biases is not None:
        g, u = g + biases.gate[:, None, :], u + biases.up[:, None, :]
    y = jnp.einsum("esf,efd->esd", glu(g, u), down)
    r = jnp.arange(rows.shape[0])
    expert = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(group_sizes), r, side="right"), local_experts - 1
    )
    return y[expert, jnp.clip(r - starts[expert], 0, slots - 1)]


def _inverse(perm: jax.Array) -> jax.Array:
    """The inverse of a permutation of 0..len-1 (integer; no gradient flows through it), by a
    sort rather than a scatter."""
    return jnp.argsort(perm).astype(perm.dtype)


def _expert_counts(flat: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert [E] int32 by a compare-and-sum (no scatter); ids out of range
    (padding rows, id E) match no expert, so they are never counted or sent."""
    experts = jnp.arange(num_experts, dtype=flat.dtype)
    return jnp.sum(flat[:, None] == experts[None, :], axis=0, dtype=jnp.int32)


@jax.custom_vjp
def _permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[perm] for a permutation `perm` of x's rows whose inverse is `inverse`."""
    return x[perm]


def _permute_fwd(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> tuple[jax.Array, Any]:
    return x[perm], inverse


def _permute_bwd(inverse: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    # Every row moved exactly once: its cotangent is gathered back (XLA's own is a scatter).
    return g[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_rows(tokens: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """tokens [n, D] -> tokens[order // k] [n k, D]: each token's k assignments, in the order of
    the permutation `order` (inverse `inverse`). Gathering from the [n, D] table, not a k-times
    repeated one, lets XLA keep the source in fast memory."""
    return tokens[order // k]


def _dispatch_fwd(
    tokens: jax.Array, order: jax.Array, inverse: jax.Array, k: int
) -> tuple[jax.Array, Any]:
    return tokens[order // k], inverse


def _dispatch_bwd(k: int, inverse: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    # Assignment i of token t (t k + i) sits at row inverse[t k + i]: gather each token's k
    # cotangents back and sum them, instead of XLA's scatter-add.
    return g[inverse].reshape(-1, k, g.shape[1]).sum(axis=1), None, None


_dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


# --- the exchange -------------------------------------------------------------------------------


def _exchange(
    rows_in: int, rows_out: int, bound: int, axis: str, ragged: bool
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """x [rows_in, D], sizes [P, P] (sizes[i, j]: rows device i sends device j, the same matrix
    on every device) -> [rows_out, D]: device j's rows from 0, 1, ... in order, zeros after.

    Device i's rows for j are x[sum(sizes[i, :j]) : ... + sizes[i, j]]; at most `bound` rows go
    from one device to another."""

    @jax.custom_vjp
    def exchange(x: jax.Array, sizes: jax.Array) -> jax.Array:
        return _move(x, sizes, rows_out, bound, axis, ragged)

    def fwd(x: jax.Array, sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _move(x, sizes, rows_out, bound, axis, ragged), sizes

    def bwd(sizes: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
        # Every row went to exactly one place: the cotangent comes back the same way reversed.
        return _move(g, sizes.T, rows_in, bound, axis, ragged), None

    exchange.defvjp(fwd, bwd)
    return exchange


def send_back(
    rows_in: int, rows_out: int, bound: int, axis: str, ragged: bool
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The reverse of `_exchange(rows_in, rows_out, ...)` for the same `sizes`: [rows_out, D] ->
    [rows_in, D], each row back where it came from."""
    forward = _exchange(rows_out, rows_in, bound, axis, ragged)
    return lambda y, sizes: forward(y, sizes.T)


def _move(
    x: jax.Array, sizes: jax.Array, rows_out: int, bound: int, axis: str, ragged: bool
) -> jax.Array:
    me = jax.lax.axis_index(axis)
    send = sizes[me]
    input_offsets = jnp.cumsum(send) - send
    received = sizes[:, me]
    # Where device i's rows land on device j: after the rows of devices 0..i-1.
    landing = jnp.cumsum(sizes, axis=0) - sizes
    if ragged:
        out = jnp.zeros((rows_out, x.shape[1]), x.dtype)
        # The output buffer varies over the same mesh axes as the rows it receives.
        varying = tuple(sorted(jax.typeof(x).manual_axis_type.varying))
        if varying:
            out = jax.lax.pcast(out, varying, to="varying")
        return jax.lax.ragged_all_to_all(
            x, out, input_offsets, send, landing[me], received, axis_name=axis
        )
    # Fixed-size fallback: `bound` slots per destination, then the received slots packed.
    p = sizes.shape[0]
    slot = jnp.arange(bound)
    src = input_offsets[:, None] + slot[None, :]
    filled = slot[None, :] < send[:, None]
    buf = jnp.where(filled[..., None], x[jnp.clip(src, 0, x.shape[0] - 1)], jnp.zeros((), x.dtype))
    got = jax.lax.all_to_all(buf, axis, 0, 0)  # got[i]: device i's slots for me
    ends = jnp.cumsum(received)
    r = jnp.arange(rows_out)
    source = jnp.searchsorted(ends, r, side="right")
    offset = r - (ends - received)[jnp.minimum(source, p - 1)]
    picked = got[jnp.minimum(source, p - 1), jnp.clip(offset, 0, bound - 1)]
    return jnp.where((source < p)[:, None], picked, jnp.zeros((), x.dtype))
