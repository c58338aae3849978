"""The chunked loss (train/loss.py `hidden_loss_sums`): the same sums and gradients as the loss on
whole [B, T, V] logits for every chunk size, masked positions that cannot leak, tied and untied
heads end to end, and a compiled train step that holds no [rows, T, vocab] float32 buffer."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.tree_util import tree_leaves_with_path

from jobspec.families.model_config import ModelConfig
from jobspec.run_config import MeshConfig
from runtime.model.build import build_model
from runtime.model.sharding import build_mesh
from runtime.train.loss import (
    clipped_pg_sums,
    cross_entropy_sums,
    hidden_loss_sums,
    token_logprobs,
)
from runtime.train.state import new_state, state_shardings
from runtime.train.step import _loss_sums, make_eval_step, make_train_step

B, T, D, V = 3, 24, 16, 40
EPS = 0.2
# 6 divides T, 5 and 7 do not, 1 is one position per chunk, 24 and 50 are one whole chunk.
CHUNKS = [0, 1, 5, 6, 7, 24, 50]
OBJECTIVES = ["cross_entropy", "clipped_pg"]


def _arrays(seed: int) -> dict[str, np.ndarray]:
    """Hidden states, a head, targets, a mask, advantages of both signs and old log-probs spread
    around the current ones, so ratios fall on both sides of the clip range."""
    rng = np.random.default_rng(seed)
    x = {
        "h": rng.normal(0.0, 1.0, (B, T, D)).astype(np.float32),
        "w": rng.normal(0.0, 0.5, (D, V)).astype(np.float32),
        "targets": rng.integers(0, V, (B, T)).astype(np.int32),
        "mask": (rng.random((B, T)) < 0.7).astype(np.float32),
        "adv": rng.normal(0.0, 1.0, (B, T)).astype(np.float32),
    }
    logits = np.einsum("btd,dv->btv", x["h"], x["w"])
    logp = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(x["targets"])))
    x["old"] = (logp + rng.normal(0.0, 0.4, (B, T))).astype(np.float32)
    return x


def _whole(h, w, x, objective):
    """The reference: whole fp32 logits, then the full-logits loss functions."""
    logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
    if objective == "clipped_pg":
        return clipped_pg_sums(logits, x["targets"], x["mask"], x["adv"], x["old"], EPS)
    return (*cross_entropy_sums(logits, x["targets"], x["mask"]), jnp.zeros(()))


def _chunked(h, w, x, objective, chunk):
    pg = objective == "clipped_pg"
    return hidden_loss_sums(
        h,
        w,
        x["targets"],
        x["mask"],
        chunk_size=chunk,
        objective=objective,
        advantages=x["adv"] if pg else None,
        old_logprobs=x["old"] if pg else None,
        clip_eps=EPS,
    )


@functools.cache
def _whole_reference(objective: str, seed: int) -> tuple:
    """The whole-logits loss and gradients of `_arrays(seed)`, computed once per objective for
    every chunk size compared with it."""
    x = _arrays(seed)
    return _value_and_grads(lambda h, w: _whole(h, w, x, objective), x)


def _value_and_grads(fn, x):
    def loss(h, w):
        s, c, k = fn(h, w)
        return s, (c, k)

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (s, (c, k)), (gh, gw) = vg(jnp.asarray(x["h"]), jnp.asarray(x["w"]))
    return float(s), float(c), float(k), np.asarray(gh), np.asarray(gw)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_equals_whole_logits(objective, chunk):
    x = _arrays(0)
    ref = _whole_reference(objective, 0)
    got = _value_and_grads(lambda h, w: _chunked(h, w, x, objective, chunk), x)
    r_sum, r_count, r_clipped, r_gh, r_gw = ref
    g_sum, g_count, g_clipped, g_gh, g_gw = got
    assert g_count == r_count == float(x["mask"].sum())
    assert g_clipped == r_clipped
    if objective == "clipped_pg":  # the clip is exercised: some counted tokens clipped, not all
        assert 0 < r_clipped < r_count
    # A sum of terms of both signs: its rounding scales with the number of terms.
    np.testing.assert_allclose(g_sum, r_sum, rtol=1e-6, atol=1e-6 * r_count)
    # Gradients to fp32 rounding: only the order of the sum over positions differs for W.
    np.testing.assert_allclose(g_gh, r_gh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_gw, r_gw, rtol=1e-5, atol=1e-5)
    assert np.abs(r_gw).max() > 1e-2 and np.abs(r_gh).max() > 1e-2  # real gradients
    # Masked positions get no gradient, padded or not.
    assert not np.any(g_gh[x["mask"] == 0])


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("chunk", [0, 5, 6])
def test_masked_positions_cannot_leak(objective, chunk):
    """Garbage at masked positions (out-of-range targets, nan advantages, -inf old log-probs)
    changes neither the sums nor the gradients; inf/nan hidden states there change no sum."""
    x = _arrays(1)
    masked = x["mask"] == 0
    assert masked.any()
    dirty = dict(x)
    dirty["targets"] = np.where(masked, np.where(x["targets"] % 2, V + 7, -3), x["targets"])
    dirty["adv"] = np.where(masked, np.nan, x["adv"]).astype(np.float32)
    dirty["old"] = np.where(masked, -np.inf, x["old"]).astype(np.float32)
    clean = _value_and_grads(lambda h, w: _chunked(h, w, x, objective, chunk), x)
    got = _value_and_grads(lambda h, w: _chunked(h, w, dirty, objective, chunk), dirty)
    assert np.isfinite(got[0]) and np.isfinite(got[3]).all() and np.isfinite(got[4]).all()
    assert got[:3] == clean[:3]
    np.testing.assert_array_equal(got[3], clean[3])
    np.testing.assert_array_equal(got[4], clean[4])

    # Hidden states that overflow the logits (inf) or are nan, at masked positions only.
    bad_h = np.where(masked[..., None], np.float32(np.inf), x["h"])
    bad_h[np.nonzero(masked)[0][0], np.nonzero(masked)[1][0]] = np.nan
    sums = jax.jit(lambda h: _chunked(h, jnp.asarray(x["w"]), dirty, objective, chunk))(bad_h)
    assert tuple(float(s) for s in sums) == clean[:3]


def test_bf16_head_gradient_accumulates_in_fp32():
    """With a bf16 head the W gradient is a sum over 32 chunks; accumulated in fp32 it stays as
    close to the fp32 reference as the whole-sequence bf16 gradient (a bf16 running sum rounds
    once per chunk and is about 3x further off)."""
    rng = np.random.default_rng(2)
    b, t, d, v = 2, 1024, 64, 512
    h = jnp.asarray(rng.normal(0.0, 1.0, (b, t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0.0, 0.1, (d, v)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.ones((b, t), jnp.float32)

    def grad_w(hh, ww, chunk):
        f = lambda ww: hidden_loss_sums(hh, ww, targets, mask, chunk_size=chunk)[0]  # noqa: E731
        return np.asarray(jax.jit(jax.grad(f))(ww).astype(jnp.float32))

    ref = grad_w(h.astype(jnp.float32), w.astype(jnp.float32), 0)
    whole, chunked = grad_w(h, w, 0), grad_w(h, w, 64)
    # The gradient still comes back in the head's own dtype (its shape and dtype, not run).
    g = jax.eval_shape(
        jax.grad(lambda ww: hidden_loss_sums(h, ww, targets, mask, chunk_size=64)[0]), w
    )
    assert g.dtype == jnp.bfloat16

    def err(g):
        return np.linalg.norm(g - ref) / np.linalg.norm(ref)

    assert err(chunked) <= 2.0 * err(whole), (err(chunked), err(whole))


def _tiny(tie: bool, vocab: int = 48, seq: int = 64, layers: int = 1) -> ModelConfig:
    """One unrolled layer unless asked: the loss under test sits after the layers, and one
    layer compiles in half the time of two scanned."""
    return ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=layers, num_heads=4,
                       num_kv_heads=2, intermediate_size=64, max_position_embeddings=seq,
                       tie_word_embeddings=tie, scan_layers=layers > 1)  # fmt: skip


def _batch(cfg: ModelConfig, accum: int, rows: int, seq: int, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (accum, rows, seq + 1)).astype(np.int32)
    mask = (rng.random((accum, rows, seq)) < 0.8).astype(np.float32)
    batch = {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "loss_mask": mask,
        "segment_ids": np.ones((accum, rows, seq), np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (accum, rows, seq)).copy(),
        "advantages": rng.normal(0.0, 1.0, (accum, rows, seq)).astype(np.float32),
        # Far enough from the model's log-probs (about -log V) that some ratios clip.
        "old_logprobs": rng.normal(-np.log(cfg.vocab_size), 0.5, (accum, rows, seq)),
    }
    batch["old_logprobs"] = batch["old_logprobs"].astype(np.float32)
    return {k: jnp.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_end_to_end_params_gradient(tie, objective):
    """d loss / d params through the model: the chunked loss against the model's own whole
    logits (`Qwen3Decoder.__call__`) and the full-logits loss functions, tied and untied heads."""
    cfg = _tiny(tie)
    parts = build_model(cfg, 0, build_mesh(MeshConfig()))
    mb = {k: v[0] for k, v in _batch(cfg, 1, 2, 12, seed=3).items()}

    def reference(params):
        model = nnx.merge(parts.graphdef, params, *parts.others)
        logits = model(mb["inputs"], mb["positions"], mb["segment_ids"])
        if objective == "clipped_pg":
            s, c, k = clipped_pg_sums(
                logits, mb["targets"], mb["loss_mask"], mb["advantages"], mb["old_logprobs"], EPS
            )
            return s, (c, k)
        s, c = cross_entropy_sums(logits, mb["targets"], mb["loss_mask"])
        return s, (c, jnp.zeros(()))

    def chunked(params, chunk):
        s, (c, k, _) = _loss_sums(
            parts.graphdef,
            parts.others,
            params,
            mb,
            objective=objective,
            pg_clip_epsilon=EPS,
            with_loads=True,
            loss_chunk_size=chunk,
        )
        return s, (c, k)

    chunks = (5, 4)  # a remainder chunk; chunks that divide T

    @jax.jit
    def all_grads(params):  # one program for the reference and both chunk sizes
        ref = jax.value_and_grad(reference, has_aux=True)(params)
        return ref, [
            jax.value_and_grad(functools.partial(chunked, chunk=c), has_aux=True)(params)
            for c in chunks
        ]

    ((r_s, (r_c, r_k)), r_g), got = all_grads(parts.params)
    if objective == "clipped_pg":
        assert 0 < float(r_k) < float(r_c)
    for chunk, ((s, (c, k)), g) in zip(chunks, got, strict=True):
        assert (float(c), float(k)) == (float(r_c), float(r_k))
        np.testing.assert_allclose(float(s), float(r_s), rtol=1e-6)
        for (path, a), b in zip(tree_leaves_with_path(r_g), jax.tree.leaves(g), strict=True):
            # fp32 rounding, relative to the leaf's scale (entries near zero differ absolutely).
            tol = 1e-5 * float(np.abs(np.asarray(a)).max())
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=tol, err_msg=f"{chunk} {path}")
    # The head gradient is there: the embedding (tied) or lm_head (untied) kernel moves.
    names = {jax.tree_util.keystr(p): np.asarray(a) for p, a in tree_leaves_with_path(r_g)}
    head = [a for n, a in names.items() if ("embedding" if tie else "lm_head") in n]
    assert len(head) == 1 and np.abs(head[0]).max() > 1e-4
    assert tie == (not any("lm_head" in n for n in names))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_train_and_eval_steps_chunked_match_whole(objective):
    """One SGD step (two microbatches) and one eval: chunk 5 of T = 12 against the whole."""
    cfg = _tiny(tie=False)
    mesh = build_mesh(MeshConfig())
    parts = build_model(cfg, 0, mesh)
    batch = _batch(cfg, 2, 2, 12, seed=4)
    tx = optax.sgd(0.5)
    sh = state_shardings(parts, tx, mesh)

    @jax.jit
    def both(state, params, others, batch):  # one program for both chunk sizes' steps
        out = {}
        for chunk in (0, 5):
            step = make_train_step(
                parts.graphdef,
                tx,
                optax.constant_schedule(0.5),
                objective,
                EPS,
                loss_chunk_size=chunk,
            )
            new, metrics = step(state, batch)
            ev = make_eval_step(parts.graphdef, chunk)(params, others, batch)
            out[chunk] = (metrics, new.params, ev)
        return out

    out = jax.device_get(both(new_state(parts, tx, sh, seed=0), parts.params, parts.others, batch))
    (m0, p0, e0), (m5, p5, e5) = out[0], out[5]
    assert m5["token_count"] == m0["token_count"] == e5["token_count"] == e0["token_count"]
    for key in ("loss", "grad_norm", "param_norm") + (
        ("pg_clip_fraction",) if objective == "clipped_pg" else ()
    ):
        np.testing.assert_allclose(m5[key], m0[key], rtol=2e-6, err_msg=key)
    if objective == "clipped_pg":
        assert 0 < m0["pg_clip_fraction"] < 1
    np.testing.assert_allclose(e5["loss_sum"], e0["loss_sum"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p5), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        make_train_step(parts.graphdef, tx, optax.constant_schedule(0.5), loss_chunk_size=-1)


def _big_f32_buffers(hlo: str, elements: int) -> set[str]:
    """f32 shapes in compiled HLO text with at least `elements` elements."""
    shapes = set(re.findall(r"f32\[([\d,]+)\]", hlo))
    return {s for s in shapes if math.prod(int(n) for n in s.split(",")) >= elements}


def test_big_f32_buffers_reads_shapes():
    hlo = "%a = f32[2,512,4096]{2,1,0} fusion(), %b = f32[1000,4096]{1,0} %c = bf16[8,512,4096]"
    assert _big_f32_buffers(hlo, 2 * 512 * 4096) == {"2,512,4096"}
    assert _big_f32_buffers(hlo, 1000 * 4096) == {"2,512,4096", "1000,4096"}


def test_compiled_train_step_holds_no_whole_logits():
    """Compiled (not run): with chunking no float32 buffer as large as [rows, T, V] exists in
    the train step, in any layout ([rows, T, V], [rows * T, V], [chunks, rows, chunk, V]); the
    whole-sequence step has one, and needs several times the temporary memory."""
    # V large enough that no attention buffer is as large: the layer's scores, [rows, heads, T,
    # T] = 2M elements here (scanned layers stack theirs: 4M for two), against 8M logits.
    rows, seq, vocab = 2, 512, 8192
    cfg = _tiny(tie=True, vocab=vocab, seq=seq)
    mesh = build_mesh(MeshConfig())
    parts = build_model(cfg, 0, mesh)
    tx = optax.sgd(0.1)
    state = new_state(parts, tx, state_shardings(parts, tx, mesh), seed=0)
    batch = _batch(cfg, 1, rows, seq, seed=0)
    batch = {k: v for k, v in batch.items() if k not in ("advantages", "old_logprobs")}
    found = {}
    for chunk in (0, 128):
        step = make_train_step(
            parts.graphdef, tx, optax.constant_schedule(0.1), loss_chunk_size=chunk
        )
        compiled = jax.jit(step).lower(state, batch).compile()
        found[chunk] = (
            _big_f32_buffers(compiled.as_text(), rows * seq * vocab),
            compiled.memory_analysis().temp_size_in_bytes,
        )
    (whole_big, whole_temp), (chunk_big, chunk_temp) = found[0], found[128]
    assert whole_big, "the whole-sequence step should hold the [rows, T, V] logits"
    assert not chunk_big, chunk_big
    # Chunking saves at least the whole logits (rows * T * V * 4 = 32 MiB; their gradient is the
    # other big buffer), the rest of the step (attention, activations) being the same.
    assert whole_temp - chunk_temp > rows * seq * vocab * 4, (chunk_temp, whole_temp)


@pytest.mark.parametrize("chunk", [5, 6])
def test_fused_cross_entropy_with_softcap_equals_autodiff(chunk, monkeypatch):
    """The fused chunked cross-entropy (gradient made in the forward pass) against the
    checkpointed chunks that autodiff differentiates, with Gemma's logit soft-cap on."""
    from runtime.train import loss as loss_mod

    x = _arrays(1)

    def run():
        fn = lambda h, w: hidden_loss_sums(  # noqa: E731
            h, w, x["targets"], x["mask"], chunk_size=chunk, softcap=3.0
        )
        return _value_and_grads(fn, x)

    fused = run()
    monkeypatch.setattr(loss_mod, "FUSED_CROSS_ENTROPY", False)
    plain = run()
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-6)
    assert fused[1] == plain[1]
    np.testing.assert_allclose(fused[3], plain[3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused[4], plain[4], rtol=1e-5, atol=1e-6)
    assert np.abs(plain[4]).max() > 1e-2


@functools.cache
def _rounded_reference() -> tuple:
    """The float32 loss and gradients on whole logits rounded to bfloat16, of `_arrays(2)`
    (once for every chunk size compared with it)."""
    x = _arrays(2)

    def rounded(h, w):
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        # Rounded on the way forward only: the gradient stays float32, as in the fused loss
        # (whose logit gradient is made in float32 and cast to the hidden states' dtype).
        rounded = logits.astype(jnp.bfloat16).astype(jnp.float32)
        logits = logits + jax.lax.stop_gradient(rounded - logits)
        return (*cross_entropy_sums(logits, x["targets"], x["mask"]), jnp.zeros(()))

    return _value_and_grads(rounded, x)


@pytest.mark.parametrize("chunk", [0, 6, 7])
def test_bf16_logits_are_the_loss_of_rounded_logits(chunk):
    """logits_dtype bfloat16: the loss and gradients are those of the float32 loss taken on the
    logits rounded to bfloat16 (what MaxText computes), whole or chunked, and close to float32's."""
    x = _arrays(2)

    def ours(dtype):
        return lambda h, w: hidden_loss_sums(  # noqa: E731
            h, w, x["targets"], x["mask"], chunk_size=chunk, logits_dtype=dtype
        )

    ref = _rounded_reference()
    got = _value_and_grads(ours("bfloat16"), x)
    full = _value_and_grads(ours("float32"), x)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    assert got[1] == ref[1]
    np.testing.assert_allclose(got[3], ref[3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[4], ref[4], rtol=1e-5, atol=1e-6)
    assert got[0] != full[0]  # the rounding is real...
    np.testing.assert_allclose(got[0], full[0], rtol=1e-2)  # ...and small
