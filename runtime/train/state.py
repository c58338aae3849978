"""The typed train state, its same-shaped tree of shardings, and how it is created or restored.

`TrainState` is a flax struct (a pytree): params, optimizer state, step, PRNG key and the model
state, i.e. the model's non-Param state (`ModelParts.others`: MoE router biases and the like;
for a dense model an empty state). The model state is always present, so the step and the loop
never test for it. `state_shardings` returns a TrainState whose leaves are shardings, the
`in_shardings`/`out_shardings` of the jitted step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jobspec.errors import CheckpointError
from runtime.model.build import ModelParts
from runtime.model.sharding import replicated
from runtime.run.meta import CheckpointMeta


@struct.dataclass
class TrainState:
    params: Any  # nnx.State of parameters
    opt_state: Any  # optax state; moments sharded like their parameters
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # PRNG key, split once per step
    model_state: tuple  # the model's non-Param state (ModelParts.others), possibly empty


def opt_state_shardings(
    tx: optax.GradientTransformation, params: Any, p_sh: Any, mesh: Mesh
) -> Any:
    """Optimizer moments take their parameter's sharding (FSDP shards them too); scalars replicate."""
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract,
        p_sh,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def state_shardings(parts: ModelParts, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """The TrainState-shaped tree of shardings for `parts` trained with `tx` on `mesh`."""
    rep = replicated(mesh)
    return TrainState(
        params=parts.param_shardings,
        opt_state=opt_state_shardings(tx, parts.params, parts.param_shardings, mesh),
        step=rep,
        rng=rep,
        model_state=jax.tree.map(lambda _: rep, parts.others),
    )


def new_state(
    parts: ModelParts, tx: optax.GradientTransformation, shardings: TrainState, seed: int
) -> TrainState:
    """Step 0: the built parameters, a fresh optimizer state, the seed's PRNG key."""
    rep = shardings.step
    return TrainState(
        params=parts.params,
        opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(parts.params),
        step=jax.device_put(jnp.asarray(0, jnp.int32), rep),
        rng=jax.device_put(jax.random.PRNGKey(seed), rep),
        model_state=parts.others,
    )


def abstract_opt_state(tx: optax.GradientTransformation, params: Any, shardings: TrainState) -> Any:
    """The optimizer state as a restore target: shapes, dtypes and shardings, no arrays."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(tx.init, params),
        shardings.opt_state,
    )


def restored_state(
    parts: ModelParts, params: Any, opt_state: Any, meta: CheckpointMeta, shardings: TrainState
) -> TrainState:
    """The state a checkpoint holds: its arrays, its step and key, its model state if saved."""
    rep = shardings.step
    return TrainState(
        params=params,
        opt_state=opt_state,
        # Optimizer steps taken: the run's steps less those skip_step skipped.
        step=jax.device_put(jnp.asarray(meta.step - meta.skipped_steps, jnp.int32), rep),
        rng=jax.device_put(np.asarray(meta.rng, dtype=np.uint32), rep),
        model_state=model_state_from_meta(parts.others, meta, rep),
    )


def model_state_record(state: TrainState) -> list[Any]:
    """The model state as CheckpointMeta.model_state: small fp32 vectors, exact through JSON."""
    return [np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(state.model_state))]


def model_state_from_meta(reference: tuple, meta: CheckpointMeta, sharding: Any) -> tuple:
    """The checkpointed model state in the model's non-Param state layout (`reference` when the
    checkpoint saved none): what training moved is what eval, sample and resume route with."""
    saved = meta.model_state
    if saved is None:
        return reference
    leaves, treedef = jax.tree.flatten(reference)
    if len(leaves) != len(saved):
        raise CheckpointError(
            f"the checkpoint holds {len(saved)} router-bias arrays but this model has {len(leaves)}; "
            "resume with the model the checkpoint was made with"
        )
    arrays = [jax.device_put(np.asarray(v, dtype=ref.dtype).reshape(ref.shape), sharding)
              for ref, v in zip(leaves, saved, strict=True)]  # fmt: skip
    return jax.tree.unflatten(treedef, arrays)
