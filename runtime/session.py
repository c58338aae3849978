"""Everything a run builds from its config before the first step, shared by train/eval/sample.

Builders only: each function makes one thing from its config section. The model is built
abstractly first, so parameters are created directly with their mesh shardings (no host copy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jobspec.errors import CheckpointError
from jobspec.run_config import DataConfig, ModelConfig
from runtime.data.manifest import Manifest, load_manifest
from runtime.data.prepare import prepare_dataset
from runtime.model import Decoder
from runtime.sharding import mesh_spec, replicated
from runtime.storage import url_to_fs


@dataclass(frozen=True)
class ModelParts:
    """The model split into its static graph, its parameters and any other (constant) state."""

    graphdef: nnx.GraphDef
    params: Any  # nnx.State of parameters, laid out on the mesh
    others: tuple  # non-parameter state (e.g. RoPE tables), replicated
    param_shardings: Any


def ensure_manifest(cfg: DataConfig, *, is_writer: bool = True) -> Manifest:
    """Load the manifest; make it first when it is absent and `[data.prepare]` says how.

    Only the writer prepares; the other hosts wait for it at a barrier, so a multi-host job
    prepares once (on storage every host reads: a shared path or gs://).
    """
    if cfg.prepare is not None:
        fs, path = url_to_fs(cfg.manifest)
        if is_writer and not fs.exists(path):
            out_dir = os.path.dirname(cfg.manifest.rstrip("/")) or "."
            prepare_dataset(
                cfg.prepare.inputs,
                cfg.prepare.tokenizer,
                out_dir,
                val_fraction=cfg.prepare.val_fraction,
                max_bytes=cfg.prepare.max_bytes,
                format=cfg.prepare.format,
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxjob:data-prepared")
    return load_manifest(cfg.manifest)


def _abstract_model(cfg: ModelConfig, seed: int) -> nnx.Module:
    # Decoder records logical names only (eager_sharding=False); mesh placement is sharding.py's.
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(params=seed)))


def param_shardings(abstract_params: nnx.State, mesh: Mesh) -> Any:
    specs = nnx.get_partition_spec(abstract_params)
    return jax.tree.map(
        lambda spec, leaf: NamedSharding(mesh, mesh_spec(spec, leaf.shape, mesh)),
        specs,
        abstract_params,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


def build_model(cfg: ModelConfig, seed: int, mesh: Mesh, *, materialise: bool = True) -> ModelParts:
    """Create parameters directly with their shardings; `materialise=False` keeps them abstract
    (ShapeDtypeStructs with shardings) as restore targets. With `cfg.init_from` ("hf:PATH") the
    materialised parameters are that HF model's weights, placed with the same shardings."""
    graphdef, abs_params, abs_others = nnx.split(_abstract_model(cfg, seed), nnx.Param, ...)
    p_sh = param_shardings(abs_params, mesh)
    o_sh = jax.tree.map(lambda _: replicated(mesh), abs_others)

    def init():
        model = Decoder(cfg, rngs=nnx.Rngs(params=seed))
        _, params, others = nnx.split(model, nnx.Param, ...)
        return params, others

    if materialise and cfg.init_from:
        # `model.init_from = "hf:PATH"`: the HF weights are the initial parameters.
        from jobspec.hf_config import hf_dir
        from runtime.hf.io import load_hf_params, place_params

        flat = load_hf_params(hf_dir(cfg.init_from), cfg)
        params = place_params(flat, abs_params, p_sh)
        others = jax.jit(lambda: init()[1], out_shardings=o_sh)()
    elif materialise:
        params, others = jax.jit(init, out_shardings=(p_sh, o_sh))()
    else:
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_params, p_sh
        )
        # XLA drops the unused parameter initialisers, so this only computes the constants.
        others = jax.jit(lambda: init()[1], out_shardings=o_sh)()
    return ModelParts(graphdef=graphdef, params=params, others=(others,), param_shardings=p_sh)


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
