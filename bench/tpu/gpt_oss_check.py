"""gpt-oss on a TPU chip: splash attention with per-head sinks (causal and with a local window,
packed documents, GQA) against the einsum reference, values and gradients; a tiny gpt_oss train
step with splash against xla attention and the sparse (megablox) expert dispatch against the
dense one; and the time of one attention layer's forward + backward at 2,048 tokens. One JSON
line per check on stdout (and in $OUT/gpt_oss_check.jsonl when OUT is set).

    python3 bench/tpu/gpt_oss_check.py          # SMALL=1: tiny shapes, no timing (a CPU dry run)

Comparisons in fp32 run at `jax.default_matmul_precision("highest")` (the tiny model too, in fp32); each sinks case has a no-sinks
twin, so the kernel's own rounding is the yardstick for what the sinks add.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from runtime.model.attention import kernels as attention  # noqa: E402

SMALL = os.environ.get("SMALL") == "1"


def emit(row: dict) -> None:
    """Print the row and append it to $OUT/gpt_oss_check.jsonl at once: a later check that fails
    does not lose the rows before it."""
    print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpt_oss_check.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def attention_case(t: int, window: int | None, dtype, sinks_on: bool) -> dict:
    rng = np.random.default_rng(0)
    h, kvh, d = 8, 2, 64
    q = jnp.asarray(rng.normal(size=(2, t, h, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(2, t, kvh, d)), dtype) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(h,)) * 2, jnp.float32) if sinks_on else None
    cut = t // 3
    seg = jnp.asarray([[1] * t, [1] * cut + [2] * (t - cut)], jnp.int32)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def grads(impl: str):
        def loss(q, k, v, s):
            out = attention.attend(q, k, v, seg, impl=impl, window=window, sinks=s)
            return jnp.sum(out.astype(jnp.float32) * w)

        argnums = (0, 1, 2, 3) if sinks_on else (0, 1, 2)
        return jax.jit(jax.value_and_grad(loss, argnums=argnums))(q, k, v, sinks)

    (ref, ref_g), (got, got_g) = grads("xla"), grads("splash")

    def splash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attention.attend(q, k, v, seg, impl="splash", window=window, sinks=sinks)

    lowered = jax.jit(splash).lower(q, k, v)
    return {
        "check": "attention", "tokens": t, "window": window, "dtype": jnp.dtype(dtype).name,
        "sinks": sinks_on, "kernel_in_hlo": "tpu_custom_call" in lowered.as_text(),
        "value_rel": abs(float(got - ref)) / max(abs(float(ref)), 1e-30),
        "grad_rel": {n: rel(a, b) for n, a, b in zip("qkvs", got_g, ref_g, strict=False)},
    }  # fmt: skip


def model_case() -> dict:
    """A tiny gpt_oss (2 layers: sliding 128, full) at 512 tokens: loss and every gradient with
    splash vs xla attention, and the sparse (megablox) vs dense expert dispatch."""
    from flax import nnx

    from jobspec.families.model_config import ModelConfig
    from jobspec.run_config import MeshConfig
    from runtime.hf.convert import flat_params
    from runtime.model.build import build_model
    from runtime.model.sharding import build_mesh, on_mesh

    base = dict(family="gpt_oss", vocab_size=512, hidden_size=256, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=64, intermediate_size=256, max_position_embeddings=1024,
                init_std=0.05, gpt_oss=dict(num_local_experts=8, num_experts_per_tok=2,
                                            sliding_window=128))  # fmt: skip
    rng = np.random.default_rng(1)
    t = 128 if SMALL else 512
    ids = jnp.asarray(rng.integers(0, 512, (4, t + 1)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (4, t))
    seg = jnp.asarray(np.repeat([[1] * 50 + [2] * (t - 50)], 4, axis=0), jnp.int32)
    mesh = build_mesh(MeshConfig(), jax.devices()[:1])
    out = {}
    for name in ("xla-dense", "splash-dense", "splash-sparse"):
        impl, dispatch = name.split("-")
        cfg = ModelConfig(**base, attention=impl, moe_dispatch=dispatch, compute_dtype="float32")
        parts = build_model(cfg, 0, mesh)

        def loss(params, parts=parts):
            model = nnx.merge(parts.graphdef, params, *parts.others)
            logits = model(ids[:, :-1], pos, seg)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

        step = jax.jit(on_mesh(jax.value_and_grad(loss), mesh))
        value, grads = step(parts.params)
        out[name] = (float(value), flat_params(grads), step.lower(parts.params).as_text())
    ref_loss, ref_grads, _ = out["xla-dense"]
    row: dict = {"check": "model", "loss": ref_loss}
    for name in ("splash-dense", "splash-sparse"):
        loss_, grads, hlo = out[name]
        row[name] = {
            "loss_rel": abs(loss_ - ref_loss) / abs(ref_loss),
            "grad_rel_max": max(rel(grads[p], ref_grads[p]) for p in ref_grads),
            "custom_calls": hlo.count("tpu_custom_call"),
        }
    return row


def timing_case(window: int | None, impl: str, sinks_on: bool) -> dict:
    """Forward + backward of one attention layer, bf16, 2 rows of 2,048 tokens, 64 heads of 64
    (gpt-oss's), 8 KV heads; median of 10 after a warm-up."""
    rng = np.random.default_rng(2)
    b, t, h, kvh, d = 2, 2048, 64, 8, 64
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.bfloat16) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32) if sinks_on else None

    def loss(q, k, v):
        out = attention.attend(q, k, v, None, impl=impl, window=window, sinks=sinks)
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(fn(q, k, v))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - start)
    return {"check": "time", "impl": impl, "window": window, "sinks": sinks_on,
            "ms": round(1e3 * float(np.median(times)), 3)}  # fmt: skip


def main() -> None:
    emit({"check": "devices", "devices": [str(d) for d in jax.devices()]})
    # "highest" for fp32 only: Mosaic refuses an fp32-precision matmul of bf16 operands.
    for dtype in (jnp.float32, jnp.bfloat16):
        with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
            for window in (None, 128):
                for sinks_on in (True, False):
                    emit(attention_case(128 if SMALL else 1024, window, dtype, sinks_on))
    with jax.default_matmul_precision("highest"):
        emit(model_case())
    for window in () if SMALL else (None, 128):
        for impl in ("splash", "xla"):
            emit(timing_case(window, impl, True))
        emit(timing_case(window, "splash", False))


if __name__ == "__main__":
    main()
