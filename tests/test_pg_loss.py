"""The clipped policy-gradient objective: loss and gradient against a plain PyTorch reference,
cross-entropy against torch's, a clipped_pg train step that learns, and the honest refusal of
`runtime local` to run clipped_pg on token manifests that carry no advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jobspec.families.model_config import ModelConfig
from jobspec.run_config import MeshConfig
from runtime.commands.cli import main
from runtime.model.build import build_model
from runtime.model.sharding import build_mesh
from runtime.train.loss import clipped_pg_sums, cross_entropy_sums, token_logprobs
from runtime.train.state import new_state, state_shardings
from runtime.train.step import make_train_step

from runs import LazyModule, tiny_config, write_config

torch = LazyModule("torch", "torch is not importable; it is only the reference implementation")

B, T, V = 4, 16, 32
EPS = 0.2


def _inputs(seed: int) -> dict[str, np.ndarray]:
    """Random logits, targets and a mask; old log-probs spread around the current ones so the
    ratios fall on both sides of [1 - eps, 1 + eps]; advantages of both signs."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.7).astype(np.float32)
    logp = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(targets)))
    old = (logp + rng.normal(0.0, 0.4, (B, T))).astype(np.float32)
    adv = rng.normal(0.0, 1.0, (B, T)).astype(np.float32)
    return {"logits": logits, "targets": targets, "mask": mask, "adv": adv, "old": old}


def _torch_pg(x: dict[str, np.ndarray], eps: float):
    """The textbook PPO-clip loss, written directly: (loss sum, count, clipped count, d sum/d logits)."""
    logits = torch.tensor(x["logits"], requires_grad=True)
    targets = torch.tensor(x["targets"], dtype=torch.long)
    mask = torch.tensor(x["mask"]) > 0
    adv = torch.tensor(x["adv"])
    old = torch.tensor(x["old"])
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    ratio = torch.exp(logp - old)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - eps, 1 + eps) * adv
    obj = torch.min(surr1, surr2)
    loss_sum = -torch.where(mask, obj, torch.zeros_like(obj)).sum()
    loss_sum.backward()
    clipped = (mask & (surr2 < surr1)).sum()
    return (
        loss_sum.item(),
        mask.sum().item(),
        clipped.item(),
        logits.grad.numpy(),
        ratio.detach().numpy(),
    )


def _jax_pg(x: dict[str, np.ndarray], eps: float):
    def f(logits):
        s, c, k = clipped_pg_sums(
            logits,
            jnp.asarray(x["targets"]),
            jnp.asarray(x["mask"]),
            jnp.asarray(x["adv"]),
            jnp.asarray(x["old"]),
            eps,
        )
        return s, (c, k)

    (s, (c, k)), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(x["logits"]))
    return float(s), float(c), float(k), np.asarray(g)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipped_pg_matches_torch(seed):
    x = _inputs(seed)
    t_sum, t_count, t_clipped, t_grad, ratio = _torch_pg(x, EPS)
    j_sum, j_count, j_clipped, j_grad = _jax_pg(x, EPS)
    counted = x["mask"] > 0
    # The inputs exercise every branch: ratios either side of the clip range, both signs of A.
    assert (ratio[counted] > 1 + EPS).any() and (ratio[counted] < 1 - EPS).any()
    assert (x["adv"][counted] > 0).any() and (x["adv"][counted] < 0).any()
    assert 0 < t_clipped < t_count
    assert j_count == t_count and j_clipped == t_clipped
    # Value: the per-token mean (sum / count), as training reports it.
    assert abs(j_sum / j_count - t_sum / t_count) <= 1e-6
    np.testing.assert_allclose(j_grad, t_grad, rtol=0, atol=1e-5)
    assert np.abs(t_grad).max() > 1e-3  # a real gradient, not two zeros
    # Masked positions get no gradient at all.
    assert not np.any(j_grad[~counted])


def test_masked_positions_cannot_leak():
    """inf/nan in the advantages or old log-probs of masked positions change nothing."""
    x = _inputs(3)
    dirty = dict(x)
    masked = x["mask"] == 0
    assert masked.any()
    dirty["adv"] = np.where(masked, np.nan, x["adv"]).astype(np.float32)
    dirty["old"] = np.where(masked, -np.inf, x["old"]).astype(np.float32)
    clean_sum, clean_count, clean_clipped, clean_grad = _jax_pg(x, EPS)
    d_sum, d_count, d_clipped, d_grad = _jax_pg(dirty, EPS)
    assert np.isfinite(d_sum) and np.isfinite(d_grad).all()
    assert (d_sum, d_count, d_clipped) == (clean_sum, clean_count, clean_clipped)
    np.testing.assert_array_equal(d_grad, clean_grad)


def test_ratio_one_is_minus_mean_advantage():
    """At ratio 1 (the policy that produced the samples) the loss is -sum(A) over counted tokens
    and its gradient is the plain policy gradient -A * d logp."""
    x = _inputs(4)
    x["old"] = np.asarray(token_logprobs(jnp.asarray(x["logits"]), jnp.asarray(x["targets"])))
    s, c, k, g = _jax_pg(x, EPS)
    assert k == 0
    np.testing.assert_allclose(s, -np.sum(x["adv"] * x["mask"]), rtol=1e-5)

    def pg(logits):
        lp = token_logprobs(logits, jnp.asarray(x["targets"]))
        return -jnp.sum(jnp.asarray(x["adv"] * x["mask"]) * lp)

    np.testing.assert_allclose(g, np.asarray(jax.grad(pg)(jnp.asarray(x["logits"]))), atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_cross_entropy_matches_torch(seed):
    x = _inputs(seed)
    s, c = cross_entropy_sums(
        jnp.asarray(x["logits"]), jnp.asarray(x["targets"]), jnp.asarray(x["mask"])
    )
    ignored = np.where(x["mask"] > 0, x["targets"], -100)
    ref = torch.nn.functional.cross_entropy(
        torch.tensor(x["logits"]).reshape(-1, V),
        torch.tensor(ignored, dtype=torch.long).reshape(-1),
        ignore_index=-100,
    )
    assert float(c) == float(x["mask"].sum())
    assert abs(float(s) / float(c) - ref.item()) <= 1e-6


@pytest.mark.parametrize("loss_chunk_size", [0, 3])  # 3: chunks of seq 8 with a remainder
def test_clipped_pg_train_step_reduces_loss(loss_chunk_size):
    model_cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    mesh = build_mesh(MeshConfig())
    parts = build_model(model_cfg, 0, mesh)
    accum, rows, seq = 2, 2, 8
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_cfg.vocab_size, (accum, rows, seq + 1)).astype(np.int32)
    batch = {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "loss_mask": (rng.random((accum, rows, seq)) < 0.8).astype(np.float32),
        "segment_ids": np.ones((accum, rows, seq), np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (accum, rows, seq)).copy(),
        "advantages": rng.normal(0.0, 1.0, (accum, rows, seq)).astype(np.float32),
    }

    # Old log-probs from the initial policy itself: the first step sees ratio 1 everywhere.
    @jax.jit
    def policy_logprobs(params, b):
        model = nnx.merge(parts.graphdef, params, *parts.others)
        flat = {k: v.reshape(accum * rows, seq) for k, v in b.items()}
        logits = model(flat["inputs"], flat["positions"], flat["segment_ids"])
        return token_logprobs(logits, flat["targets"]).reshape(accum, rows, seq)

    keys = ("inputs", "targets", "positions", "segment_ids")
    batch["old_logprobs"] = np.asarray(policy_logprobs(parts.params, {k: batch[k] for k in keys}))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    tx = optax.adam(1e-2)
    # Laid out as the train loop lays it out, so the step compiles once, not again on step two.
    state = new_state(parts, tx, state_shardings(parts, tx, mesh), seed=0)
    step_fn = jax.jit(
        make_train_step(
            parts.graphdef,
            tx,
            optax.constant_schedule(1e-2),
            objective="clipped_pg",
            pg_clip_epsilon=EPS,
            loss_chunk_size=loss_chunk_size,
        )
    )
    losses = []
    for _ in range(6):
        state, m = step_fn(state, batch)
        m = jax.device_get(m)
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
        assert m["token_count"] == float(np.asarray(batch["loss_mask"]).sum())
        losses.append(float(m["loss"]))
    counted = np.asarray(batch["loss_mask"]) > 0
    adv = np.asarray(batch["advantages"])
    # Step one runs at ratio 1: its loss is minus the mean advantage over counted tokens.
    np.testing.assert_allclose(losses[0], -adv[counted].mean(), rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0] - 0.05, losses


def test_clipped_pg_step_needs_the_pg_arrays():
    model_cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    parts = build_model(model_cfg, 0, build_mesh(MeshConfig()))
    tx = optax.sgd(0.1)
    step = make_train_step(parts.graphdef, tx, optax.constant_schedule(0.1), objective="clipped_pg")
    ones = jnp.ones((1, 1, 4), jnp.int32)
    batch = {"inputs": ones, "targets": ones, "loss_mask": ones.astype(jnp.float32),
             "segment_ids": ones, "positions": ones}  # fmt: skip
    state = new_state(parts, tx, state_shardings(parts, tx, build_mesh(MeshConfig())), seed=0)
    with pytest.raises(ValueError, match="advantages"):
        step(state, batch)
    with pytest.raises(ValueError, match="objective"):
        make_train_step(parts.graphdef, tx, optax.constant_schedule(0.1), "dpo")


def test_local_refuses_clipped_pg_on_token_manifests(prepared, tmp_path, capsys):
    cfg = tiny_config(
        prepared, str(tmp_path / "runs"), run_id="pg", training={"objective": "clipped_pg"}
    )
    path = write_config(tmp_path / "pg.toml", cfg)
    with pytest.raises(SystemExit) as exc:
        main(["local", str(path)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert int(exc.value.code or 0) == 2
    assert len(lines) == 1 and "Traceback" not in err, err
    assert (
        "training.objective = 'clipped_pg' needs per-token advantages and old_logprobs but "
        in lines[0]
    )
    assert "is a text token stream" in lines[0] and "--format rollouts" in lines[0]
    # Ended before training: no checkpoint was written.
    assert not list((tmp_path / "runs").rglob("checkpoints/*/"))
