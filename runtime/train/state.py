"""The train state: what a step reads and returns, its shardings, and how it is created or restored."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jobspec.errors import CheckpointError
from runtime.model.sharding import replicated


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


def others_from_saved(reference: tuple, saved: list, sharding) -> tuple:
    """The checkpointed router biases (meta["router_bias"]), in the model's non-Param state
    layout: what training moved must also be what eval, sample and resume route with."""
    leaves, treedef = jax.tree.flatten(reference)
    if len(leaves) != len(saved):
        raise CheckpointError(
            f"the checkpoint holds {len(saved)} router-bias arrays but this model has {len(leaves)}; "
            "resume with the model the checkpoint was made with"
        )
    arrays = [jax.device_put(np.asarray(v, dtype=ref.dtype).reshape(ref.shape), sharding)
              for ref, v in zip(leaves, saved, strict=True)]  # fmt: skip
    return jax.tree.unflatten(treedef, arrays)
