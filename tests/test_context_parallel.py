"""Context parallelism (`mesh.context`): one sequence split over several devices gives the same
train step as one device, for attention, MoE and Gated DeltaNet layers; the settings it cannot
take are refused in one sentence; `runtime plan` compiles it for a TPU slice. The multi-host
proof (a context axis across processes) and resume onto another `mesh.context` are in
tests/test_multihost.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from mesh_step import same_step_on_meshes

from jobspec.files.run_toml import parse_run_config

from runs import ROOT, user_env, xla_flags

_TINY = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=64)  # fmt: skip
#: The sparse dispatch: its token rows split over context too (runtime/model/moe/dispatch.py).
_MOE = {**_TINY, "family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_dispatch": "sparse"}  # fmt: skip
#: A Gated DeltaNet layer and a gated attention layer, the recurrence in chunks of 4 across the
#: shards.
_NEXT = {**_TINY, "family": "qwen3_next", "hidden_size": 32, "head_dim": 8,
         "intermediate_size": 48, "qwen3_next": {
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
             "linear_value_head_dim": 8, "chunk_size": 4, "full_attention_interval": 2}}  # fmt: skip
#: Per family: one device, the sequence over 4 devices, and split over 2 beside another axis.
_CASES = [
    # (qwen3 on fsdp 2 x context 2 runs as 4 processes in tests/test_multihost.py.)
    *(("qwen3", {**_TINY, "family": "qwen3"}, m) for m in ({}, {"context": 4})),
    *(("qwen3_moe", _MOE, m) for m in ({}, {"context": 4}, {"expert": 2, "context": 2})),
    *(("qwen3_next", _NEXT, m) for m in ({}, {"context": 4}, {"fsdp": 2, "context": 2})),
]


@pytest.mark.slow
def test_one_train_step_is_the_same_with_the_sequence_split():
    # 16 tokens a row over 2 or 4 devices: each holds 8 or 4 (two chunks of the balanced layout,
    # 4 or 2 tokens each), two documents a row, the loss in chunks that take positions from
    # every device's part.
    results = same_step_on_meshes(_CASES)
    for res in results:
        where = f"{res['name']} on {res['mesh']}"
        assert res["grad_max"] > 1e-3, where
        assert abs(res["loss"] - res["ref_loss"]) < 1e-5, where
        assert res["grad_err"] < 1e-5, where


def _run_config(**over) -> dict:
    base = {"run": {"id": "t", "output_uri": "/tmp/unused"}, "model": dict(_TINY),
            "data": {"manifest": "/tmp/unused/manifest.json"},
            "training": {"seq_len": 16, "global_batch_size": 8, "target_tokens": 1024}}  # fmt: skip
    for section, keys in over.items():
        base[section] = {**base.get(section, {}), **keys}
    return base


@pytest.mark.parametrize(
    "over, message",
    [
        ({"mesh": {"context": 3}}, "training.seq_len (16) must be a multiple of mesh.context (3)"),
    ],
)  # fmt: skip
def test_settings_context_cannot_take_are_one_sentence(over, message):
    with pytest.raises(Exception) as err:
        parse_run_config(_run_config(**over))
    assert message in str(err.value)


def test_the_mesh_product_names_the_context_axis():
    cfg = parse_run_config(_run_config(mesh={"context": 2}))
    assert cfg.mesh.size == 2 and cfg.mesh.batch_shards == 1
    assert (
        cfg.mesh.product()
        == "mesh.slices x mesh.data x mesh.expert x mesh.fsdp x mesh.context x mesh.tensor = 1 x 1 x 1 x 1 x 2 x 1 = 2"
    )


@pytest.mark.slow
def test_plan_of_context_parallelism_on_a_tpu_slice():
    # Deviceless: 4 v5p chips, each sequence of 512 over 2 of them (in 4 chunks of 128, two a
    # chip), fsdp over the other 2: splash kernels with each chunk's causal offset, keys and
    # values gathered.
    res = subprocess.run(
        [sys.executable, "-m", "runtime", "plan", "configs/tiny_plan.toml", "--accelerator",
         "tpu-v5p-8", "--set", "mesh.context=2", "--set", "mesh.fsdp=2", "--set",
         "training.seq_len=512", "--set", "training.global_batch_size=2", "--set",
         "model.num_layers=1", "--json"],
        cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout)
    assert rep["mesh"]["context"] == 2
    assert rep["flops"]["uncounted_custom_calls"].get("tpu_custom_call", 0) > 0, rep["flops"]
    assert rep["collectives"]["by_kind"]["all-gather"]["count"] > 0, rep["collectives"]


_SPLASH = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jobspec.run_config import MeshConfig
    from runtime.model.attention import context_parallel
    from runtime.model.attention import kernels as attention
    from runtime.model.sharding import build_mesh, on_mesh

    attention.BLOCKWISE_FROM = 512

    def rel(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

    out = []
    for mesh_keys, t, window, sinks_on, seg_on, impl in json.loads(sys.argv[1]):
        rng = np.random.default_rng(0)
        q = rng.normal(size=(2, t, 4, 32)).astype(np.float32)
        k, v = (rng.normal(size=(2, t, 2, 32)).astype(np.float32) for _ in range(2))
        w = rng.normal(size=q.shape).astype(np.float32)
        cut = t // 3 + 5
        seg = np.asarray([[1] * t, [1] * cut + [2] * (t - cut)], np.int32) if seg_on else None
        sinks = (rng.normal(size=(4,)) * 2).astype(np.float32) if sinks_on else None
        argnums = (0, 1, 2, 3) if sinks_on else (0, 1, 2)

        def ref(q, k, v, s):  # one device, the original order, the einsum path
            return jnp.sum(attention.attend(q, k, v, seg, impl="xla", window=window, sinks=s) * w)

        def split(q, k, v, s):  # the sequence over mesh.context, in the balanced layout
            batch = {"inputs": q[..., 0, 0], "q": q, "k": k, "v": v, "w": w, "seg": seg}
            with context_parallel.balanced({k_: x for k_, x in batch.items() if x is not None}) as b:
                o = attention.attend(b["q"], b["k"], b["v"], b.get("seg"), impl=impl,
                                     window=window, sinks=s)
                return jnp.sum(o * b["w"])

        cfg = MeshConfig(**mesh_keys)
        mesh = build_mesh(cfg, jax.devices()[: cfg.size])
        with jax.default_matmul_precision("highest"):
            want = jax.jit(jax.value_and_grad(ref, argnums=argnums))(q, k, v, sinks)
            got = jax.jit(on_mesh(jax.value_and_grad(split, argnums=argnums), mesh))(q, k, v, sinks)
        out.append({"mesh": mesh_keys, "impl": impl, "value": rel(got[0], want[0]),
                    "grads": [rel(a, b) for a, b in zip(got[1], want[1])]})
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_attention_with_the_sequence_split_matches_one_device():
    # splash in Pallas interpret mode on CPU: the kernels' chunks (128 tokens, two per device)
    # at their causal offsets, with a window, sinks, packed documents and heads over tensor;
    # xla with the keys a block at a time (attention/blockwise.py, as on GPUs; from 512 tokens
    # here instead of BLOCKWISE_FROM, to keep the test small).
    # cudnn through jax's XLA form of the same calls: one per chunk, the offset as a mask.
    cases = [({"context": 2, "tensor": 2}, 512, 128, True, True, "splash"),
             ({"context": 4}, 1024, None, True, True, "xla"),
             ({"context": 4}, 64, 9, False, True, "cudnn")]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _SPLASH, json.dumps(cases)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for res in json.loads(r.stdout.strip().splitlines()[-1]):
        assert res["value"] < 1e-5 and max(res["grads"]) < 1e-5, res


def test_blockwise_attention_is_the_einsum_path():
    # What the einsum path runs under mesh.context from BLOCKWISE_FROM tokens: the keys 64 at
    # a time, its own backward pass from the log-sum-exp; values and gradients (sinks too).
    import jax
    import jax.numpy as jnp
    import numpy as np

    from runtime.model.attention import kernels as attention
    from runtime.model.attention.blockwise import blockwise_attention

    rng = np.random.default_rng(0)
    q, w = (jnp.asarray(rng.normal(size=(2, 256, 4, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(2, 256, 2, 16)), jnp.float32) for _ in range(2))
    seg = jnp.asarray([[1] * 256, [1] * 100 + [2] * 156], jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    idx = jnp.arange(256)

    def ref(q, k, v, s):
        return jnp.sum(attention.xla_attention(q, k, v, seg, None, 64, s) * w)

    def got(q, k, v, s):
        return jnp.sum(blockwise_attention(q, k, v, idx, None, seg, seg, 0.25, 64, s, 64) * w)

    with jax.default_matmul_precision("highest"):
        want = jax.value_and_grad(ref, argnums=(0, 1, 2, 3))(q, k, v, sinks)
        have = jax.value_and_grad(got, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    assert abs(float(have[0] - want[0])) <= 1e-5 * abs(float(want[0]))
    for a, b in zip(have[1], want[1], strict=True):
        assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 1e-5
