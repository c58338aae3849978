"""Where `build_model` spends its time on an accelerator: abstract build, lowering, compile and
execution of the parameter init, then build_model itself. On the TPU v5e chip the "building the
model" phase of Qwen3-0.6B took 78 s (README "On a TPU v5e chip"); run this there to split it:

    python3 bench/tpu/init_probe.py [CONFIG]
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
from flax import nnx  # noqa: E402

from jobspec.load import load_run_config  # noqa: E402
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


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "bench/tpu/qwen3-0.6b-v5e.toml"
    cfg, _ = load_run_config(path, {})
    mesh = build_mesh(cfg.mesh)
    print(f"jax ready    {time.time() - T0:7.2f} s after start, {jax.devices()}", flush=True)
    timed("abstract", lambda: (_abstract_model(cfg.model, 0), None)[1])

    def init() -> tuple:
        model = build_model_module(cfg.model, rngs=nnx.Rngs(params=0))
        _, params, others = nnx.split(model, nnx.Param, ...)
        return params, others

    lowered = timed("lower", lambda: jax.jit(init).lower())
    compiled = timed("compile", lowered.compile)
    timed("execute", compiled)
    timed("build_model", lambda: build_model(cfg.model, 0, mesh).params)


if __name__ == "__main__":
    main()
