"""Gated DeltaNet: the chunked form versus the naive per-token scan, forward + backward, jitted.

Both run in the same process on the same random inputs (Qwen3-Next-like: q/k l2-normalised in
the kernel, log-decays <= 0, beta in (0, 1)); each timed call is value_and_grad of a sum over
the outputs and the final state with respect to q, k, v, g and beta. After one warm-up call
(compile), the two sides alternate for --runs timed calls each, so drift hits both equally; the
median is reported. Prints JSON.

    python bench/deltanet.py [--sizes 512,2048] [--batch 1] [--heads 4] [--dim 64] [--runs 5]
                             [--chunk-size 64] [--precision highest|high|default]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from runtime.model.deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule


def random_inputs(b: int, t: int, h: int, d: int, seed: int = 0) -> list[jax.Array]:
    r = np.random.default_rng(seed)
    f = np.float32
    q, k, v = (r.normal(size=(b, t, h, d)).astype(f) for _ in range(3))
    g = -np.log1p(np.exp(r.normal(size=(b, t, h)))).astype(f)
    beta = (1 / (1 + np.exp(-r.normal(size=(b, t, h))))).astype(f)
    return [jnp.asarray(x) for x in (q, k, v, g, beta)]


def fwd_bwd(fn: Callable) -> Callable:
    def loss(*args):
        out, state = fn(*args)
        return jnp.sum(out) + jnp.sum(state)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def time_call(fn: Callable, args: list[jax.Array]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512,2048", help="comma-separated sequence lengths T")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="dk = dv")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5, help="timed calls per side and size")
    ap.add_argument(
        "--precision",
        default="highest",
        choices=["default", "high", "highest"],
        help="matmul precision of both forms (default: JAX's platform default)",
    )
    args = ap.parse_args()

    precision = None if args.precision == "default" else args.precision
    chunked = partial(chunked_gated_delta_rule, chunk_size=args.chunk_size, precision=precision)
    sides = {
        "chunked": fwd_bwd(chunked),
        "naive": fwd_bwd(partial(recurrent_gated_delta_rule, precision=precision)),
    }
    results = []
    for t in (int(s) for s in args.sizes.split(",")):
        x = random_inputs(args.batch, t, args.heads, args.dim)
        compile_s = {name: time_call(fn, x) for name, fn in sides.items()}  # warm-up: compiles
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.runs):
            # Alternate which side goes first, so neither always runs on a warmer machine.
            for name in sides if r % 2 == 0 else reversed(sides):
                times[name].append(time_call(sides[name], x))
        median = {name: statistics.median(ts) for name, ts in times.items()}
        results.append({
            "T": t,
            "chunked_ms": 1e3 * median["chunked"],
            "naive_ms": 1e3 * median["naive"],
            "naive_over_chunked": median["naive"] / median["chunked"],
            "first_call_s": compile_s,
        })  # fmt: skip
    print(json.dumps({
        "benchmark": "deltanet",
        "device": jax.devices()[0].device_kind,
        "pass": "forward+backward (value_and_grad w.r.t. q, k, v, g, beta), jitted",
        "batch": args.batch,
        "heads": args.heads,
        "dk": args.dim,
        "dv": args.dim,
        "chunk_size": args.chunk_size,
        "precision": args.precision,
        "runs": args.runs,
        "results": results,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
