"""How long an async checkpoint of a run's train state holds the train loop, and why: the copy
off the chip against the whole `CheckpointService.save`.

    python3 bench/tpu/ckpt_block.py [CONFIG] [--dir /tmp/ckpt-bench] [--repeats 2]

The state is the run's parameters and AdamW moments with their shapes, dtypes and shardings
(made anew for every measurement: JAX keeps an array's host copy once made). Prints one JSON row
per measurement:

  d2h               every array's `copy_to_host_async`, then `np.asarray` of each (what Orbax
                    does on TPU: its `enable_pinned_host_transfer`, copying through `pinned_host`
                    memory, is off there, and measured 7.2-8.6 s for Qwen3-0.6B's 6.66 GiB state
                    on the v5e chip against 4.7 s this way)
  save              `CheckpointService.save` of the state (`blocked_s`: until it returned, the
                    time the train loop stands still), then until the background write ended
                    (`written_s`)

Run it under different malloc settings (GLIBC_TUNABLES, MALLOC_*) to see what the host side of
the copy costs: each copy writes the state into newly allocated host memory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from runtime.host import platform  # noqa: E402

platform.choose()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jobspec.files.run_toml import load_run_config  # noqa: E402
from runfolder.store import ArtifactStore  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402
from runtime.run.checkpoint.service import CheckpointService  # noqa: E402
from runtime.run.meta import CheckpointMeta  # noqa: E402
from runtime.train.program import abstract_program  # noqa: E402


def state_maker(cfg):
    """A function that makes a new train state of zeros, placed as the run places it."""
    state = abstract_program(cfg, build_mesh(cfg.mesh)).state  # what `runtime local` saves
    abstract = {"params": state.params, "opt_state": state.opt_state}
    flat, tree = jax.tree.flatten(abstract)
    make = jax.jit(
        lambda: [jnp.zeros(a.shape, a.dtype) for a in flat],
        out_shardings=[a.sharding for a in flat],
    )
    return lambda: jax.tree.unflatten(tree, jax.block_until_ready(make()))


def gib(tree) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**30


def d2h(state) -> dict:
    leaves = jax.tree.leaves(state)
    t = time.perf_counter()
    for x in leaves:
        x.copy_to_host_async()
    host = [np.asarray(x) for x in leaves]
    return {"seconds": round(time.perf_counter() - t, 3), "host_gib": gib(host)}


def save(state, directory: str, step: int) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    store = ArtifactStore(directory)
    ckpt = CheckpointService(store, keep=1, async_save=True)
    meta = CheckpointMeta(step=step, tokens=0, rng=[0, 0], decay_steps=1, config={})
    t = time.perf_counter()
    ckpt.save(step, params=state["params"], opt_state=state["opt_state"], meta=meta)
    blocked = time.perf_counter() - t
    ckpt.wait()
    written = time.perf_counter() - t
    ckpt.close()
    shutil.rmtree(directory, ignore_errors=True)
    return {"blocked_s": round(blocked, 3), "written_s": round(written, 3)}


def main() -> None:
    args = sys.argv[1:]
    directory = args[args.index("--dir") + 1] if "--dir" in args else "/tmp/ckpt-bench"
    repeats = int(args[args.index("--repeats") + 1]) if "--repeats" in args else 2
    path = next((a for a in args if a.endswith(".toml")), "bench/tpu/qwen3-0.6b-v5e.toml")
    cfg, _ = load_run_config(path, {})
    make = state_maker(cfg)
    base = {"device": jax.devices()[0].device_kind}
    env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    for i in range(repeats):
        state = make()
        row = d2h(state)
        print(json.dumps({"what": "d2h", "repeat": i, **base, "env": env, **row}), flush=True)
        del state
    for i in range(repeats):
        state = make()
        row = save(state, directory, step=i + 1)
        print(json.dumps({"what": "save", "repeat": i, **base, "env": env, **row}), flush=True)
        del state


if __name__ == "__main__":
    main()
