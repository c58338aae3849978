"""Scanned layers are initialised by one build of a layer, looped or batched over the layers
(`layers.build_stacked`), not layer by layer:
the parameters are bit for bit those of the per-layer build then `stack_layers` (the unrolled
model's draws, stacked), and the init program does not grow with `num_layers`.

Only the families with scanned layers are checked (qwen3, qwen3_moe): gemma4_text and qwen3_next
never scan (their layers differ), so they keep building layer by layer.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import jax.extend
import numpy as np
import pytest
from flax import nnx

from jobspec.families.model_config import ModelConfig
from jobspec.run_config import MeshConfig
from runtime.model.build import build_model
from runtime.model.layers import stack_layers
from runtime.model.registry import build_model_module
from runtime.model.sharding import build_mesh

TINY: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, max_position_embeddings=64, init_std=0.1, rope_theta=10_000.0,
)  # fmt: skip
MOE: dict[str, Any] = dict(
    family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
)
FAMILIES = {"qwen3": {}, "qwen3_moe": MOE}


def _cfg(family: str, num_layers: int, scan: bool = True, **over: Any) -> ModelConfig:
    return ModelConfig(
        **{**TINY, **FAMILIES[family], "num_layers": num_layers, "scan_layers": scan, **over}
    )


def _old_scanned(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The scanned model as it was built before `build_stacked`: every layer built in turn from
    the shared streams (the unrolled model, same draws in the same order), then stacked."""
    model = build_model_module(cfg.model_copy(update={"scan_layers": False}), rngs=rngs)
    model.layers = stack_layers(list(model.layers))
    return model


def _new_scanned(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return build_model_module(cfg, rngs=rngs)


def _arrays(model: nnx.Module) -> dict[tuple, np.ndarray]:
    """Every variable of the model (parameters and the rest), by path."""
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same(new: dict[tuple, np.ndarray], old: dict[tuple, np.ndarray]) -> None:
    assert new.keys() == old.keys()
    for path in old:
        assert new[path].dtype == old[path].dtype, path
        assert new[path].shape == old[path].shape, path
        assert np.array_equal(new[path], old[path]), path


def _rngs(seed: int, impl: str) -> nnx.Rngs:
    return nnx.Rngs(params=jax.random.key(seed, impl=impl))


@cache  # the jitted per-layer build is compiled once for the tests that compare with it
def _jitted(build: Any, cfg: ModelConfig, seed: int, impl: str) -> dict[tuple, np.ndarray]:
    """The model's arrays from a jitted init, as `build_model` runs it."""

    def init() -> Any:
        return nnx.state(build(cfg, _rngs(seed, impl)))

    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(jax.jit(init)())}


# Untied: the lm head is drawn after the layers, so the streams must be advanced past them.
CASES = [
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": False, "param_dtype": "bfloat16"}),
    ("qwen3_moe", {"tie_word_embeddings": False}),
]


# Eagerly threefry2x32 (JAX's default) is built under jax.vmap (rbg keys layer by layer); jitted,
# as build_model runs it, every implementation in a lax.map over the layers. Three layers: layer i
# starts its streams i draws-per-layer on, so layers 1 and 2 check that offset (a single layer
# takes the same path with offset 0 only).
@pytest.mark.parametrize(("family", "over"), CASES)
@pytest.mark.parametrize(("num_layers", "impl"), [(3, "threefry2x32"), (3, "unsafe_rbg")])
def test_stacked_init_is_the_per_layer_init_bit_for_bit(
    family: str, over: dict[str, Any], num_layers: int, impl: str
) -> None:
    cfg = _cfg(family, num_layers, **over)
    # Eagerly, with the streams' state after the build compared too.
    old_rngs, new_rngs = _rngs(3, impl), _rngs(3, impl)
    old = _arrays(_old_scanned(cfg, old_rngs))
    _assert_same(_arrays(_new_scanned(cfg, new_rngs)), old)
    assert int(new_rngs.params.count[...]) == int(old_rngs.params.count[...])
    # Jitted, as build_model runs it (XLA's fused normal may differ from the eager one in the last
    # bit, so jitted is compared with jitted).
    _assert_same(_jitted(_new_scanned, cfg, 3, impl), _jitted(_old_scanned, cfg, 3, impl))


def test_default_stream_and_a_later_draw() -> None:
    """An `nnx.Rngs(seed)` (the `default` stream serves `params`), and a draw after the model is
    built from the same streams: the same key as after the per-layer build."""
    cfg = _cfg("qwen3", 4, tie_word_embeddings=False)
    old_rngs, new_rngs = nnx.Rngs(7), nnx.Rngs(7)
    _assert_same(_arrays(_new_scanned(cfg, new_rngs)), _arrays(_old_scanned(cfg, old_rngs)))
    after_old = jax.random.key_data(old_rngs.params())
    after_new = jax.random.key_data(new_rngs.params())
    assert np.array_equal(np.asarray(after_new), np.asarray(after_old))


def test_build_model_params_are_the_per_layer_ones() -> None:
    cfg = _cfg("qwen3_moe", 3, tie_word_embeddings=False)
    parts = build_model(cfg, 3, build_mesh(MeshConfig(), jax.devices()[:1]))
    new = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(parts.params)}
    # Seed 3, as the bit-for-bit test's qwen3_moe case: its jitted per-layer build is reused.
    old = _jitted(_old_scanned, cfg, 3, str(jax.random.key_impl(jax.random.key(0))))
    _assert_same(new, {path: old[path] for path in new})


def _eqn_counts(jaxpr: Any) -> tuple[int, int]:
    """(all equations, random-bits / threefry equations) of a jaxpr and its sub-jaxprs."""
    total = random = 0
    for eqn in jaxpr.eqns:
        total += 1
        if "random_bits" in eqn.primitive.name or "threefry" in eqn.primitive.name:
            random += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            t, r = _eqn_counts(sub)
            total, random = total + t, random + r
    return total, random


def _init_jaxpr_counts(cfg: ModelConfig, impl: str) -> tuple[int, int]:
    def init() -> Any:
        _, params, others = nnx.split(build_model_module(cfg, rngs=_rngs(0, impl)), nnx.Param, ...)
        return params, others

    return _eqn_counts(jax.make_jaxpr(init)().jaxpr)


@pytest.mark.parametrize("impl", ["threefry2x32", "unsafe_rbg"])
@pytest.mark.parametrize("family", FAMILIES)
def test_init_program_does_not_grow_with_depth(family: str, impl: str) -> None:
    shallow = _init_jaxpr_counts(_cfg(family, 2, tie_word_embeddings=False), impl)
    deep = _init_jaxpr_counts(_cfg(family, 8, tie_word_embeddings=False), impl)
    assert shallow[1] > 0  # the counter does see the initialisers
    assert deep == shallow


def _random_shapes(jaxpr: Any) -> list[tuple[int, ...]]:
    """The output shapes of every random-bits equation in a jaxpr and its sub-jaxprs."""
    shapes = []
    for eqn in jaxpr.eqns:
        if "random_bits" in eqn.primitive.name:
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _random_shapes(sub)
    return shapes


def test_jitted_init_draws_one_layer_at_a_time() -> None:
    """XLA's TPU compile time grows with the size of each random array (the 0.6B init: 23.8 s
    batched over the layers, 2.8 s looped), so the jitted init draws per-layer arrays in a loop:
    no random array has the layer axis."""
    layers = 5
    cfg = _cfg("qwen3", layers, intermediate_size=48)

    def init() -> Any:
        return nnx.split(build_model_module(cfg, rngs=nnx.Rngs(params=0)), nnx.Param, ...)[1]

    shapes = _random_shapes(jax.make_jaxpr(init)().jaxpr)
    assert (32, 48) in shapes  # a layer's MLP kernel, drawn inside the loop
    assert not [shape for shape in shapes if shape[:1] == (layers,)], shapes
