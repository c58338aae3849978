"""Qwen3-MoE sparse MLP (HF `Qwen3MoeSparseMoeBlock` semantics), densely dispatched.

Math, per token x [hidden]:

    logits  = x @ router                       (no bias; accumulated and kept in fp32)
    probs   = softmax(logits) in fp32 over the experts
    chosen  = top-k experts of (logits + router_bias)   (router_bias only steers the choice)
    w       = probs[chosen], renormalised to sum 1 when norm_topk_prob
    y       = sum_k w_k * down_k(silu(gate_k(x)) * up_k(x))

With a zero router bias the choice is top-k of probs, exactly HF. Two dispatches compute y
(`model.moe_dispatch`, resolved per trace by `runtime/model/moe/dispatch.py`):

- dense: every expert runs on every token (one einsum over an expert axis) and a
  [tokens, experts] combine matrix, zero off the top-k, weights the results. Exact and simple;
  compute grows with num_experts, so it suits small models.
- sparse: each token visits only its k experts (sorted, exchanged over the `expert` mesh axis,
  grouped matmuls, returned and combined); dropless, or with a capacity factor that drops and
  counts the overflow. What large MoE models need.

Parameter paths inside `layers[i]` of `runtime.model.qwen3.decoder.Qwen3Decoder`:

    mlp.gate.kernel            [hidden, num_experts]            ("embed", "expert")
    mlp.experts.gate_proj      [E, hidden, moe_intermediate]    ("expert", "embed", "mlp")
    mlp.experts.up_proj        [E, hidden, moe_intermediate]    ("expert", "embed", "mlp")
    mlp.experts.down_proj      [E, moe_intermediate, hidden]    ("expert", "mlp", "embed")
    mlp.router_bias            [E] fp32, a `RouterBias` (NOT an nnx.Param: no gradient, no
                               optimizer state; it lives in the non-Param state). No HF weight.

With `model.scan_layers` every one of these gains a leading [num_layers] axis (logical name
"layers") and the path loses the layer index: `layers.mlp.experts.gate_proj` [L, E, hidden, F],
`layers.mlp.router_bias` [L, E]; the loads come back stacked [L, E] from the scan either way.

The HF names these map to (saved checkpoints keep one `mlp.experts.{e}.*_proj.weight` per
expert; kernels transpose) are the name map in `runtime/model/qwen3_moe/hf_names.py`.

Aux-loss-free balancing (DeepSeek-V3): the train step moves each layer's bias by
rate * sign(mean_load - load) after the gradient step (`update_router_bias`), so an under-loaded
expert is chosen more often; the combine weights never see the bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.layers import (
    ACT_EMBED,
    ACT_EXPERT,
    ACT_EXPERT_MLP,
    dtype_of,
    normal_param,
)
from runtime.model.moe import dispatch as moe_dispatch
from runtime.model.sharding import constrain


class RouterBias(nnx.Variable):
    """Per-expert selection bias. Not an nnx.Param: `nnx.split(model, nnx.Param, ...)` puts it in
    the non-Param state, so gradients and the optimizer never touch it."""


class Router(nnx.Module):
    """The router projection: `kernel` [hidden, num_experts], no bias."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        self.kernel = normal_param(
            rngs,
            (cfg.hidden_size, cfg.num_experts),
            ("embed", "expert"),
            cfg.init_std,
            dtype_of(cfg.param_dtype),
            eager_sharding,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., hidden] -> fp32 logits [..., E]."""
        w = self.kernel[...].astype(x.dtype)
        return jnp.einsum("...d,de->...e", x, w, preferred_element_type=jnp.float32)


class Experts(nnx.Module):
    """E SwiGLU experts with stacked kernels; `__call__` runs all of them on every token."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        param_dtype = dtype_of(cfg.param_dtype)

        def param(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
            return normal_param(rngs, shape, names, cfg.init_std, param_dtype, eager_sharding)

        self.gate_proj = param((e, d, f), ("expert", "embed", "mlp"))
        self.up_proj = param((e, d, f), ("expert", "embed", "mlp"))
        self.down_proj = param((e, f, d), ("expert", "mlp", "embed"))
        self.compute_dtype = dtype_of(cfg.compute_dtype)

    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """x [B, T, D], combine [B, T, E] (zero off each token's top-k) -> [B, T, D]."""
        cd = self.compute_dtype
        # [B, T, E, F] intermediates: batch-sharded like every activation, experts replicated
        # (LOGICAL_RULES["expert"]), the expert hidden over `tensor` as a dense MLP's would be.
        g = constrain(
            jnp.einsum("btd,edf->btef", x, self.gate_proj[...].astype(cd)), ACT_EXPERT_MLP
        )
        u = constrain(jnp.einsum("btd,edf->btef", x, self.up_proj[...].astype(cd)), ACT_EXPERT_MLP)
        h = jax.nn.silu(g) * u
        # Weight each expert's hidden activations before the down projection: the same sum as
        # weighting the outputs (down is linear), without a [B, T, E, D] intermediate.
        h = constrain(h * combine[..., None].astype(cd), ACT_EXPERT_MLP)
        return constrain(jnp.einsum("btef,efd->btd", h, self.down_proj[...].astype(cd)), ACT_EMBED)

    def kernels(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate, up [E, D, F], down [E, F, D]) in the compute dtype, for the sparse dispatch."""
        cd = self.compute_dtype
        return (
            self.gate_proj[...].astype(cd),
            self.up_proj[...].astype(cd),
            self.down_proj[...].astype(cd),
        )


def route(
    logits: jax.Array, bias: jax.Array, k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array]:
    """fp32 logits [..., E], bias [E] -> (weights [..., k] fp32, one-hot choices [..., k, E]).

    Selection is top-k of logits + bias (top-k of softmax(logits) when the bias is 0, since softmax
    is monotone); the weights are the unbiased softmax probabilities of the chosen experts.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    onehot = _top_k_onehot(logits.astype(jnp.float32) + bias.astype(jnp.float32), k)  # [..., k, E]
    top = jnp.einsum("...e,...ke->...k", probs, onehot)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, onehot


def assignment_load(onehot: jax.Array) -> jax.Array:
    """One-hot choices [..., k, E] -> the fraction of assignments each expert got [E] (sums to 1;
    every token counts, padding included)."""
    e = onehot.shape[-1]
    counts = jnp.sum(onehot.reshape(-1, e), axis=0)
    return counts / (onehot.size // e)


class MoEStats(NamedTuple):
    """What an MoE block reports besides its output (stacked over layers by the decoders)."""

    load: jax.Array  # [E]: the fraction of this call's assignments each expert got
    dropped: jax.Array  # []: assignments the capacity factor dropped (0 when dropless)


def stack_stats(stats: list[MoEStats | None]) -> MoEStats | None:
    """Per-layer stats of the MoE layers (None entries: dense layers, skipped) -> [M, ...]."""
    kept = [s for s in stats if s is not None]
    return jax.tree.map(lambda *a: jnp.stack(a), *kept) if kept else None


def run_experts(
    x: jax.Array,
    top: jax.Array,
    onehot: jax.Array,
    dispatch: moe_dispatch.Dispatch,
    dense: Callable[[jax.Array, jax.Array], jax.Array],
    kernels: Callable[[], tuple[jax.Array, jax.Array, jax.Array]],
    activation: Callable[[jax.Array], jax.Array],
    *,
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    biases: Callable[[], moe_dispatch.ExpertBiases] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D], top [B, T, k], onehot [B, T, k, E] -> (y [B, T, D], dropped assignments).

    Dense: `dense(x, combine [B, T, E])`. Sparse: `kernels()` gives (gate, up [E, D, F],
    down [E, F, D]) for runtime/model/moe/dispatch.py; `glu(gate, up)` replaces
    activation(gate) * up and `biases()` gives per-expert biases, when set (gpt-oss's experts).
    The router weights are cast to x's dtype before weighting the experts, as HF does."""
    if not dispatch.sparse:
        combine = jnp.einsum("...k,...ke->...e", top, onehot)
        return dense(x, constrain(combine.astype(x.dtype), ACT_EXPERT)), jnp.zeros((), jnp.int32)
    index = jnp.argmax(onehot, axis=-1).astype(jnp.int32)
    gate, up, down = kernels()
    return moe_dispatch.sparse_experts(
        x,
        index,
        top.astype(x.dtype),
        gate,
        up,
        down,
        activation=activation,
        dispatch=dispatch,
        glu=glu,
        biases=None if biases is None else biases(),
    )


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation (HF `GptOssExperts._apply_gate`): the gate clamped above at
    `limit`, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _top_k_onehot(scores: jax.Array, k: int) -> jax.Array:
    """One-hot rows [..., k, E] of the k best experts per token, best first, ties to the lower
    index (`lax.top_k`'s order). k rounds of argmax rather than `lax.top_k`: the SPMD partitioner
    splits an argmax over the batch axes, while it gathered top_k's operand to the global batch on
    every chip; k is small (a handful of experts), so the rounds cost little."""
    e = scores.shape[-1]
    rows = []
    for _ in range(k):
        pick = jax.nn.one_hot(jnp.argmax(scores, axis=-1), e, dtype=jnp.float32)
        rows.append(pick)
        scores = jnp.where(pick > 0, -jnp.inf, scores)
    return jnp.stack(rows, axis=-2)


class SparseMoE(nnx.Module):
    """Qwen3-MoE block: router (`gate`), stacked `experts`, and the selection `router_bias`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        self.num_experts_per_tok = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Router(cfg, rngs=rngs, eager_sharding=eager_sharding)
        self.experts = Experts(cfg, rngs=rngs, eager_sharding=eager_sharding)
        self.router_bias = RouterBias(jnp.zeros((cfg.num_experts,), jnp.float32))
        self.dispatch = cfg.moe_dispatch
        self.capacity_factor = cfg.moe_capacity_factor

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """x [B, T, D] -> (y [B, T, D], MoEStats: expert load [E] and dropped assignments)."""
        logits = constrain(self.gate(x), ACT_EXPERT)
        top, onehot = route(
            logits, self.router_bias[...], self.num_experts_per_tok, self.norm_topk_prob
        )
        dispatch = moe_dispatch.current(self.dispatch, self.capacity_factor)
        y, dropped = run_experts(
            x, top, onehot, dispatch, self.experts, self.experts.kernels, jax.nn.silu
        )
        return y, MoEStats(assignment_load(onehot), dropped)


def load_max_over_mean(loads: jax.Array) -> jax.Array:
    """loads [L, E] -> max/mean over experts, averaged over layers (1.0 = perfectly balanced)."""
    return jnp.mean(jnp.max(loads, axis=-1) / jnp.mean(loads, axis=-1))


def update_router_bias(others: tuple, loads: jax.Array, rate: float) -> tuple:
    """bias_i <- bias_i + rate * sign(mean(load_i) - load_i) for every MoE layer's RouterBias.

    others: the non-Param states from `nnx.split(model, nnx.Param, ...)`; loads [M, E], one row
    per layer that has a router bias, in layer order (M = num_layers when every layer is MoE;
    fewer when some layers are dense, as in qwen3_next). Per-layer biases
    (`layers.{i}.mlp.router_bias` [E]) take the row of layer i's rank among those layers; a
    scanned model's one stacked bias (`layers.mlp.router_bias` [L, E]) takes all rows at once;
    in layers scanned in periods (`layers.blocks.{j}.mlp.router_bias` [R, E], block j of each
    repetition) block j takes every S-th row from its rank among the S blocks with a bias.
    Returns others with the same structure. Runs outside any gradient.
    """
    delta = rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)  # [M, E]

    def layer_key(path: tuple) -> Any:
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        if "router_bias" not in keys:
            return None
        after = keys[keys.index("layers") + 1]
        return ("blocks", int(keys[keys.index("layers") + 2])) if after == "blocks" else after

    def is_index(key: Any) -> bool:
        return isinstance(key, int) or (isinstance(key, str) and key.isdigit())

    with_bias = jax.tree_util.tree_flatten_with_path(others)[0]
    keys = [layer_key(path) for path, _ in with_bias]
    ranks = {i: r for r, i in enumerate(sorted(int(k) for k in keys if is_index(k)))}
    blocks = sorted(k[1] for k in keys if isinstance(k, tuple))

    def step(path: tuple, leaf: Any) -> Any:
        after = layer_key(path)
        if after is None:
            return leaf
        if is_index(after):
            return leaf + delta[ranks[int(after)]].astype(leaf.dtype)
        if isinstance(after, tuple):
            rows = delta[blocks.index(after[1]) :: len(blocks)]
            if leaf.shape != rows.shape:
                raise ValueError(
                    f"router bias of period block {after[1]} {leaf.shape} does not match its "
                    f"loads {rows.shape}"
                )
            return leaf + rows.astype(leaf.dtype)
        if leaf.shape != delta.shape:
            raise ValueError(
                f"stacked router bias {leaf.shape} does not match the loads {delta.shape}"
            )
        return leaf + delta.astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(step, others)
