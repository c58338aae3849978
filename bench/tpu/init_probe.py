"""Where `build_model` spends its time on an accelerator: abstract build, lowering, compile and
execution of the parameter init, then build_model itself. On the TPU v5e chip the "building the
model" phase of Qwen3-0.6B took 78 s, then 20.9 s, then 8.8 s (docs/performance.md, "Time to first step"); run
this there to split it:

    python3 bench/tpu/init_probe.py [CONFIG] [--per-layer] [--compare]

`--per-layer` measures the scanned layers' former init instead (each layer built in turn from the
shared RNG streams, then `stack_layers`: a program that grows with depth) for comparison with the
`build_stacked` the model uses now (one copy of each layer's initialisers, in a loop). Both give the
same parameters, bit for bit (tests/test_init_compile.py); `--compare` checks that on the
config given, building the parameters both ways with `build_model` and comparing their bits.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

T0 = time.time()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from runtime.host import platform  # noqa: E402

platform.choose()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402

from jobspec.files.run_toml import load_run_config  # noqa: E402
from runtime.model.build import _abstract_model, build_model  # noqa: E402
from runtime.model.registry import build_model_module  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402


def timed(label: str, fn: Callable[[], Any]) -> Any:
    t = time.time()
    out = fn()
    if out is not None and not hasattr(out, "compile") and not callable(out):
        jax.block_until_ready(out)
    print(f"{label:<12} {time.time() - t:7.2f} s", flush=True)
    return out


def _use_per_layer_init() -> None:
    """Build scanned layers one by one and stack them, as before `layers.build_stacked`."""
    from runtime.model.layers import stack_layers
    from runtime.model.qwen3 import decoder as qwen3

    def per_layer(make: Any, rngs: nnx.Rngs, num: int, *, eager_sharding: bool = False) -> Any:
        return stack_layers([make(rngs) for _ in range(num)], eager_sharding=eager_sharding)

    qwen3.build_stacked = per_layer  # type: ignore[assignment]


def _same_bits(a: jax.Array, b: jax.Array) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return bool(
        jnp.array_equal(lax.bitcast_convert_type(a, as_int), lax.bitcast_convert_type(b, as_int))
    )


def main() -> None:
    flags = {"--per-layer", "--compare"}
    args = [a for a in sys.argv[1:] if a not in flags]
    if "--per-layer" in sys.argv[1:]:
        _use_per_layer_init()
    path = args[0] if args else "bench/tpu/qwen3-0.6b-v5e.toml"
    cfg, _ = load_run_config(path, {})
    mesh = build_mesh(cfg.mesh)
    print(f"jax ready    {time.time() - T0:7.2f} s after start, {jax.devices()}", flush=True)
    print(
        f"init         {'per layer' if '--per-layer' in sys.argv else 'build_stacked'}", flush=True
    )
    timed("abstract", lambda: (_abstract_model(cfg.model, 0), None)[1])

    def init() -> tuple:
        model = build_model_module(cfg.model, rngs=nnx.Rngs(params=0))
        _, params, others = nnx.split(model, nnx.Param, ...)
        return params, others

    lowered = timed("lower", lambda: jax.jit(init).lower())
    compiled = timed("compile", lowered.compile)
    timed("execute", compiled)
    params = timed("build_model", lambda: build_model(cfg.model, 0, mesh).params)
    if "--compare" in sys.argv[1:] and "--per-layer" not in sys.argv[1:]:
        del lowered, compiled
        _use_per_layer_init()
        old = timed("per layer", lambda: build_model(cfg.model, 0, mesh).params)
        same = jax.tree.leaves(jax.tree.map(_same_bits, params, old))
        print(f"compare      {sum(same)} of {len(same)} parameter arrays bit-identical", flush=True)


if __name__ == "__main__":
    main()
