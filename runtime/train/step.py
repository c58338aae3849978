"""The pure train and eval steps: (state, batch) -> (state, metrics). No I/O, no timing.

The train state is a `TrainState` (train/state.py). A batch holds arrays
shaped [accum, rows, seq_len]; microbatches are scanned, their gradients of the *summed* loss
added, and the total divided once by the global count of counted tokens, so accumulation over
k microbatches gives the same update as one batch k times larger.

clipped_pg: metrics add `pg_clip_fraction`, the share of counted tokens whose probability ratio
was clipped (their gradient is zero).

The model runs with the state's `model_state` (the non-Param model state). For a model with
expert routing, metrics add `expert_load_max_over_mean`, and with router_bias_update_rate > 0
the step returns the model state with every layer's RouterBias moved by
rate * sign(mean_load - load).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from runtime.model.attention import context_parallel
from runtime.model.moe.layer import load_max_over_mean, update_router_bias
from runtime.train.loss import hidden_group_sums, hidden_loss_sums
from runtime.train.state import TrainState

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")
# Extra per-token float32 arrays a clipped_pg batch carries, shaped like the others.
PG_BATCH_KEYS = ("advantages", "old_logprobs")
OBJECTIVES = ("cross_entropy", "clipped_pg")


def _loss_sums(
    graphdef: nnx.GraphDef,
    others: tuple,
    params: Any,
    mb: Batch,
    *,
    objective: str = "cross_entropy",
    pg_clip_epsilon: float = 0.2,
    with_loads: bool = False,
    loss_chunk_size: int = 0,
    logits_dtype: str = "float32",
) -> tuple[jax.Array, Any]:
    """(loss sum, count); with_loads: (loss sum, (count, clipped, MoE stats or None)) (the
    stats: `runtime.model.moe.layer.MoEStats`, load [L, E] and dropped assignments [L]),
    where clipped counts the clipped_pg tokens whose ratio was clipped (0 for cross-entropy).

    The loss is taken from the final hidden states and the head kernel `loss_chunk_size`
    positions at a time (train/loss.py `hidden_loss_sums`); 0 = the whole sequence at once."""
    model = nnx.merge(graphdef, params, *others)
    pg = objective == "clipped_pg"
    # Under mesh.context > 1, the sequence in the balanced layout (the sums do not depend on it).
    with context_parallel.balanced(mb) as mb:
        h, loads = model.forward_hidden(mb["inputs"], mb["positions"], mb["segment_ids"])
        loss_sum, count, clipped = hidden_loss_sums(
            h,
            model.head_kernel(),
            mb["targets"],
            mb["loss_mask"],
            chunk_size=loss_chunk_size,
            objective=objective,
            advantages=mb["advantages"] if pg else None,
            old_logprobs=mb["old_logprobs"] if pg else None,
            clip_eps=pg_clip_epsilon,
            softcap=model.logit_softcap,
            logits_dtype=logits_dtype,
        )
    return (loss_sum, (count, clipped, loads)) if with_loads else (loss_sum, count)


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    objective: str = "cross_entropy",
    pg_clip_epsilon: float = 0.2,
    router_bias_update_rate: float = 0.0,
    loss_chunk_size: int = 0,
    logits_dtype: str = "float32",
    count_dropped: bool = False,
    skip_nonfinite: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jit-able train step. With objective="clipped_pg" every batch also carries
    PG_BATCH_KEYS (float32 [accum, rows, seq_len]) and the loss is the clipped policy gradient.

    loss_chunk_size > 0: the [rows, seq_len, vocab] float32 logits are made (and, in the backward
    pass, recomputed) that many positions at a time, never whole; 0 = whole sequence.

    count_dropped (an MoE with a capacity factor): rows gain `moe_dropped_tokens`, the token ->
    expert assignments the capacity dropped this step, summed over layers and microbatches.

    skip_nonfinite (training.on_nonfinite = "skip_step"): a step whose loss, gradient norm or
    updated parameter norm is NaN/inf keeps the parameters, optimizer state, model state and
    optimizer step count it was given (a select on device: no host sync), so the schedule goes
    on where it was; metrics add `skipped` (1.0 when it was). The values are global, so every
    host decides the same."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if loss_chunk_size < 0:
        raise ValueError(f"loss_chunk_size must be >= 0, got {loss_chunk_size}")
    rate = float(router_bias_update_rate)
    # The loss *sum* is differentiated; the token count and expert loads ride along as aux.
    loss = partial(
        _loss_sums,
        graphdef,
        objective=objective,
        pg_clip_epsilon=pg_clip_epsilon,
        with_loads=True,
        loss_chunk_size=loss_chunk_size,
        logits_dtype=logits_dtype,
    )

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        if objective == "clipped_pg" and (missing := [k for k in PG_BATCH_KEYS if k not in batch]):
            raise ValueError(f"a clipped_pg batch needs {missing} alongside {BATCH_KEYS}")
        params = state.params
        model_others = state.model_state
        grad_fn = jax.value_and_grad(partial(loss, model_others), has_aux=True)
        grads, loss_sum, count, clipped, loads = _summed_grads(grad_fn, params, batch)
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        rng, _ = jax.random.split(state.rng)
        metrics = {
            "loss": loss_sum / denom,
            "loss_sum": loss_sum,
            "token_count": count,
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_params),
            "lr": schedule(state.step),
        }
        if objective == "clipped_pg":  # share of counted tokens whose probability ratio was clipped
            metrics["pg_clip_fraction"] = clipped / denom
        if loads is not None:
            model_others = _expert_loads(metrics, loads, model_others, count_dropped, rate)
        new_state = TrainState(
            params=new_params,
            opt_state=opt_state,
            step=state.step + 1,
            rng=rng,
            model_state=model_others,
        )
        if skip_nonfinite:
            new_state = _unless_nonfinite(new_state, state, metrics)
        return new_state, metrics

    return train_step


def _summed_grads(grad_fn: Callable, params: Any, batch: Batch) -> tuple:
    """(gradient sum, loss sum, token count, clipped count, expert loads or None) over the
    batch's microbatches, scanned; `grad_fn` is the loss sum's value_and_grad."""

    def micro(carry, mb):
        grads, loss_sum, count, clipped = carry
        (ls, (c, k, loads)), g = grad_fn(params, mb)
        return (jax.tree.map(jnp.add, grads, g), loss_sum + ls, count + c, clipped + k), loads

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    scalar = jnp.zeros((), jnp.float32)
    (grads, loss_sum, count, clipped), loads = jax.lax.scan(
        micro, (zeros, scalar, scalar, scalar), batch
    )
    return grads, loss_sum, count, clipped, loads


def _expert_loads(
    metrics: dict[str, jax.Array], loads: Any, model_others: tuple, count_dropped: bool, rate: float
) -> tuple:
    """An MoE step's load figures into `metrics`; the model state with its router biases moved
    (rate > 0). `loads`: load [accum, L, E]; every microbatch has the same tokens."""
    if count_dropped:
        metrics["moe_dropped_tokens"] = jnp.sum(loads.dropped).astype(jnp.float32)
    load = jax.lax.stop_gradient(jnp.mean(loads.load, axis=0))
    metrics["expert_load_max_over_mean"] = load_max_over_mean(load)
    return update_router_bias(model_others, load, rate) if rate > 0 else model_others


def _unless_nonfinite(
    new: TrainState, old: TrainState, metrics: dict[str, jax.Array]
) -> TrainState:
    """skip_step: `new`, or where the step's loss, gradient norm or updated parameter norm is
    NaN/inf, `old`'s parameters, optimizer state, model state and step count (a select on
    device: no host sync); metrics add `skipped` (1.0 when it was)."""
    finite = (
        jnp.isfinite(metrics["loss"])
        & jnp.isfinite(metrics["grad_norm"])
        & jnp.isfinite(metrics["param_norm"])
    )

    def keep(n: Any, o: Any) -> Any:
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)

    metrics["skipped"] = jnp.logical_not(finite).astype(jnp.float32)
    return TrainState(
        params=keep(new.params, old.params),
        opt_state=keep(new.opt_state, old.opt_state),
        step=jnp.where(finite, new.step, old.step),  # no optimizer step taken
        rng=new.rng,
        model_state=keep(new.model_state, old.model_state),
    )


def make_eval_step(
    graphdef: nnx.GraphDef,
    loss_chunk_size: int = 0,
    num_sources: int = 0,
    logits_dtype: str = "float32",
) -> Callable[[Any, tuple, Batch], dict[str, jax.Array]]:
    """Loss sums over one [accum, rows, seq_len] batch (accum is 1 for evals); the logits are
    made `loss_chunk_size` positions at a time as in the train step (0 = whole sequence).

    num_sources > 0 (an eval over a `[[data.sources]]` mixture): the batch also carries `source`
    (int32, shaped like the tokens: each position's source index), and the sums add
    `loss_sum_per_source` and `token_count_per_source` [num_sources]. Like the totals they are
    sums over the global batch, so every process gets the same, whole figures.

    `others` (the non-Param model state) is an argument, not closed over: an MoE run's router
    biases move with training, and the train step donates the arrays it was given."""
    if num_sources:
        return _grouped_eval_step(graphdef, loss_chunk_size, num_sources, logits_dtype)

    def eval_step(params: Any, others: tuple, batch: Batch) -> dict[str, jax.Array]:
        def micro(carry, mb):
            ls, c = _loss_sums(
                graphdef,
                others,
                params,
                mb,
                loss_chunk_size=loss_chunk_size,
                logits_dtype=logits_dtype,
            )
            return (carry[0] + ls, carry[1] + c), None

        (loss_sum, count), _ = jax.lax.scan(micro, (jnp.zeros(()), jnp.zeros(())), batch)
        return {"loss_sum": loss_sum, "token_count": count}

    return eval_step


def _grouped_eval_step(
    graphdef: nnx.GraphDef, loss_chunk_size: int, num_sources: int, logits_dtype: str
) -> Callable[[Any, tuple, Batch], dict[str, jax.Array]]:
    """`make_eval_step` with the sums also split by each position's `source`."""

    def eval_step(params: Any, others: tuple, batch: Batch) -> dict[str, jax.Array]:
        def micro(carry, mb):
            model = nnx.merge(graphdef, params, *others)
            with context_parallel.balanced(mb) as mb:
                h, _ = model.forward_hidden(mb["inputs"], mb["positions"], mb["segment_ids"])
                sums = hidden_group_sums(
                    h,
                    model.head_kernel(),
                    mb["targets"],
                    mb["loss_mask"],
                    mb["source"],
                    num_sources,
                    chunk_size=loss_chunk_size,
                    softcap=model.logit_softcap,
                    logits_dtype=logits_dtype,
                )
            return tuple(a + s for a, s in zip(carry, sums, strict=True)), None

        zero, zeros = jnp.zeros((), jnp.float32), jnp.zeros((num_sources,), jnp.float32)
        (loss_sum, count, by_source, counts), _ = jax.lax.scan(
            micro, (zero, zero, zeros, zeros), batch
        )
        return {
            "loss_sum": loss_sum,
            "token_count": count,
            "loss_sum_per_source": by_source,
            "token_count_per_source": counts,
        }

    return eval_step
