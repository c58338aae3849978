"""Expert parallelism: the sparse MoE dispatch against a per-token reference on every mesh layout
(values, gradients, exact capacity drops), training with mesh.expert = 1, 2, 4 on 4 CPU devices
and across 2 processes (same losses and loads), resharding a checkpoint onto another expert
layout, the dropped-token metric, and bad meshes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from multihost import run_hosts

from jobspec.families.model_config import ModelConfig

from runs import ROOT, batch_of, read_jsonl, run_cli, tiny_config, write_config, xla_flags

# One subprocess with 4 CPU devices checks the dispatch on several meshes against a dense
# per-token reference: y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t]); routing is skewed so that
# expert 0 is in almost every token's top-2 (one shard receives far more rows than the others).
_DISPATCH = textwrap.dedent(
    """
    import json, math
    import jax, jax.numpy as jnp, numpy as np
    from jobspec.run_config import MeshConfig
    from runtime.model.moe import dispatch as md
    from runtime.model.sharding import activation_mesh, build_mesh

    rng = np.random.default_rng(0)
    B, T, D, F, E, K = 4, 8, 16, 12, 8, 2
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    logits = rng.normal(size=(B, T, E))
    logits[..., 0] += 3.0
    idx_np = np.argsort(-logits, -1)[..., :K]
    idx = jnp.asarray(idx_np, jnp.int32)
    w = jnp.asarray(rng.random((B, T, K)), jnp.float32)
    g, u = (jnp.asarray(rng.normal(size=(E, D, F)) * 0.3, jnp.float32) for _ in range(2))
    dn = jnp.asarray(rng.normal(size=(E, F, D)) * 0.3, jnp.float32)

    def reference(x, g, u, dn, keep):
        h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, g)) * jnp.einsum("btd,edf->btef", x, u)
        y = jnp.einsum("btef,efd->bted", h, dn)
        picked = jnp.take_along_axis(y, idx[..., None], axis=2)
        return jnp.sum(picked * (w * keep)[..., None], axis=2)

    def kept(cf, shards):
        # First come first served per device share, per expert: the documented capacity rule.
        tok = idx_np.reshape(-1, K)
        n = tok.shape[0] // shards
        cap = max(1, math.ceil(cf * n * K / E))
        keep, dropped = np.zeros(tok.shape, bool), 0
        for s in range(shards):
            seen = np.zeros(E, int)
            for i in range(s * n, (s + 1) * n):
                for j in range(K):
                    if seen[tok[i, j]] < cap:
                        keep[i, j] = True
                        seen[tok[i, j]] += 1
                    else:
                        dropped += 1
        return keep.reshape(B, T, K).astype(np.float32), dropped

    # (expert, fsdp, tensor) or None for no mesh; capacity factor; grouped matmul. The TPU
    # kernel (megablox) runs in Pallas' interpreter here; einsum_slots is the GPU capacity path.
    cases = [(m, cf, "ragged_dot") for m in [None, (1, 4, 1), (2, 2, 1), (4, 1, 1), (2, 1, 2),
                                            (1, 2, 2)] for cf in (None, 0.5, 1.0)]
    cases += [((2, 2, 1), None, "megablox"), ((1, 4, 1), 0.5, "megablox"),
              ((2, 2, 1), 0.5, "einsum_slots"), (None, 1.0, "einsum_slots"),
              ((4, 1, 1), 1.0, "einsum_slots")]
    out = []
    for layout, cf, matmul in cases:
        ep, fsdp, tp = layout or (1, 1, 1)
        mesh = None if layout is None else build_mesh(MeshConfig(expert=ep, fsdp=fsdp, tensor=tp))
        keep, expected = kept(cf, ep * fsdp) if cf else (np.ones((B, T, K), np.float32), 0)
        disp = md.Dispatch("capacity" if cf else "dropless",
                           "all_to_all" if ep > 1 else "none", matmul, ep, cf)

        def run(x, g, u, dn):
            with activation_mesh(mesh):
                return md.sparse_experts(
                    x, idx, w, g, u, dn, activation=jax.nn.silu, dispatch=disp
                )

        def run_and_grads(*a):
            # The forward alone (the primal of the custom VJPs) and the gradients: one compile.
            return run(*a), jax.grad(lambda *b: jnp.sum(jnp.sin(run(*b)[0])), (0, 1, 2, 3))(*a)

        (y, dropped), grads = jax.jit(run_and_grads)(x, g, u, dn)
        ref = reference(x, g, u, dn, keep)
        ref_grads = jax.grad(
            lambda *a: jnp.sum(jnp.sin(reference(*a, keep))), (0, 1, 2, 3)
        )(x, g, u, dn)
        out.append({
            "mesh": layout, "cf": cf, "exchange": disp.exchange, "matmul": matmul,
            "y_err": float(jnp.max(jnp.abs(y - ref))),
            "grad_err": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, ref_grads)),
            "dropped": int(dropped), "expected_dropped": expected,
        })

    # The exchange alone: every row sent comes back to its own position, in order.
    mesh = build_mesh(MeshConfig(expert=4))
    def round_trip(rows, sizes):
        go = md._exchange(rows.shape[0], 4 * 6, 6, "expert", False)
        back = md.send_back(rows.shape[0], 4 * 6, 6, "expert", False)
        return back(go(rows, sizes), sizes)
    sizes = jnp.asarray([[1, 2, 0, 3], [0, 0, 6, 0], [2, 2, 1, 1], [0, 1, 0, 0]], jnp.int32)
    rows = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4 * 6, 1) + 1.0
    spec = jax.sharding.PartitionSpec("expert", None)
    same = jax.jit(jax.shard_map(
        round_trip, mesh=mesh, in_specs=(spec, jax.sharding.PartitionSpec()), out_specs=spec
    ))(rows, sizes)
    sent = np.concatenate([np.arange(6) < s for s in np.asarray(sizes).sum(1)])
    print(json.dumps({"cases": out, "round_trip": np.asarray(same)[:, 0].tolist(),
                      "expected_round_trip": np.where(sent, np.asarray(rows)[:, 0], 0).tolist()}))
    """
)


def _four_devices(script: str) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(4),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sparse_dispatch_matches_the_per_token_reference_on_every_mesh() -> None:
    result = _four_devices(_DISPATCH)
    cases = result["cases"]
    assert {c["exchange"] for c in cases} == {"none", "all_to_all"}
    for c in cases:
        where = f"(expert, fsdp, tensor) = {c['mesh']}, capacity {c['cf']}, {c['matmul']}"
        assert c["y_err"] < 1e-5, where
        assert c["grad_err"] < 1e-4, where
        assert c["dropped"] == c["expected_dropped"], where
    assert any(c["dropped"] > 0 for c in cases)  # the capacity really drops under this skew
    assert result["round_trip"] == result["expected_round_trip"]


# --- training -------------------------------------------------------------------------------

STEPS = 4
MOE = {"family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16, "router_bias_update_rate": 0.01}  # fmt: skip


def _skewed_hf_model(out: Path) -> Path:
    """A tiny Qwen3-MoE in HF format whose routers send nearly every token to expert 0: every
    embedding row gets a shared offset, and each layer's expert-0 router column reads it."""
    from runtime.model.hf_weights import write_hf
    from runtime.model.registry import build_model_module

    cfg = ModelConfig(
        vocab_size=260, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=True,
        scan_layers=True, **{k: v for k, v in MOE.items() if k != "router_bias_update_rate"},
    )  # fmt: skip
    model = build_model_module(cfg, rngs=nnx.Rngs(0))
    d = cfg.hidden_size
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] + cfg.init_std
    kernel = model.layers.mlp.gate.kernel[...]  # [L, D, E]
    model.layers.mlp.gate.kernel[...] = kernel.at[:, :, 0].add(4.0 / d)
    write_hf(cfg, nnx.state(model, nnx.Param), out)
    return out


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, prepared) -> dict[str, Path]:
    """The same job on several expert layouts; each run under runs/<layout>/ep."""
    tmp = tmp_path_factory.mktemp("ep")
    hf = _skewed_hf_model(tmp / "hf")
    layouts = {  # name: (processes, devices per process, mesh, extra args)
        "e1": (1, 4, {"fsdp": 4}),
        "e2": (1, 4, {"expert": 2, "fsdp": 2}),
        "e4": (1, 4, {"expert": 4}),
        "p2-e2": (2, 2, {"expert": 2, "fsdp": 2}),
    }
    out = {}
    for name, (procs, devices, mesh) in layouts.items():
        path = _ep_config(tmp, prepared, hf, name, mesh)
        _worker(path, procs, devices)
        out[name] = tmp / name / "ep"
    out["hf"] = hf
    out["tmp"] = tmp
    return out


def _ep_config(tmp: Path, prepared: str, hf: Path, layout: str, mesh: dict, **over) -> Path:
    from jobspec.files.run_toml import merge

    cfg = tiny_config(
        prepared, str(tmp / layout), run_id="ep",
        **merge({"model": {**MOE, "init_from": f"hf:{hf}"}, "mesh": mesh,
                 "training": {"target_tokens": 16 * 8 * STEPS},
                 "checkpoint": {"every": 2, "async": False},
                 "runtime": {"host_loss_timeout_s": 30, "boot_timeout_s": 60}}, over),
    )  # fmt: skip
    return write_config(tmp / f"{layout}.toml", cfg)


def _worker(cfg: Path, procs: int, devices: int, *args: str, attempt: int = 0) -> None:
    env = {
        "JAXJOB_RUN_ID": "ep",
        "JAXJOB_ATTEMPT": str(attempt),
        "XLA_FLAGS": xla_flags(devices),
    }
    if procs == 1:
        env.update({"JAXJOB_COORDINATOR": "", "JAXJOB_NUM_PROCESSES": "", "JAXJOB_PROCESS_ID": ""})
    results = run_hosts(["worker", str(cfg), *args], procs, devices, env=env, timeout=400)
    for r in results:
        assert r.returncode == 0, f"host {r.process_id} exited {r.returncode}\n{r.output[-4000:]}"


def _rows(run: Path) -> list[dict]:
    return read_jsonl(run / "metrics/train.jsonl")


def test_expert_layouts_give_the_same_losses_and_loads(ep_runs) -> None:
    base = _rows(ep_runs["e1"])
    assert [r["step"] for r in base] == list(range(1, STEPS + 1))
    # The routing is skewed: expert 0 takes (nearly) every token's first choice.
    assert base[0]["expert_load_max_over_mean"] > 3.0
    for name in ("e2", "e4", "p2-e2"):
        rows = _rows(ep_runs[name])
        assert [r["batch_hash"] for r in rows] == [r["batch_hash"] for r in base], name
        for a, b in zip(rows, base, strict=True):
            where = (name, a["step"])
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), where
            assert a["expert_load_max_over_mean"] == pytest.approx(
                b["expert_load_max_over_mean"], rel=1e-5
            ), where
            assert "moe_dropped_tokens" not in a  # dropless: nothing to count


def test_runtime_json_says_which_dispatch_ran(ep_runs) -> None:
    def dispatch(name: str) -> dict:
        return json.loads((ep_runs[name] / "diagnostics/runtime.json").read_text())["moe_dispatch"]

    # CPU with one expert shard: auto keeps the dense dispatch; with shards, the exact fallback.
    assert dispatch("e1")["kind"] == "dense"
    for name, shards in (("e2", 2), ("e4", 4), ("p2-e2", 2)):
        d = dispatch(name)
        assert d == {"kind": "dropless", "exchange": "all_to_all", "matmul": "ragged_dot",
                     "expert_shards": shards, "capacity_factor": None}, name  # fmt: skip


def test_a_checkpoint_resumes_on_another_expert_layout_with_reshard(ep_runs, prepared) -> None:
    tmp = ep_runs["tmp"]
    shutil.copytree(tmp / "e1", tmp / "moved")
    rolled = run_cli("checkpoints", "rollback", str(tmp / "moved" / "ep"), "--to-step", "2")
    assert rolled.returncode == 0, rolled.stderr
    cfg = _ep_config(tmp, prepared, ep_runs["hf"], "moved", {"expert": 4})
    refused = run_cli("worker", str(cfg), env={"JAXJOB_RUN_ID": "ep", "JAXJOB_ATTEMPT": "1",
                      "XLA_FLAGS": xla_flags(4)})  # fmt: skip
    assert refused.returncode == 2 and "mesh.expert" in refused.stderr, refused.stderr
    _worker(cfg, 1, 4, "--reshard", attempt=1)
    base = [r["loss"] for r in _rows(ep_runs["e1"])]
    moved = [r["loss"] for r in _rows(tmp / "moved" / "ep")]
    assert len(moved) == STEPS
    assert moved[:2] == base[:2]
    assert moved[2:] == pytest.approx(base[2:], rel=1e-5)


def test_hf_export_is_the_same_on_every_expert_layout(ep_runs) -> None:
    """The expert sharding changes neither the checkpoint's names nor its values."""
    from safetensors.numpy import load_file

    exports = {}
    for name in ("e1", "e4"):
        out = ep_runs["tmp"] / f"export-{name}"
        r = run_cli("export", "hf", str(ep_runs[name]), "--out", str(out))
        assert r.returncode == 0, r.stderr
        exports[name] = load_file(str(out / "model.safetensors"))
    a, b = exports["e1"], exports["e4"]
    assert a.keys() == b.keys() and "model.layers.0.mlp.experts.7.down_proj.weight" in a
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


# --- the dropped-token metric ---------------------------------------------------------------


def test_capacity_factor_counts_the_dropped_assignments_in_the_train_step() -> None:
    from runtime.model.moe.layer import route
    from runtime.model.registry import build_model_module
    from runtime.train.state import TrainState
    from runtime.train.step import make_train_step

    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
        intermediate_size=64, max_position_embeddings=64, scan_layers=False,
        moe_capacity_factor=1.0, **{k: v for k, v in MOE.items() if k != "router_bias_update_rate"},
    )  # fmt: skip
    model = build_model_module(cfg, rngs=nnx.Rngs(0))
    model.layers[0].mlp.router_bias[...] = jnp.zeros((8,)).at[0].set(5.0)  # expert 0: every token
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, 4, 17))
    batch = batch_of(ids)
    # The expected count, from the routing itself: 64 tokens x top-2 over 8 experts, capacity
    # ceil(1.0 x 64 x 2 / 8) = 16 per expert; an expert chosen c times drops max(c - 16, 0).
    layer = model.layers[0]
    h = model.embed_tokens(batch["inputs"][0])
    h = (
        h
        + layer.self_attn(
            layer.input_layernorm(h), *model._rope(batch["positions"][0]), batch["segment_ids"][0]
        )[0]
    )
    _, onehot = route(layer.mlp.gate(layer.post_attention_layernorm(h)),
                      layer.mlp.router_bias[...], 2, True)  # fmt: skip
    chosen = np.asarray(jnp.sum(onehot, axis=(0, 1, 2)))
    expected = int(np.sum(np.maximum(chosen - math.ceil(64 * 2 / 8), 0)))
    assert expected > 0

    graphdef, params, others = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.0)
    state = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                       rng=jax.random.PRNGKey(0), model_state=(others,))  # fmt: skip
    step = make_train_step(graphdef, tx, optax.constant_schedule(0.0), count_dropped=True)
    _, metrics = jax.jit(step)(state, batch)
    assert int(metrics["moe_dropped_tokens"]) == expected


# --- bad meshes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "mesh", "says"),
    [
        ({**MOE, "num_experts": 6}, {"expert": 4}, "mesh.expert (4) must divide the 6 routed"),
        ({}, {"expert": 2}, "mesh.expert = 2 shards MoE experts, but this model has no MoE"),
        ({**MOE, "moe_dispatch": "dense"}, {"expert": 2}, "model.moe_dispatch = 'dense'"),
        ({"moe_capacity_factor": 1.25}, {}, "model.moe_capacity_factor needs a model with MoE"),
        (MOE, {"expert": 3}, "training.global_batch_size (8) must be a multiple of"),
    ],
)
def test_a_bad_expert_mesh_is_one_sentence(tmp_path, prepared, capsys, model, mesh, says) -> None:
    from runtime.commands.cli import main

    cfg = write_config(
        tmp_path / "bad.toml",
        tiny_config(prepared, str(tmp_path / "runs"), model=model, mesh=mesh),
    )
    # The CLI's own entry point, in this process: the check reads the config, starts no JAX.
    with pytest.raises(SystemExit) as e:
        main(["config", "check", str(cfg)])
    out = capsys.readouterr()
    assert e.value.code == 2, out.out
    assert says in out.err and "Traceback" not in out.err, out.err


def test_a_mesh_that_does_not_match_the_devices_names_mesh_expert(tmp_path, prepared) -> None:
    cfg = write_config(
        tmp_path / "big.toml",
        tiny_config(prepared, str(tmp_path / "runs"), model=MOE, mesh={"expert": 2, "fsdp": 2}),
    )
    r = run_cli("local", str(cfg))  # one CPU device here
    assert r.returncode == 2
    assert "mesh.expert" in r.stderr and "= 4, but this job has 1 device" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("setting", "cf", "shards", "platform", "expected"),
    [
        ("auto", None, 1, "cpu", ("dense", "none", "einsum")),
        ("auto", None, 2, "cpu", ("dropless", "all_to_all", "ragged_dot")),
        ("sparse", None, 1, "cpu", ("dropless", "none", "ragged_dot")),
        ("auto", 1.25, 1, "cpu", ("capacity", "none", "ragged_dot")),
        ("auto", None, 1, "tpu", ("dropless", "none", "megablox")),
        ("auto", None, 8, "tpu", ("dropless", "ragged_all_to_all", "megablox")),
        ("auto", None, 8, "cuda", ("dropless", "ragged_all_to_all", "ragged_dot")),
        ("auto", 1.25, 8, "cuda", ("capacity", "ragged_all_to_all", "einsum_slots")),
        ("dense", None, 1, "tpu", ("dense", "none", "einsum")),
    ],
)
def test_the_dispatch_is_chosen_by_platform_and_mesh(setting, cf, shards, platform, expected):
    from runtime.model.moe.dispatch import resolve

    d = resolve(setting, cf, shards, platform)
    assert (d.kind, d.exchange, d.matmul) == expected
