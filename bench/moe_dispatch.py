"""Times one MoE expert layer, dense dispatch vs sparse, forward + backward, in one process.

Dense: every expert on every token, weighted by the [tokens, experts] combine matrix (what
`model.moe_dispatch = "dense"` runs). Sparse: `runtime/model/moe/dispatch.py` on one device (sort
by expert, grouped matmuls: megablox on TPU, `lax.ragged_dot` elsewhere), no exchange. Prints one
JSON row: seconds per call of each (median of --repeats), their ratio, and the largest
difference between the two outputs and input gradients (the same math, so rounding only).

    python bench/moe_dispatch.py                       # a small layer (CPU-sized)
    python bench/moe_dispatch.py --tokens 8192 --experts 64 --k 8 --hidden 1024 --ffn 512 \\
        --dtype bfloat16                               # accelerator-sized
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.model.moe import dispatch as moe_dispatch  # noqa: E402
from runtime.model.sharding import target_platform  # noqa: E402


def dense(x, index, w, gate, up, down):
    combine = jnp.sum(jax.nn.one_hot(index, gate.shape[0], dtype=x.dtype) * w[..., None], axis=-2)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, gate)) * jnp.einsum("td,edf->tef", x, up)
    return jnp.einsum("tef,efd->td", h * combine[..., None], down)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    dt = jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(a.tokens, a.hidden)), dt)
    index = jnp.asarray(np.argsort(rng.random((a.tokens, a.experts)), -1)[:, : a.k], jnp.int32)
    w = jnp.asarray(rng.random((a.tokens, a.k)) / a.k, dt)
    scale = a.hidden**-0.5
    gate, up = (jnp.asarray(rng.normal(size=(a.experts, a.hidden, a.ffn)) * scale, dt)
                for _ in range(2))  # fmt: skip
    down = jnp.asarray(rng.normal(size=(a.experts, a.ffn, a.hidden)) * a.ffn**-0.5, dt)
    dispatch = moe_dispatch.resolve("sparse", None, 1, target_platform())

    def sparse(x, index, w, gate, up, down):
        y, _ = moe_dispatch.sparse_experts(
            x[None], index[None], w[None], gate, up, down,
            activation=jax.nn.silu, dispatch=dispatch,
        )  # fmt: skip
        return y[0]

    def step(fn):
        def loss(x, gate, up, down):
            return jnp.sum(fn(x, index, w, gate, up, down).astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    timed = {}
    outs = {}
    for name, fn in (("dense", dense), ("sparse", sparse)):
        f = step(fn)
        outs[name] = jax.block_until_ready(f(x, gate, up, down))
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, gate, up, down))
            times.append(time.perf_counter() - t0)
        timed[name] = statistics.median(times)
    y_d = jax.jit(dense)(x, index, w, gate, up, down).astype(jnp.float32)
    y_s = jax.jit(sparse)(x, index, w, gate, up, down).astype(jnp.float32)
    gx_d, gx_s = (outs[n][1][0].astype(jnp.float32) for n in ("dense", "sparse"))
    print(json.dumps({
        "bench": "moe_dispatch",
        "platform": target_platform(),
        "device": jax.devices()[0].device_kind,
        "shape": {"tokens": a.tokens, "experts": a.experts, "k": a.k, "hidden": a.hidden,
                  "ffn": a.ffn, "dtype": a.dtype},
        "sparse_matmul": dispatch.matmul,
        "dense_s": timed["dense"],
        "sparse_s": timed["sparse"],
        "dense_over_sparse": timed["dense"] / timed["sparse"],
        "max_abs_diff_y": float(jnp.max(jnp.abs(y_d - y_s))),
        "max_abs_y": float(jnp.max(jnp.abs(y_d))),
        "max_abs_diff_grad_x": float(jnp.max(jnp.abs(gx_d - gx_s))),
        "max_abs_grad_x": float(jnp.max(jnp.abs(gx_d))),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
