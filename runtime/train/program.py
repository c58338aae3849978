"""The jitted train step exactly as a run compiles it, and the same step in abstract form.

`train_program` is the one place the train step is wrapped in `jax.jit` (shardings, donation,
the activation mesh for sharding constraints). The train loop calls it with real parameters;
`runtime plan` calls `abstract_program` and lowers the result for a target's compile-only
devices: the same function, shardings and donation, with ShapeDtypeStructs for every argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jobspec.run_config import RunConfig
from runtime.model.build import ModelParts, build_model
from runtime.model.sharding import batch_sharding, on_mesh, replicated
from runtime.train.optim import build_optimizer
from runtime.train.state import TrainState, abstract_opt_state, state_shardings
from runtime.train.step import BATCH_KEYS, PG_BATCH_KEYS, make_train_step

_FLOAT_KEYS = {"loss_mask", *PG_BATCH_KEYS}


def train_program(
    cfg: RunConfig,
    parts: ModelParts,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    state_sh: TrainState,
    mesh: Mesh,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted (state, batch) -> (state, metrics) step; the state argument is donated."""
    t = cfg.training
    step = make_train_step(
        parts.graphdef,
        tx,
        schedule,
        objective=t.objective,
        pg_clip_epsilon=t.pg_clip_epsilon,
        router_bias_update_rate=cfg.model.router_bias_update_rate,
        loss_chunk_size=t.loss_chunk_size,
        logits_dtype=t.logits_dtype,
        count_dropped=cfg.model.moe_capacity_factor is not None,
        skip_nonfinite=t.on_nonfinite == "skip_step",
    )

    return jax.jit(
        on_mesh(step, mesh),
        in_shardings=(state_sh, batch_sharding(mesh, 3, leading=1)),
        out_shardings=(state_sh, replicated(mesh)),
        donate_argnums=0,
    )


def batch_keys(cfg: RunConfig) -> tuple[str, ...]:
    """The arrays a train batch carries for this config's objective."""
    if cfg.training.objective == "clipped_pg":
        return BATCH_KEYS + PG_BATCH_KEYS
    return BATCH_KEYS


def abstract_batch(cfg: RunConfig, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """One global train batch [accum, global_batch_size, seq_len] as ShapeDtypeStructs."""
    t = cfg.training
    shape = (t.gradient_accumulation_steps, t.global_batch_size, t.seq_len)
    sh = batch_sharding(mesh, 3, leading=1)
    return {
        k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in _FLOAT_KEYS else jnp.int32, sharding=sh)
        for k in batch_keys(cfg)
    }


@dataclass(frozen=True)
class AbstractProgram:
    """The run's train step with abstract arguments: `step.lower(state, batch)` compiles it."""

    step: Callable
    state: TrainState
    batch: dict[str, jax.ShapeDtypeStruct]
    parts: ModelParts


def abstract_program(cfg: RunConfig, mesh: Mesh) -> AbstractProgram:
    """What `runtime worker` would compile on `mesh`, with no array materialised or data read."""
    parts = build_model(cfg.model, cfg.run.seed, mesh, materialise=False, abstract_others=True)
    total = cfg.training.total_steps
    tx, schedule = build_optimizer(cfg.optimizer, cfg.optimizer.schedule.decay_steps or total)
    state_sh = state_shardings(parts, tx, mesh)
    rep = state_sh.step
    state = TrainState(
        params=parts.params,
        opt_state=abstract_opt_state(tx, parts.params, state_sh),
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
        model_state=parts.others,
    )
    step = train_program(cfg, parts, tx, schedule, state_sh, mesh)
    return AbstractProgram(step=step, state=state, batch=abstract_batch(cfg, mesh), parts=parts)
