"""The Qwen3 decoder: shapes, masking, GQA, counts, remat, dtypes, logical axis names.

`_reference_logits` is an independent float64 NumPy transcription of HF Qwen3's forward pass
(explicit repeat_kv, rotate_half, additive causal mask), so the JAX model is checked against the
HF algorithm here, ahead of the torch parity test.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jobspec.families.model_config import ModelConfig
from runtime.model.layers import LOGICAL_AXES
from runtime.model.qwen3.counts import param_count
from runtime.model.qwen3.decoder import Qwen3Decoder

TINY: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=64,
    # These tests read layers by index (model.layers[i]); tests/test_scan.py checks the scanned
    # (stacked) model against this one.
    scan_layers=False,
)


def make(seed: int = 0, **overrides: Any) -> Qwen3Decoder:
    return Qwen3Decoder(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(params=seed))


def tokens(batch: int, length: int, seed: int = 0, vocab: int = 97) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


def arange_positions(batch: int, length: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: Any, params: Any, ids: jax.Array, pos: jax.Array, seg: Any) -> jax.Array:
    return nnx.merge(graphdef, params)(ids, pos, seg)


def forward(
    model: Qwen3Decoder, ids: jax.Array, pos: jax.Array, seg: jax.Array | None = None
) -> jax.Array:
    # Jitted (one compile per config and shape): eager NNX dispatch op by op is slow on CPU.
    graphdef, params = nnx.split(model)
    return _forward(graphdef, params, ids, pos, seg)


def _np(p: nnx.Param) -> np.ndarray:
    return np.asarray(p[...], np.float64)


def _reference_logits(model: Qwen3Decoder, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    cfg = model.cfg
    eps, d = cfg.rms_norm_eps, cfg.resolved_head_dim
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    b, t = ids.shape

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * (x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps))

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)

    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2) / d))
    emb = np.concatenate([positions[..., None] * inv_freq] * 2, axis=-1)  # [B, T, D]
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]  # [B, 1, T, D]
    causal = np.where(np.tril(np.ones((t, t), bool)), 0.0, -np.inf)

    table = _np(model.embed_tokens.embedding)
    x = table[ids]
    for layer in model.layers:
        a = layer.self_attn
        y = rms(x, _np(layer.input_layernorm.scale))
        q = rms((y @ _np(a.q_proj.kernel)).reshape(b, t, h, d), _np(a.q_norm.scale))
        k = rms((y @ _np(a.k_proj.kernel)).reshape(b, t, kvh, d), _np(a.k_norm.scale))
        v = (y @ _np(a.v_proj.kernel)).reshape(b, t, kvh, d)
        q, k, v = (z.transpose(0, 2, 1, 3) for z in (q, k, v))  # [B, heads, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)  # HF repeat_kv
        s = q @ k.transpose(0, 1, 3, 2) * d**-0.5 + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        o = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, h * d)
        x = x + o @ _np(a.o_proj.kernel)
        y = rms(x, _np(layer.post_attention_layernorm.scale))
        g = y @ _np(layer.mlp.gate_proj.kernel)
        x = x + (g / (1 + np.exp(-g)) * (y @ _np(layer.mlp.up_proj.kernel))) @ _np(
            layer.mlp.down_proj.kernel
        )
    x = rms(x, _np(model.norm.scale))
    head = table.T if cfg.tie_word_embeddings else _np(model.lm_head.kernel)
    return x @ head


def _randomise_norms(model: Qwen3Decoder, seed: int) -> None:
    # Norm scales start at ones; perturb them so the reference check also covers their use.
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "scale":
            var[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(var.shape), var.dtype)


def test_output_shape_and_dtype() -> None:
    model = make()
    logits = forward(model, tokens(2, 7), arange_positions(2, 7))
    assert logits.shape == (2, 7, 97)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_init_is_deterministic_from_seed() -> None:
    a, b, c = (nnx.state(make(seed=s), nnx.Param) for s in (3, 3, 4))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(
        a["embed_tokens"]["embedding"][...], c["embed_tokens"]["embedding"][...]
    )
    emb = np.asarray(a["embed_tokens"]["embedding"][...])
    assert abs(emb.std() - 0.02) < 0.003  # normal(init_std)
    np.testing.assert_array_equal(a["norm"]["scale"][...], np.ones(32))


@pytest.mark.parametrize(
    ("num_kv_heads", "tie"),
    [(4, True), (2, True), (1, False), (2, False)],
    ids=["mha-tied", "gqa2-tied", "mqa-untied", "gqa2-untied"],
)
def test_matches_hf_algorithm_reference(num_kv_heads: int, tie: bool) -> None:
    model = make(seed=1, num_kv_heads=num_kv_heads, tie_word_embeddings=tie, init_std=0.2)
    _randomise_norms(model, seed=2)
    ids = tokens(2, 9, seed=5)
    # Offset positions so RoPE is exercised away from 0.
    positions = arange_positions(2, 9) + jnp.asarray([[0], [17]], jnp.int32)
    got = np.asarray(forward(model, ids, positions))
    want = _reference_logits(model, np.asarray(ids), np.asarray(positions, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = make()
    ids = tokens(1, 8)
    changed = ids.at[0, 5:].set((ids[0, 5:] + 1) % 97)
    pos = arange_positions(1, 8)
    a, b = forward(model, ids, pos), forward(model, changed, pos)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_segments_are_isolated() -> None:
    model = make(init_std=0.2)
    ids = tokens(1, 6, seed=7)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2]], jnp.int32)
    packed = forward(model, ids, pos, seg)
    alone_1 = forward(model, ids[:, :3], arange_positions(1, 3))
    alone_2 = forward(model, ids[:, 3:], arange_positions(1, 3))
    np.testing.assert_allclose(packed[:, :3], alone_1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(packed[:, 3:], alone_2, rtol=1e-6, atol=1e-6)
    # Without segment ids the second document does see the first.
    assert not np.allclose(forward(model, ids, pos)[:, 3:], alone_2, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_param_count_matches_model(tie: bool, num_kv_heads: int) -> None:
    model = make(tie_word_embeddings=tie, num_kv_heads=num_kv_heads)
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    counts = param_count(model.cfg)
    assert counts["total"] == actual
    assert counts["embedding"] == 97 * 32
    assert counts["lm_head"] == (0 if tie else 97 * 32)
    assert counts["total"] == counts["embedding"] + counts["lm_head"] + counts["non_embedding"]
    assert counts["non_embedding"] == 2 * counts["per_layer"] + 32
    assert hasattr(model, "lm_head") is (not tie)


def _loss_and_grads(remat: str) -> tuple[jax.Array, Any, Any]:
    model = make(seed=2, remat=remat, init_std=0.1)
    graphdef, params = nnx.split(model, nnx.Param)
    ids = tokens(2, 8, seed=3)
    pos = arange_positions(2, 8)
    seg = jnp.asarray([[1] * 5 + [2] * 3, [1] * 8], jnp.int32)

    def loss_fn(p: Any) -> jax.Array:
        logits = nnx.merge(graphdef, p)(ids[:, :-1], pos[:, :-1], seg[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss_fn))(params))
    return loss, grads, jaxpr


def test_remat_policies_give_equal_loss_and_grads() -> None:
    base_loss, base_grads, base_jaxpr = _loss_and_grads("none")
    assert "checkpoint" not in base_jaxpr and "remat" not in base_jaxpr
    for remat in ("block", "full"):
        loss, grads, jaxpr = _loss_and_grads(remat)
        assert "checkpoint" in jaxpr or "remat" in jaxpr, remat
        np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
        for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads), strict=True):
            # Recomputation may re-associate fp32 sums: compare to fp32 rounding of the scale.
            scale = float(jnp.max(jnp.abs(g0)))
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5 * scale)


def test_bf16_compute_is_close_to_fp32() -> None:
    ids, pos = tokens(2, 8), arange_positions(2, 8)
    ref = forward(make(seed=4, init_std=0.2), ids, pos)
    for overrides in (
        {"compute_dtype": "bfloat16"},
        {"compute_dtype": "bfloat16", "param_dtype": "bfloat16"},
    ):
        model = make(seed=4, init_std=0.2, **overrides)
        got = forward(model, ids, pos)
        assert got.dtype == jnp.float32
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        assert err < 0.05, (overrides, err)
    stored = nnx.state(make(param_dtype="bfloat16"), nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(stored)} == {jnp.dtype(jnp.bfloat16)}


EXPECTED_AXES = {
    "embedding": ("vocab", "embed"),
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": ("norm",),
}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_every_param_has_logical_axis_names(tie: bool, scan: bool) -> None:
    model = make(tie_word_embeddings=tie, scan_layers=scan)
    params = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(params)
    assert len(flat) == len(jax.tree.leaves(params))
    for path, var in flat:
        names = var.out_sharding
        assert isinstance(names, tuple) and len(names) == var.ndim, path
        assert set(names) <= set(LOGICAL_AXES), path
        key = next(k for k in reversed(path) if k in EXPECTED_AXES)
        # Scanned blocks' parameters lead with the stacked-layer axis.
        stacked = scan and path[0] == "layers"
        assert names == (("layers",) if stacked else ()) + EXPECTED_AXES[key], path
    # The route the sharding code takes: one PartitionSpec of logical names per Param.
    specs = nnx.get_partition_spec(params)
    P = jax.sharding.PartitionSpec
    if scan:
        q = specs["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
        assert q == P("layers", "embed", "heads")
        # Kernels are [in, out] (after the layer axis), so an HF weight maps in by a transpose.
        assert model.layers.self_attn.q_proj.kernel.shape == (2, 32, 4 * 8)
        assert model.layers.mlp.down_proj.kernel.shape == (2, 64, 32)
        return
    assert specs["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value() == P("embed", "heads")
    # Kernels are [in, out], so an HF weight maps in by a transpose.
    assert model.layers[0].self_attn.q_proj.kernel.shape == (32, 4 * 8)
    assert model.layers[0].mlp.down_proj.kernel.shape == (64, 32)


def test_jit_through_split_merge_matches_eager() -> None:
    model = make()
    ids, pos = tokens(2, 5), arange_positions(2, 5)
    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, i, q: nnx.merge(graphdef, p)(i, q))
    np.testing.assert_allclose(fwd(params, ids, pos), model(ids, pos), rtol=1e-6, atol=1e-6)
