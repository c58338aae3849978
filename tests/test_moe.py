"""Qwen3-MoE: the sparse block against a NumPy reference of HF's semantics, the decoder under
jit/remat, logit parity with HF `Qwen3MoeForCausalLM`, param counting, and aux-loss-free
router-bias balancing in the train step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.flops import flops_per_token, parameter_counts
from runtime.model.layers import LOGICAL_AXES
from runtime.model.moe.layer import RouterBias, SparseMoE, update_router_bias
from runtime.model.registry import build_model_module
from runtime.model.sharding import LOGICAL_RULES
from runtime.train.state import TrainState
from runtime.train.step import make_train_step

from runs import batch_of


def moe_cfg(**overrides: Any) -> ModelConfig:
    base = dict(
        family="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        rope_theta=10_000.0,
        # Most tests here read layers by index; the scanned (stacked) layout is checked where
        # it differs (router-bias update) and against this one in tests/test_scan.py.
        scan_layers=False,
    )
    base.update(overrides)
    return ModelConfig(**base)


def _np(v: Any) -> np.ndarray:
    return np.asarray(v[...], np.float64)


def _reference_moe(block: SparseMoE, x: np.ndarray, norm_topk_prob: bool) -> np.ndarray:
    """HF Qwen3MoeSparseMoeBlock, token by token, in float64."""
    w_router = _np(block.gate.kernel)
    wg, wu, wd = (
        _np(block.experts.gate_proj),
        _np(block.experts.up_proj),
        _np(block.experts.down_proj),
    )
    k = block.num_experts_per_tok
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(flat)
    for t, xt in enumerate(flat):
        logits = xt @ w_router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top]
        if norm_topk_prob:
            w = w / w.sum()
        for e, we in zip(top, w, strict=True):
            g, u = xt @ wg[e], xt @ wu[e]
            out[t] += we * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return out.reshape(x.shape)


@pytest.mark.parametrize("dispatch", ["dense", "sparse"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_matches_numpy_reference(norm_topk_prob: bool, dispatch: str) -> None:
    cfg = moe_cfg(
        norm_topk_prob=norm_topk_prob, num_experts=6, num_experts_per_tok=3, moe_dispatch=dispatch
    )
    block = SparseMoE(
        cfg,
        rngs=nnx.Rngs(1),
        eager_sharding=False,
    )
    # A router wide enough that the top-k choice is far from ties.
    block.gate.kernel[...] = jax.random.normal(jax.random.PRNGKey(2), block.gate.kernel.shape)
    block.experts.down_proj[...] = block.experts.down_proj[...] * 20.0
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (2, 5, cfg.hidden_size)))
    y, stats = jax.jit(lambda b, x: b(x))(block, jnp.asarray(x))
    load = stats.load
    assert int(stats.dropped) == 0
    ref = _reference_moe(block, x, norm_topk_prob)
    assert np.abs(ref).max() > 1e-2
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5)
    assert load.shape == (6,)
    np.testing.assert_allclose(float(load.sum()), 1.0, atol=1e-6)


def test_bias_steers_choice_but_not_weights() -> None:
    cfg = moe_cfg(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)
    block = SparseMoE(
        cfg,
        rngs=nnx.Rngs(0),
        eager_sharding=False,
    )
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, cfg.hidden_size))
    block.router_bias[...] = jnp.array([0.0, 0.0, 100.0, 0.0])
    y, stats = block(x)
    np.testing.assert_allclose(np.asarray(stats.load), [0, 0, 1, 0])
    # Output = softmax prob of expert 2 (unbiased) times expert 2's SwiGLU.
    logits = x @ block.gate.kernel[...]
    p2 = jax.nn.softmax(logits, axis=-1)[..., 2:3]
    ex = block.experts
    h = jax.nn.silu(x @ ex.gate_proj[2]) * (x @ ex.up_proj[2])
    np.testing.assert_allclose(np.asarray(y), np.asarray(p2 * (h @ ex.down_proj[2])), atol=1e-6)


def test_param_layout_names_and_bias_is_not_a_param() -> None:
    model = build_model_module(moe_cfg(), rngs=nnx.Rngs(0))
    mlp = model.layers[0].mlp
    assert mlp.gate.kernel.shape == (32, 4)
    assert mlp.experts.gate_proj.shape == (4, 32, 16)
    assert mlp.experts.up_proj.shape == (4, 32, 16)
    assert mlp.experts.down_proj.shape == (4, 16, 32)
    assert mlp.gate.kernel.out_sharding == ("embed", "expert")
    assert mlp.experts.gate_proj.out_sharding == ("expert", "embed", "mlp")
    assert mlp.experts.down_proj.out_sharding == ("expert", "mlp", "embed")
    assert "expert" in LOGICAL_AXES and LOGICAL_RULES["expert"] == "expert"
    assert isinstance(mlp.router_bias, RouterBias) and not isinstance(mlp.router_bias, nnx.Param)
    _, params, others = nnx.split(model, nnx.Param, ...)
    flat_params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(params)}
    assert "layers.0.mlp.gate.kernel" in flat_params
    assert "layers.1.mlp.experts.down_proj" in flat_params
    assert not any("router_bias" in p for p in flat_params)
    bias_paths = [p for p, _ in nnx.to_flat_state(others) if "router_bias" in p]
    assert len(bias_paths) == 2
    # param_count: every Param counted; FLOPs use only the active experts.
    counts = parameter_counts(model.cfg)
    assert counts["total"] == sum(x.size for x in jax.tree.leaves(params))
    d, e, k, mf, layers = 32, 4, 2, 16, 2
    assert counts["non_embedding"] - counts["active_non_embedding"] == layers * 3 * d * mf * (e - k)
    fl = flops_per_token(model.cfg, 16)
    assert fl["params_counted"] == counts["active_non_embedding"] + 64 * 32
    assert "active_non_embedding" not in parameter_counts(
        moe_cfg(
            family="qwen3", num_experts=None, num_experts_per_tok=None, moe_intermediate_size=None
        )
    )


@pytest.mark.parametrize("remat", ["none", "block", "full"])
def test_decoder_forward_under_jit(remat: str) -> None:
    cfg = moe_cfg(remat=remat)
    graphdef, params, others = nnx.split(build_model_module(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))

    @jax.jit
    def loss_and_grad(params, others):
        def loss(p):
            logits, loads = nnx.merge(graphdef, p, others).forward_with_loads(ids, pos)
            return jnp.mean(logits**2), (logits, loads)

        return jax.value_and_grad(loss, has_aux=True)(params)

    (value, (logits, loads)), grads = loss_and_grad(params, others)
    assert logits.shape == (2, 12, cfg.vocab_size) and logits.dtype == jnp.float32
    assert loads.shape == (cfg.num_layers, cfg.num_experts)
    np.testing.assert_allclose(np.asarray(loads.sum(-1)), 1.0, atol=1e-6)
    assert np.isfinite(float(value))
    assert float(optax.tree.norm(grads)) > 0
    eager = build_model_module(cfg, rngs=nnx.Rngs(0))(ids, pos)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_decode_matches_full_forward() -> None:
    model = build_model_module(moe_cfg(), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, 64)
    pos = jnp.arange(6)[None]
    # Compiled whole: op by op, each of the three shapes would compile every op again.
    full = nnx.jit(lambda m, i, p: m(i, p))(model, ids, pos)
    decode = nnx.jit(lambda m, i, p, c: m.decode(i, p, c))
    cache = model.init_cache(1, 8)
    pre, cache = decode(model, ids[:, :5], pos[:, :5], cache)
    step, _ = decode(model, ids[:, 5:], pos[:, 5:], cache)
    np.testing.assert_allclose(np.asarray(pre), np.asarray(full[:, :5]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(full[:, 5]), atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_hf_qwen3_moe(norm_topk_prob: bool) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = moe_cfg(tie_word_embeddings=False, norm_topk_prob=norm_topk_prob)
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():  # random everything, norms included; a router wide enough to matter
        for name, p in hf.named_parameters():
            std = 0.5 if name.endswith("gate.weight") else 0.1
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p)
            )
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

    model = build_model_module(cfg, rngs=nnx.Rngs(0))
    f = cfg.moe_intermediate_size
    model.embed_tokens.embedding[...] = sd["model.embed_tokens.weight"]
    model.norm.scale[...] = sd["model.norm.weight"]
    model.lm_head.kernel[...] = sd["lm_head.weight"].T
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, n).kernel[...] = sd[pre + f"self_attn.{n}.weight"].T
        layer.self_attn.q_norm.scale[...] = sd[pre + "self_attn.q_norm.weight"]
        layer.self_attn.k_norm.scale[...] = sd[pre + "self_attn.k_norm.weight"]
        layer.input_layernorm.scale[...] = sd[pre + "input_layernorm.weight"]
        layer.post_attention_layernorm.scale[...] = sd[pre + "post_attention_layernorm.weight"]
        layer.mlp.gate.kernel[...] = sd[pre + "mlp.gate.weight"].T
        gate_up = sd[pre + "mlp.experts.gate_up_proj"]  # [E, 2F, D]
        layer.mlp.experts.gate_proj[...] = gate_up[:, :f, :].transpose(0, 2, 1)
        layer.mlp.experts.up_proj[...] = gate_up[:, f:, :].transpose(0, 2, 1)
        layer.mlp.experts.down_proj[...] = sd[pre + "mlp.experts.down_proj"].transpose(0, 2, 1)

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10))
    pos = np.broadcast_to(np.arange(10), (2, 10))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), position_ids=torch.tensor(pos)).logits.numpy()
    got = np.asarray(jax.jit(lambda m, i, p: m(i, p))(model, jnp.asarray(ids), jnp.asarray(pos)))
    assert np.abs(want).max() > 0.1
    diff = float(np.abs(got - want).max())
    print(f"HF Qwen3-MoE logit parity (norm_topk_prob={norm_topk_prob}): max abs diff {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_update_router_bias_moves_toward_balance(scan: bool) -> None:
    model = build_model_module(moe_cfg(scan_layers=scan), rngs=nnx.Rngs(0))
    _, _, others = nnx.split(model, nnx.Param, ...)
    loads = jnp.array([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    (new,) = update_router_bias((others,), loads, 0.1)
    merged = nnx.merge(nnx.graphdef(model), nnx.state(model, nnx.Param), new)
    if scan:  # one stacked [L, E] bias
        biases = np.asarray(merged.layers.mlp.router_bias[...])
    else:
        biases = np.stack([np.asarray(layer.mlp.router_bias[...]) for layer in merged.layers])
    np.testing.assert_allclose(biases, [[-0.1, -0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0]])


def _unsharded_state(params, others, tx) -> TrainState:
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                      rng=jax.random.PRNGKey(0), model_state=(others,))  # fmt: skip


def _skewed_run(rate: float, steps: int = 50) -> tuple[float, float, np.ndarray]:
    """Train a model whose router sends (almost) every token to expert 0; -> (first, final mean of
    the last 10 steps' expert_load_max_over_mean, final biases [L, E])."""
    cfg = moe_cfg(router_bias_update_rate=rate)
    model = build_model_module(cfg, rngs=nnx.Rngs(0))
    # Every token's residual stream gets a shared offset as large as its own part; expert 0's
    # router column reads the offset (a logit lead of ~2.5), while a unit-scale random router
    # keeps the other experts' logits token-dependent (std ~1), so balance is reachable.
    d = cfg.hidden_size
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] + cfg.init_std
    for i, layer in enumerate(model.layers):
        w = jax.random.normal(jax.random.PRNGKey(10 + i), (d, cfg.num_experts)) / np.sqrt(d)
        layer.mlp.gate.kernel[...] = w.at[:, 0].add(3.5 / d)
    graphdef, params, others = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)
    state = _unsharded_state(params, others, tx)
    step_fn = jax.jit(
        make_train_step(
            graphdef,
            tx,
            optax.constant_schedule(1e-3),
            router_bias_update_rate=cfg.router_bias_update_rate,
        )
    )
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(steps):
        ids = rng.integers(0, cfg.vocab_size, (1, 4, 17))
        batch = batch_of(ids)
        state, metrics = step_fn(state, batch)
        ratios.append(float(metrics["expert_load_max_over_mean"]))
        assert np.isfinite(float(metrics["loss"]))
    final = nnx.merge(graphdef, state.params, *state.model_state)
    biases = np.stack([np.asarray(layer.mlp.router_bias[...]) for layer in final.layers])
    return ratios[0], float(np.mean(ratios[-10:])), biases


def test_router_bias_update_balances_a_skewed_router() -> None:
    first0, off, bias_off = _skewed_run(0.0)
    first1, on, bias_on = _skewed_run(0.1)
    print(
        f"expert_load_max_over_mean (E=4, k=2; 2.0 = one expert in every top-k): "
        f"step 1: {first0:.3f}; mean of steps 41-50: rate 0 -> {off:.3f}, rate 0.1 -> {on:.3f}"
    )
    assert first0 == pytest.approx(first1) and first0 > 1.8  # the skew is real
    assert np.all(bias_off == 0.0) and np.any(bias_on != 0.0)
    assert on < off - 0.3


def test_dense_has_no_load_metric_and_keeps_its_empty_model_state() -> None:
    cfg = moe_cfg(
        family="qwen3", num_experts=None, num_experts_per_tok=None, moe_intermediate_size=None
    )
    graphdef, params, others = nnx.split(build_model_module(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.sgd(0.1)
    state = _unsharded_state(params, others, tx)
    ones = jnp.ones((1, 2, 8), jnp.int32)
    batch = {
        "inputs": ones,
        "targets": ones,
        "loss_mask": ones.astype(jnp.float32),
        "segment_ids": ones,
        "positions": jnp.broadcast_to(jnp.arange(8), (1, 2, 8)),
    }
    sched = optax.constant_schedule(0.1)
    new_state, metrics = jax.jit(make_train_step(graphdef, tx, sched))(state, batch)
    assert "expert_load_max_over_mean" not in metrics
    # The model state is always in the train state: a dense model's is empty and stays so.
    assert jax.tree.leaves(new_state.model_state) == [] == jax.tree.leaves(others)


def test_a_qwen3_moe_model_table_needs_the_moe_keys_to_skip_the_hf_lookup() -> None:
    from jobspec.families.hf import HF_MOE_KEYS
    from jobspec.hf_config import HF_KEYS, fills_nothing

    dense = moe_cfg(family="qwen3", num_experts=None, num_experts_per_tok=None,
                    moe_intermediate_size=None).model_dump()  # fmt: skip
    assert set(HF_KEYS + HF_MOE_KEYS) <= set(dense)  # every key is a ModelConfig field
    assert fills_nothing(dense)  # e.g. a dense resolved.json
    every_dense_key = {k: dense[k] for k in HF_KEYS}
    assert fills_nothing(every_dense_key)
    # Every dense key but no MoE key: qwen3_moe still needs num_experts etc. from config.json.
    assert not fills_nothing({**every_dense_key, "family": "qwen3_moe"})
    assert fills_nothing(moe_cfg().model_dump())
    assert not fills_nothing({k: v for k, v in dense.items() if k != "family"})
