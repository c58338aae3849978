"""Tokens/s of the runtime's train step versus a minimal hand-written jitted NNX + optax step.

Same model, batch, dtypes and optimizer, in the same process, alternating timed blocks so drift
hits both equally. The baseline is the leanest functional step one would write by hand: mean
loss, value_and_grad, optax update, donated buffers, no accumulation scan and no extra metrics.
Both get the same device-resident batch, so this isolates the step itself. Prints JSON.

    python bench/step_overhead.py [--config configs/smoke.toml] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jobspec.files.run_toml import load_run_config
from runtime.model.build import build_model
from runtime.model.sharding import batch_sharding, build_mesh, replicated
from runtime.train.loss import cross_entropy_sums
from runtime.train.optim import build_optimizer
from runtime.train.program import train_program
from runtime.train.state import new_state, opt_state_shardings, state_shardings


def random_batch(cfg, accum: int, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    t, v = cfg.training.seq_len, cfg.model.vocab_size
    tokens = rng.integers(0, min(v, 256), size=(accum, rows, t + 1), dtype=np.int32)
    return {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "loss_mask": np.ones((accum, rows, t), np.float32),
        "segment_ids": np.ones((accum, rows, t), np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (accum, rows, t)).copy(),
    }


def time_steps(fn, state, batch, steps: int):
    state, out = fn(state, batch)  # one untimed step: the compiled program is warm
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = fn(state, batch)
    jax.block_until_ready((state, out))
    return state, time.perf_counter() - t0


def runtime_step(cfg):
    """(jitted step, state, device batch) built exactly as runtime/train/loop.py builds them."""
    t = cfg.training
    mesh = build_mesh(cfg.mesh)
    b_sh = batch_sharding(mesh, 3, leading=1)
    accum = t.gradient_accumulation_steps  # one optimizer step's microbatches, as the loop's
    host = random_batch(cfg, accum, t.global_batch_size, np.random.default_rng(0))
    shape = (accum, t.global_batch_size, t.seq_len)
    batch = {k: jax.make_array_from_process_local_data(b_sh, v, shape) for k, v in host.items()}
    tx, schedule = build_optimizer(cfg.optimizer, t.total_steps)
    parts = build_model(cfg.model, cfg.run.seed, mesh)
    state_sh = state_shardings(parts, tx, mesh)
    state = new_state(parts, tx, state_sh, cfg.run.seed)  # as the train loop
    fn = train_program(cfg, parts, tx, schedule, state_sh, mesh)
    return fn, state, batch, parts, tx


def baseline_step(cfg, parts, tx):
    """(jitted step, carry): the hand-written baseline on its own copy of `parts.params`.

    Takes the same device batch as runtime_step's. Call it before the runtime step first runs:
    that step donates `parts.params`, so they cannot be copied afterwards. The carry is placed
    as the step returns it (params and optimizer state on their shardings), so the first call
    compiles the only program: an uncommitted carry would compile a second one on call two.
    """
    mesh = build_mesh(cfg.mesh)
    graphdef, others = parts.graphdef, parts.others
    p_sh = parts.param_shardings
    o_sh = opt_state_shardings(tx, parts.params, p_sh, mesh)
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=p_sh)(parts.params)

    def step(carry, b):
        params, opt_state = carry

        def loss_fn(p):
            model = nnx.merge(graphdef, p, *others)
            logits = model(b["inputs"][0], b["positions"][0], b["segment_ids"][0])
            s, c = cross_entropy_sums(logits, b["targets"][0], b["loss_mask"][0])
            return s / c

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    fn = jax.jit(step, out_shardings=((p_sh, o_sh), replicated(mesh)), donate_argnums=0)
    return fn, (params, jax.jit(tx.init, out_shardings=o_sh)(params))


def measure_step(cfg, steps: int) -> float:
    """Steady-state tokens/s of the runtime's train step for `cfg`."""
    fn, state, batch, _, _ = runtime_step(cfg)
    _, dt = time_steps(fn, state, batch, steps)
    return steps * cfg.training.global_batch_size * cfg.training.seq_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smoke.toml")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating blocks per side")
    args = ap.parse_args()

    cfg, _ = load_run_config(args.config)
    t = cfg.training
    ours_fn, ours, batch, parts, tx = runtime_step(cfg)

    # The hand-written baseline on its own copy of the same parameters.
    base_fn, base = baseline_step(cfg, parts, tx)

    ours_time = base_time = 0.0
    for r in range(args.rounds):
        # Alternate which side goes first, so neither always runs on a warmer (or hotter) machine.
        for side in ("ours", "base") if r % 2 == 0 else ("base", "ours"):
            if side == "ours":
                ours, dt = time_steps(ours_fn, ours, batch, args.steps)
                ours_time += dt
            else:
                base, dt = time_steps(base_fn, base, batch, args.steps)
                base_time += dt
    tokens = args.rounds * args.steps * t.global_batch_size * t.seq_len
    result = {
        "benchmark": "step_overhead",
        "config": args.config,
        "device": jax.devices()[0].device_kind,
        "tokens_per_step": t.global_batch_size * t.seq_len,
        "steps_timed_each": args.rounds * args.steps,
        "runtime_tokens_per_s": tokens / ours_time,
        "baseline_tokens_per_s": tokens / base_time,
        "ratio": (tokens / ours_time) / (tokens / base_time),
        "goal": ">= 0.97",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
