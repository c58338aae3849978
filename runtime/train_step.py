"""The pure train and eval steps: (state, batch) -> (state, metrics). No I/O, no timing.

The train state is a plain pytree: {"params", "opt_state", "step", "rng"}. A batch holds arrays
shaped [accum, rows, seq_len]; microbatches are scanned, their gradients of the *summed* loss
added, and the total divided once by the global count of counted tokens, so accumulation over
k microbatches gives the same update as one batch k times larger.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from runtime.loss import cross_entropy_sums

Batch = dict[str, jax.Array]
State = dict[str, Any]
BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


def _loss_sums(
    graphdef: nnx.GraphDef, others: tuple, params: Any, mb: Batch
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, params, *others)
    logits = model(mb["inputs"], mb["positions"], mb["segment_ids"])
    return cross_entropy_sums(logits, mb["targets"], mb["loss_mask"])


def make_train_step(
    graphdef: nnx.GraphDef,
    others: tuple,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
) -> Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]:
    # Differentiate the loss *sum*; the token count rides along as aux.
    grad_fn = jax.value_and_grad(partial(_loss_sums, graphdef, others), has_aux=True)

    def train_step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        params = state["params"]

        def micro(carry, mb):
            grads, loss_sum, count = carry
            (ls, c), g = grad_fn(params, mb)
            return (jax.tree.map(jnp.add, grads, g), loss_sum + ls, count + c), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, loss_sum, count), _ = jax.lax.scan(micro, init, batch)
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        rng, _ = jax.random.split(state["rng"])
        metrics = {
            "loss": loss_sum / denom,
            "loss_sum": loss_sum,
            "token_count": count,
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_params),
            "lr": schedule(state["step"]),
        }
        new_state = {
            "params": new_params,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": rng,
        }
        return new_state, metrics

    return train_step


def make_eval_step(
    graphdef: nnx.GraphDef, others: tuple
) -> Callable[[Any, Batch], dict[str, jax.Array]]:
    """Loss sums over one [accum, rows, seq_len] batch (accum is 1 for evals)."""

    def eval_step(params: Any, batch: Batch) -> dict[str, jax.Array]:
        def micro(carry, mb):
            ls, c = _loss_sums(graphdef, others, params, mb)
            return (carry[0] + ls, carry[1] + c), None

        (loss_sum, count), _ = jax.lax.scan(micro, (jnp.zeros(()), jnp.zeros(())), batch)
        return {"loss_sum": loss_sum, "token_count": count}

    return eval_step
