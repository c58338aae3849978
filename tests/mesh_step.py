"""One train step of a tiny model on several meshes, in a child process with CPU devices:
its loss and parameter update on each mesh against the first mesh of the same name (one SGD
step of lr 1, so the update is the gradient). A batch of 8 rows of 16 tokens, two documents
a row, the loss in chunks of 6 positions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from runs import ROOT, xla_flags

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from jobspec.files.run_toml import parse_run_config
    from runtime.hf.convert import flat_params
    from runtime.model.build import build_model
    from runtime.model.sharding import build_mesh
    from runtime.train.program import train_program
    from runtime.train.state import new_state, state_shardings

    ids = np.random.default_rng(0).integers(0, 128, (1, 8, 17))
    first = np.arange(16) < 7  # two documents a row: 7 tokens, then 9
    batch = dict(
        inputs=ids[..., :-1].astype(np.int32), targets=ids[..., 1:].astype(np.int32),
        loss_mask=np.ones((1, 8, 16), np.float32),
        segment_ids=np.broadcast_to(np.where(first, 1, 2), (1, 8, 16)).astype(np.int32),
        positions=np.broadcast_to(np.where(first, np.arange(16), np.arange(16) - 7),
                                  (1, 8, 16)).astype(np.int32),
    )
    refs, out = {}, []
    for name, model, mesh in json.loads(sys.argv[1]):
        cfg = parse_run_config(dict(
            run=dict(id="t", output_uri="/tmp/unused"), model=model, mesh=mesh,
            data=dict(manifest="/tmp/unused/manifest.json"),
            training=dict(seq_len=16, global_batch_size=8, target_tokens=16 * 8 * 4,
                          loss_chunk_size=6)))
        devices = build_mesh(cfg.mesh, jax.devices()[: cfg.mesh.size])
        parts = build_model(cfg.model, 0, devices)
        before = {k: np.asarray(v) for k, v in flat_params(parts.params).items()}
        tx = optax.sgd(1.0)
        shardings = state_shardings(parts, tx, devices)
        step = train_program(cfg, parts, tx, optax.constant_schedule(1.0), shardings, devices)
        state, metrics = step(new_state(parts, tx, shardings, 0), batch)
        grads = {k: before[k] - np.asarray(v) for k, v in flat_params(state.params).items()}
        ref = refs.setdefault(name, (float(metrics["loss"]), grads))
        out.append(dict(name=name, mesh=mesh, loss=float(metrics["loss"]), ref_loss=ref[0],
                        grad_err=max(float(np.max(np.abs(g - ref[1][k]))) for k, g in grads.items()),
                        grad_max=max(float(np.max(np.abs(g))) for g in grads.values())))
    print(json.dumps(out))
    """
)


def same_step_on_meshes(cases: list, devices: int = 4) -> list[dict]:
    """cases: (name, [model] table, [mesh] table). Each result: name, mesh, loss, ref_loss
    (the first case of that name's), grad_err (max abs difference of the update), grad_max."""
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results
