"""Everything a run builds from its config before the first step, shared by train/eval/sample.

Builders only: each function makes one thing from its config section. The model is built
abstractly first, so parameters are created directly with their mesh shardings (no host copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jobspec.families.model_config import ModelConfig
from runtime.model.registry import build_model_module
from runtime.model.sharding import mesh_spec, replicated


@dataclass(frozen=True)
class ModelParts:
    """The model split into its static graph, its parameters and any other (constant) state."""

    graphdef: nnx.GraphDef
    params: Any  # nnx.State of parameters, laid out on the mesh
    others: tuple  # non-parameter state (e.g. RoPE tables), replicated
    param_shardings: Any


def _abstract_model(cfg: ModelConfig, seed: int) -> nnx.Module:
    # The family's module records logical names only (eager_sharding=False); mesh placement is
    # sharding.py's.
    return nnx.eval_shape(lambda: build_model_module(cfg, rngs=nnx.Rngs(params=seed)))


def param_shardings(abstract_params: nnx.State, mesh: Mesh) -> Any:
    specs = nnx.get_partition_spec(abstract_params)
    return jax.tree.map(
        lambda spec, leaf: NamedSharding(mesh, mesh_spec(spec, leaf.shape, mesh)),
        specs,
        abstract_params,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


def build_model(
    cfg: ModelConfig,
    seed: int,
    mesh: Mesh,
    *,
    materialise: bool = True,
    abstract_others: bool = False,
) -> ModelParts:
    """Create parameters directly with their shardings; `materialise=False` keeps them abstract
    (ShapeDtypeStructs with shardings) as restore targets. With `cfg.init_from` ("hf:PATH") the
    materialised parameters are that HF model's weights, placed with the same shardings.
    `abstract_others` (with materialise=False) leaves the non-Param state abstract too: nothing
    runs, so the mesh may be made of compile-only devices (`runtime plan`)."""
    graphdef, abs_params, abs_others = nnx.split(_abstract_model(cfg, seed), nnx.Param, ...)
    p_sh = param_shardings(abs_params, mesh)
    o_sh = jax.tree.map(lambda _: replicated(mesh), abs_others)

    def init():
        model = build_model_module(cfg, rngs=nnx.Rngs(params=seed))
        _, params, others = nnx.split(model, nnx.Param, ...)
        return params, others

    if materialise and cfg.init_from:
        # `model.init_from = "hf:PATH"`: the HF weights are the initial parameters.
        from jobspec.hf_config import hf_dir
        from runtime.hf.convert import place_params, place_state
        from runtime.model.hf_weights import load_hf_params

        flat = load_hf_params(hf_dir(cfg.init_from), cfg)
        params = place_params(flat, abs_params, p_sh)
        # Non-Param state the name map gives an HF tensor (deepseek_v3's router bias) too.
        others = place_state(flat, jax.jit(lambda: init()[1], out_shardings=o_sh)(), o_sh)
    elif materialise:
        params, others = jax.jit(init, out_shardings=(p_sh, o_sh))()
    else:
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_params, p_sh
        )
        if abstract_others:
            others = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_others, o_sh
            )
            return ModelParts(graphdef, params, (others,), p_sh)
        # XLA drops the unused parameter initialisers, so this only computes the constants.
        others = jax.jit(lambda: init()[1], out_shardings=o_sh)()
    return ModelParts(graphdef=graphdef, params=params, others=(others,), param_shardings=p_sh)
