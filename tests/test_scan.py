"""Scanned layers (`model.scan_layers`): the stacked model is the unrolled one (parameters,
logits, gradients, expert loads, decoding, router-bias updates, HF names both ways), and the
real train step compiled for 8 CPU devices keeps each chip's share of the batch, not all of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.hf.convert import flat_params
from runtime.model.generate import generate
from runtime.model.hf_weights import hf_from_params, params_from_hf
from runtime.model.registry import build_model_module
from runtime.train.state import TrainState, model_state_from_meta, model_state_record
from runtime.train.step import make_train_step

from runs import ROOT, batch_of, xla_flags

LAYERS = 3
TINY: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, max_position_embeddings=64, init_std=0.1, rope_theta=10_000.0,
)  # fmt: skip
MOE: dict[str, Any] = dict(
    family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
)
FAMILIES = {"qwen3": {}, "qwen3_moe": MOE}


def _cfg(family: str, scan: bool, **over: Any) -> ModelConfig:
    return ModelConfig(**{**TINY, **FAMILIES[family], "scan_layers": scan, **over})


def _pair(family: str, seed: int = 0, **over: Any) -> tuple[nnx.Module, nnx.Module]:
    """(scanned, unrolled) models of one config built from one seed."""
    return tuple(  # type: ignore[return-value]
        build_model_module(_cfg(family, scan, **over), rngs=nnx.Rngs(params=seed))
        for scan in (True, False)
    )


def _stacked(flat: dict[tuple, Any]) -> dict[tuple, np.ndarray]:
    """An unrolled model's flat arrays in the scanned layout: ("layers", i, *rest) for every i
    becomes ("layers", *rest) stacked along a new leading axis (a scanned one's stay as they are).
    """
    out: dict[tuple, Any] = {}
    per_layer: dict[tuple, dict[int, Any]] = {}
    for path, a in flat.items():
        if path[0] == "layers" and str(path[1]).isdigit():
            per_layer.setdefault((path[0], *path[2:]), {})[int(path[1])] = np.asarray(a)
        else:
            out[path] = np.asarray(a)
    for path, layers in per_layer.items():
        out[path] = np.stack([layers[i] for i in range(len(layers))])
    return out


def _flat(state: Any) -> dict[tuple, np.ndarray]:
    return {k: np.asarray(v) for k, v in flat_params(state).items()}


def _batch(b: int = 2, t: int = 12, seed: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    ids = jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, TINY["vocab_size"])
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = jnp.asarray([[1] * (t // 2) + [2] * (t - t // 2)] + [[1] * t] * (b - 1), jnp.int32)
    return ids, pos, seg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scanned_parameters_are_the_unrolled_stack(family: str) -> None:
    scanned, unrolled = _pair(family)
    _, sp, so = nnx.split(scanned, nnx.Param, ...)
    _, up, uo = nnx.split(unrolled, nnx.Param, ...)
    want, got = _stacked(_flat(up)), _flat(sp)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
    assert got[("layers", "self_attn", "q_proj", "kernel")].shape == (LAYERS, 32, 32)
    # Every stacked parameter names the layer axis first; nothing else does.
    for path, var in nnx.to_flat_state(sp):
        assert (var.out_sharding[0] == "layers") is (path[0] == "layers"), path
        assert len(var.out_sharding) == var.ndim, path
    # The non-Param state stacks too: one [L, E] router bias instead of L [E] ones.
    others = _flat(so)
    if family == "qwen3_moe":
        assert list(others) == [("layers", "mlp", "router_bias")]
        assert others[("layers", "mlp", "router_bias")].shape == (LAYERS, 4)
        assert len(jax.tree.leaves(uo)) == LAYERS
    else:
        assert others == {} and jax.tree.leaves(uo) == []


def _value_and_grad(model: nnx.Module, ids: jax.Array, pos: jax.Array, seg: jax.Array) -> Any:
    graphdef, params, others = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params: Any, others: Any) -> Any:
        def loss(p: Any) -> Any:
            logits, loads = nnx.merge(graphdef, p, others).forward_with_loads(
                ids[:, :-1], pos[:, :-1], seg[:, :-1]
            )
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))
            return nll, (logits, loads)

        return jax.value_and_grad(loss, has_aux=True)(params)

    return run.lower(params, others).compile()(params, others)


@pytest.mark.parametrize("remat", ["none", "block", "full"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_scanned_logits_loads_and_grads_match_unrolled(family: str, remat: str) -> None:
    ids, pos, seg = _batch()
    scanned, unrolled = _pair(family, seed=2, remat=remat)
    (ls, (logits_s, loads_s)), grads_s = _value_and_grad(scanned, ids, pos, seg)
    (lu, (logits_u, loads_u)), grads_u = _value_and_grad(unrolled, ids, pos, seg)
    assert float(jnp.max(jnp.abs(logits_u))) > 0.1
    np.testing.assert_allclose(logits_s, logits_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ls, lu, rtol=1e-5)
    if family == "qwen3_moe":
        assert loads_s.shape == (LAYERS, 4)
        np.testing.assert_array_equal(loads_s, loads_u)
    else:
        assert loads_s is None and loads_u is None
    want, got = _stacked(_flat(grads_u)), _flat(grads_s)
    assert sorted(got) == sorted(want)
    for path in want:
        scale = float(np.max(np.abs(want[path])))
        assert scale > 0, path
        np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-5 * scale)


def test_scanned_remat_wraps_the_scan_body() -> None:
    ids, pos, seg = _batch()
    for remat, marked in (("none", False), ("full", True)):
        model = build_model_module(_cfg("qwen3", True, remat=remat), rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        fn = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(ids, pos, seg)))  # noqa: B023
        jaxpr = str(jax.make_jaxpr(fn)(params))
        # One scan forward, one backward: not one block per layer.
        assert jaxpr.count("scan[") >= 2, remat
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) is marked, remat


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoding_with_scan_equals_without(family: str) -> None:
    scanned, unrolled = _pair(family, seed=3)
    ids, pos, _ = _batch(1, 9, seed=4)
    cache_s, cache_u = scanned.init_cache(1, 12), unrolled.init_cache(1, 12)
    assert cache_s.k.shape == (LAYERS, 1, 12, 2, 8) and len(cache_u.k) == LAYERS
    pre_s, cache_s = scanned.decode(ids[:, :7], pos[:, :7], cache_s)
    pre_u, cache_u = unrolled.decode(ids[:, :7], pos[:, :7], cache_u)
    np.testing.assert_allclose(pre_s, pre_u, rtol=1e-5, atol=1e-5)
    step_s, cache_s = scanned.decode(ids[:, 7:], pos[:, 7:], cache_s)
    step_u, cache_u = unrolled.decode(ids[:, 7:], pos[:, 7:], cache_u)
    np.testing.assert_allclose(step_s, step_u, rtol=1e-5, atol=1e-5)
    # Deeper layers' K come from earlier layers' outputs, which the scan fuses
    # differently: float32 reassociation, the same bound as the logits.
    np.testing.assert_allclose(cache_s.k, np.stack(cache_u.k), rtol=1e-5, atol=1e-5)
    assert int(cache_s.index) == int(cache_u.index) == 9
    # And against the full forward (the cache path computes the same positions).
    np.testing.assert_allclose(step_s, scanned(ids, pos)[:, 7:], rtol=1e-5, atol=1e-5)
    prompt = np.asarray(ids[0, :5])
    kw = dict(max_new_tokens=6, top_k=None, seed=0)
    for temperature in (0.0, 1.0):
        a = generate(scanned, prompt, temperature=temperature, **kw)
        b = generate(unrolled, prompt, temperature=temperature, **kw)
        assert a == b and len(a["tokens"]) == 6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_names_map_stacked_layers_both_ways(family: str) -> None:
    scanned, unrolled = _pair(family, seed=5)
    flat_s = _flat(nnx.state(scanned, nnx.Param))
    flat_u = _flat(nnx.state(unrolled, nnx.Param))
    hf_s = hf_from_params(scanned.cfg, flat_s)
    hf_u = hf_from_params(unrolled.cfg, flat_u)
    assert sorted(hf_s) == sorted(hf_u)
    assert f"model.layers.{LAYERS - 1}.self_attn.q_proj.weight" in hf_s
    if family == "qwen3_moe":
        assert f"model.layers.{LAYERS - 1}.mlp.experts.3.down_proj.weight" in hf_s
    for name in hf_u:
        assert hf_s[name].shape == hf_u[name].shape, name
        assert hf_s[name].tobytes() == hf_u[name].tobytes(), name
    # Back: the HF tensors rebuild the stacked parameters exactly, and the unrolled ones too.
    back_s, back_u = params_from_hf(scanned.cfg, hf_s), params_from_hf(unrolled.cfg, hf_u)
    for flat, back in ((flat_s, back_s), (flat_u, back_u)):
        assert sorted(back) == sorted(flat)
        for path in flat:
            assert back[path].dtype == flat[path].dtype, path
            np.testing.assert_array_equal(back[path], flat[path], err_msg=str(path))


def test_stacked_router_bias_trains_like_per_layer_and_survives_checkpoint_meta() -> None:
    """Three train steps with the bias update on: the stacked [L, E] bias moves exactly as the
    per-layer biases do, and the checkpoint meta record round-trips it."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], (3, 1, 4, 17))
    biases, losses = [], []
    for model in _pair("qwen3_moe", seed=6, router_bias_update_rate=0.05):
        graphdef, params, others = nnx.split(model, nnx.Param, ...)
        tx = optax.adam(1e-2)
        state = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                           rng=jax.random.PRNGKey(0), model_state=(others,))  # fmt: skip
        step = jax.jit(make_train_step(graphdef, tx, optax.constant_schedule(1e-2),
                                       router_bias_update_rate=0.05))  # fmt: skip
        step = step.lower(state, batch_of(ids[0])).compile()
        for row in ids:
            batch = batch_of(row)
            state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        flat = _flat(state.model_state[0])
        biases.append(_stacked(flat)[("layers", "mlp", "router_bias")])
        # The checkpoint meta's record of the model state, and back into the model's layout.
        record = json.loads(json.dumps(model_state_record(state)))
        meta = SimpleNamespace(model_state=record)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        restored = model_state_from_meta(state.model_state, meta, device)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state.model_state), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    assert np.any(biases[0] != 0)
    np.testing.assert_allclose(biases[0], biases[1], atol=1e-7)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


# ---- the real train step compiled for 8 (CPU) devices ---------------------------------------

_GLOBAL_BATCH, _SEQ, _HIDDEN = 48, 40, 64  # shapes no weight dimension shares

_COMPILE = textwrap.dedent(
    """
    import json, sys
    import jax
    from jobspec.files.run_toml import parse_run_config
    from runtime.model.sharding import build_mesh
    from runtime.train.program import abstract_program

    B, T, D = {B}, {T}, {D}
    for family, mesh in json.loads(sys.argv[1]):
        model = dict(vocab_size=512, hidden_size=D, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=192, max_position_embeddings=64, remat="full")
        if family == "qwen3_moe":
            model.update(family=family, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=48, router_bias_update_rate=0.01)
        if family == "gemma4_text":  # every Gemma 4 feature; the per-layer table is [512, 4 x 16]
            model.update(family=family, num_layers=4, head_dim=16, gemma4=dict(
                layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                global_head_dim=32, num_global_kv_heads=1, attention_k_eq_v=True,
                num_kv_shared_layers=2, hidden_size_per_layer_input=16, enable_moe_block=True,
                num_experts=4, top_k_experts=2, moe_intermediate_size=48,
                use_double_wide_mlp=True, final_logit_softcapping=30.0))
        if family == "qwen3_next":  # DeltaNet + gated attention, MoE + dense, router bias
            model.update(family=family, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=48, router_bias_update_rate=0.01, qwen3_next=dict(
                layer_types=["linear_attention", "full_attention"], mlp_only_layers=[1],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, shared_expert_intermediate_size=32, chunk_size=8))
        cfg = parse_run_config(dict(
            run=dict(id="t", output_uri="/tmp/unused"), model=model,
            data=dict(manifest="/tmp/unused/manifest.json"),
            training=dict(seq_len=T, global_batch_size=B, target_tokens=B * T * 4), mesh=mesh))
        devices = jax.devices()[: cfg.mesh.size]
        program = abstract_program(cfg, build_mesh(cfg.mesh, devices))
        compiled = program.step.lower(program.state, program.batch).compile()
        print(json.dumps(dict(family=family, mesh=mesh, hlo=compiled.as_text(),
                              temp=compiled.memory_analysis().temp_size_in_bytes)))
    """
).format(B=_GLOBAL_BATCH, T=_SEQ, D=_HIDDEN)

_MESHES = [
    ("qwen3", {"fsdp": 1}),
    ("qwen3", {"fsdp": 4}),
    ("qwen3", {"fsdp": 8}),
    ("qwen3", {"fsdp": 4, "tensor": 2}),
    ("qwen3", {"data": 2, "fsdp": 4}),
    # The other families on one split mesh each: every compile here costs ~15-30 s of CI.
    ("qwen3_moe", {"fsdp": 4, "tensor": 2}),
    ("gemma4_text", {"fsdp": 4, "tensor": 2}),
    ("qwen3_next", {"fsdp": 4, "tensor": 2}),
]


def _global_batch_buffers(hlo: str, fsdp: int) -> list[str]:
    """Shapes in the compiled (per-device) HLO that lead with the global batch [B, T, ...]
    (after an optional accumulation axis of 1), except the embedding lookup's own layout: the
    partitioner may look token ids up in the table's sharding (all B x T ids, int32 [B, T, 1], each
    chip computing its hidden/fsdp slice of every row), far cheaper than gathering the table."""
    import re

    ids = {f"[{_GLOBAL_BATCH},{_SEQ}]", f"[{_GLOBAL_BATCH},{_SEQ},1]"}  # ids and their masks
    rows = f"[{_GLOBAL_BATCH},{_SEQ},{_HIDDEN // fsdp}]"
    pattern = rf"\b([a-z]+[0-9]*)(\[(?:1,)?{_GLOBAL_BATCH},{_SEQ}(?:,[0-9]+)*\])"
    out = set()
    for dtype, dims in re.findall(pattern, hlo):
        if (dtype in ("s32", "pred") and dims in ids) or dims == rows:
            continue
        out.add(dtype + dims)
    return sorted(out)


def test_compiled_train_step_holds_a_per_device_share_of_the_batch() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(8),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(_MESHES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(_MESHES)
    temps = {}
    for res in results:
        mesh = res["mesh"]
        key = (res["family"], tuple(sorted(mesh.items())))
        temps[key] = res["temp"]
        fsdp = mesh.get("fsdp", 1)
        if fsdp * mesh.get("data", 1) == 1:
            # One device: the whole batch is the per-device share; the check has teeth.
            assert _global_batch_buffers(res["hlo"], 1), "the unsharded program shows no batch"
            continue
        bad = _global_batch_buffers(res["hlo"], fsdp)
        assert not bad, f"{res['family']} on {mesh}: global-batch buffers {bad[:8]}"
    fsdp_temps = [temps[("qwen3", (("fsdp", n),))] for n in (1, 4, 8)]
    print(f"per-device temp bytes, fsdp 1/4/8: {fsdp_temps}")
    assert all(a > b for a, b in zip(fsdp_temps, fsdp_temps[1:], strict=False)), fsdp_temps
    assert fsdp_temps[-1] < fsdp_temps[0] / 3
