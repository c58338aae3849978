"""DeepSeek-V3's MoE block (transformers' `DeepseekV3MoE`): sigmoid router scores, group-limited
top-k steered by the aux-loss-free bias, scaled weights, and shared experts beside the routed.

Per token x [hidden], with E experts in `n_group` groups:

    s       = sigmoid(x @ gate)                       (fp32: x and the router kernel upcast)
    c       = s + router_bias                         (HF's e_score_correction_bias; choice only)
    groups  = the topk_group groups of the best sum of their 2 best c
    chosen  = top-k of c within those groups
    w       = s[chosen], / (sum + 1e-20) when norm_topk_prob, times routed_scaling_factor
    y       = sum_k w_k * expert_k(x) + shared_experts(x)

The routed experts, their stacked kernels, the dense/sparse dispatch (expert parallelism) and the
`router_bias` that `router_bias_update_rate` steps are runtime/model/moe/layer.py's
`SparseMoE`'s; only the routing and the shared experts are this family's. Paths below `mlp`:
`gate.kernel`,
`experts.{gate,up,down}_proj`, `router_bias` (not a Param), `shared_experts.{gate,up,down}_proj`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.deepseek_v3.mla import settings
from runtime.model.layers import ACT_EMBED, ACT_EXPERT
from runtime.model.moe import dispatch as moe_dispatch
from runtime.model.moe.layer import MoEStats, SparseMoE, assignment_load, run_experts
from runtime.model.qwen3.decoder import MLP
from runtime.model.sharding import constrain


def _best(scores: jax.Array, k: int) -> jax.Array:
    """One-hot rows [..., k, N] of the k highest scores, by k rounds of argmax (ties to the lower
    index; the SPMD partitioner splits an argmax over the batch, as runtime/model/moe/layer.py
    notes)."""
    n = scores.shape[-1]
    rows = []
    for _ in range(k):
        pick = jax.nn.one_hot(jnp.argmax(scores, axis=-1), n, dtype=jnp.float32)
        rows.append(pick)
        scores = jnp.where(pick > 0, -jnp.inf, scores)
    return jnp.stack(rows, axis=-2)


def group_limited_route(
    logits: jax.Array,
    bias: jax.Array,
    *,
    k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[jax.Array, jax.Array]:
    """fp32 router logits [..., E], bias [E] -> (weights [..., k] fp32, one-hot choices
    [..., k, E]), as transformers' DeepseekV3TopkRouter (module docstring)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    e = choice.shape[-1]
    grouped = choice.reshape(*choice.shape[:-1], n_group, e // n_group)
    # A group's score: the sum of its 2 best choice scores.
    top2 = jnp.sum(jnp.einsum("...gn,...gkn->...gk", grouped, _best(grouped, 2)), axis=-1)
    allowed = jnp.sum(_best(top2, topk_group), axis=-2)  # [..., G], 1 for the chosen groups
    allowed = jnp.repeat(allowed, e // n_group, axis=-1) > 0
    onehot = _best(jnp.where(allowed, choice, -jnp.inf), k)
    top = jnp.einsum("...e,...ke->...k", scores, onehot)
    if norm_topk_prob:
        top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
    return top * scaling, onehot


class DeepseekMoE(SparseMoE):
    """SparseMoE's router kernel, experts and router bias with DeepSeek's routing (module
    docstring), plus `shared_experts`: a SwiGLU of n_shared_experts x moe_intermediate_size."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        super().__init__(cfg, rngs=rngs, eager_sharding=eager_sharding)
        d = settings(cfg)
        self.n_group, self.topk_group = d.n_group, d.topk_group
        self.scaling = d.routed_scaling_factor
        assert cfg.moe_intermediate_size is not None
        width = cfg.moe_intermediate_size * d.n_shared_experts
        self.shared_experts = MLP(cfg, width=width, rngs=rngs, eager_sharding=eager_sharding)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """x [B, T, D] -> (y [B, T, D], MoEStats: expert load [E] and dropped assignments)."""
        f32 = jnp.float32
        kernel = self.gate.kernel[...].astype(f32)
        logits = constrain(jnp.einsum("btd,de->bte", x.astype(f32), kernel), ACT_EXPERT)
        top, onehot = group_limited_route(
            logits,
            self.router_bias[...],
            k=self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            scaling=self.scaling,
        )
        dispatch = moe_dispatch.current(self.dispatch, self.capacity_factor)
        routed, dropped = run_experts(
            x, top, onehot, dispatch, self.experts, self.experts.kernels, jax.nn.silu
        )
        shared, _ = self.shared_experts(x)
        return constrain(routed + shared, ACT_EMBED), MoEStats(assignment_load(onehot), dropped)
