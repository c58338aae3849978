"""Training correctness: exact resume, exact accumulation, document masks, signals, eval/sample."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jobspec.families.model_config import ModelConfig
from jobspec.files.run_toml import parse_run_config
from jobspec.run_config import MeshConfig
from runtime.commands.offline import eval_checkpoint, restore_checkpoint, sample_checkpoint
from runtime.data.loader import TokenBatches
from runtime.data.manifest import load_manifest
from runtime.model.build import build_model
from runtime.model.qwen3.decoder import Qwen3Decoder
from runtime.model.sharding import batch_sharding, build_mesh
from runtime.train.loop import train
from runtime.train.loss import cross_entropy_sums
from runtime.train.state import new_state, state_shardings
from runtime.train.step import make_train_step

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config


def _train(cfg_dict: dict, **kw):
    cfg = parse_run_config(cfg_dict)
    return train(cfg, "# test\n", emit=lambda _line: None, **kw)


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics/train.jsonl")]


def _final_params(run_dir: Path):
    _, _, step, parts, _ = restore_checkpoint(str(run_dir), "latest")
    return step, jax.tree.leaves(jax.device_get(parts.params))


def test_resume_is_exact(tmp_path, prepared):
    out = str(tmp_path)
    # 4 steps as most runs here: their compiled step is in the session's compilation cache.
    four = {"target_tokens": 16 * 8 * 4}
    base = tiny_config(prepared, out, run_id="whole", checkpoint={"every": 2}, training=four)
    r = _train(base, resume=False)
    assert r.status == "completed" and r.summary["steps"] == 4

    split = tiny_config(prepared, out, run_id="split", checkpoint={"every": 2}, training=four)
    r1 = _train(split, resume=False, max_steps=2)
    assert r1.status == "stopped" and r1.summary["steps"] == 2
    r2 = _train(split, resume=True)
    assert r2.status == "completed"

    whole, parted = _losses(tmp_path / "whole"), _losses(tmp_path / "split")
    assert len(whole) == len(parted) == 4
    assert whole == parted  # bitwise on CPU
    s1, p1 = _final_params(tmp_path / "whole")
    s2, p2 = _final_params(tmp_path / "split")
    assert s1 == s2 == 4
    assert all(np.array_equal(a, b) for a, b in zip(p1, p2, strict=True))
    events = [e["event"] for e in read_jsonl(tmp_path / "split/events.jsonl")]
    assert events.count("start") == 1 and events.count("resume") == 1 and events[-1] == "finish"
    # Every attempt ran the step compiled beside the model's build (program.py AheadStep), and
    # the bitwise equality above holds with it.
    for run in ("whole", "split"):
        firsts = [
            e for e in read_jsonl(tmp_path / run / "events.jsonl") if e["event"] == "first_step"
        ]
        assert firsts and all(e["compiled_ahead"] for e in firsts), firsts


def test_a_resumed_run_with_another_schedule_length_compiles_its_own_step(tmp_path, prepared):
    """The step compiled ahead bakes in a schedule length; a resumed run keeps its checkpoint's
    (here 4 steps, where a fresh run of 6 would decay over 6), read from the checkpoint before
    the step is lowered: the step compiled ahead is the run's own, and the learning rates say
    so."""
    cfg = tiny_config(prepared, str(tmp_path), run_id="sched",
                      training={"target_tokens": 16 * 8 * 4})  # fmt: skip
    _train(cfg, resume=False)
    longer = tiny_config(prepared, str(tmp_path), run_id="sched",
                         training={"target_tokens": 16 * 8 * 6})  # fmt: skip
    _train(longer, resume=True)
    firsts = [e for e in read_jsonl(tmp_path / "sched/events.jsonl") if e["event"] == "first_step"]
    assert [e["compiled_ahead"] for e in firsts] == [True, True], firsts
    rows = read_jsonl(tmp_path / "sched/metrics/train.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    # Past its 4-step decay the schedule rests at its floor; a 6-step one would still fall.
    assert len({r["lr"] for r in rows[4:]}) == 1 and rows[4]["lr"] < rows[3]["lr"]


def test_raising_target_tokens_continues(tmp_path, prepared):
    cfg = tiny_config(prepared, str(tmp_path), run_id="grow",
                      optimizer={"schedule": {"decay_steps": 4}},
                      training={"target_tokens": 16 * 8 * 4})  # fmt: skip
    _train(cfg, resume=False)
    longer = tiny_config(prepared, str(tmp_path), run_id="grow",
                         optimizer={"schedule": {"decay_steps": 4}},
                         training={"target_tokens": 16 * 8 * 6})  # fmt: skip
    r = _train(longer, resume=True)
    assert r.summary["steps"] == 6
    rows = read_jsonl(tmp_path / "grow/metrics/train.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 7))


def _one_update(model_cfg: ModelConfig, batches: TokenBatches, mesh):
    """Parameter change of one step under plain SGD(lr=1): minus the (accumulated) gradient,
    without Adam's normalisation amplifying rounding in near-zero gradients."""
    parts = build_model(model_cfg, 0, mesh)
    tx = optax.sgd(1.0)
    state = new_state(parts, tx, state_shardings(parts, tx, mesh), seed=0)
    before = jax.device_get(parts.params)
    step_fn = jax.jit(make_train_step(parts.graphdef, tx, optax.constant_schedule(1.0)))
    b_sh = batch_sharding(mesh, 3, leading=1)
    shape = (batches.accum, batches.global_batch_size, batches.seq_len)
    batch = {
        k: jax.make_array_from_process_local_data(b_sh, v, shape)
        for k, v in batches.read_step(0).items()
    }
    after, metrics = step_fn(state, batch)
    update = jax.tree.map(
        lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(after.params), before
    )
    return jax.tree.leaves(update), jax.device_get(metrics)


def test_gradient_accumulation_is_exact(prepared):
    manifest = load_manifest(prepared)
    model_cfg = ModelConfig(vocab_size=260, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    mesh = build_mesh(MeshConfig())
    common = dict(split="train", seq_len=16, order="document_buffer", seed=3)
    big = TokenBatches(manifest, global_batch_size=8, accum=1, **common)
    small = TokenBatches(manifest, global_batch_size=2, accum=4, **common)
    assert np.array_equal(big.record_ids(0), small.record_ids(0))  # the same rows, split 1x8 vs 4x2
    u_big, m_big = _one_update(model_cfg, big, mesh)
    u_small, m_small = _one_update(model_cfg, small, mesh)
    assert m_big["token_count"] == m_small["token_count"]
    np.testing.assert_allclose(m_big["loss"], m_small["loss"], rtol=1e-6)
    for a, b in zip(u_big, u_small, strict=True):
        scale = np.abs(a).max()
        assert scale > 0
        # fp32 rounding of the gradients, plus that of new - old for parameters near 1.0 (norms).
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale + 4e-7)


def test_document_masks_isolate_documents(prepared):
    """A packed row's loss equals the sum of its documents' losses computed alone, and masked
    positions (the synthetic join into the next document) contribute nothing."""
    manifest = load_manifest(prepared)
    batches = TokenBatches(
        manifest, "train", seq_len=48, global_batch_size=4, order="document_buffer", seed=1
    )
    cfg = ModelConfig(vocab_size=260, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = Qwen3Decoder(cfg, rngs=nnx.Rngs(params=0))
    # One compiled program for the packed rows and one for a document alone, right-padded to
    # the row's length (causal: the padding after a document never reaches its logits; its
    # targets are not counted).
    packed_fn = nnx.jit(lambda m, ids, pos, seg: m(ids, pos, seg))
    alone_fn = nnx.jit(
        lambda m, ids, pos, targets, mask: cross_entropy_sums(m(ids, pos), targets, mask)
    )
    keys, found = ("inputs", "targets", "loss_mask"), 0
    for step in range(40):
        b = {k: v[0] for k, v in batches.read_step(step).items()}  # [rows, T]
        for r in range(b["inputs"].shape[0]):
            seg = b["segment_ids"][r]
            if len(np.unique(seg)) < 2:
                continue
            found += 1
            row = {k: jnp.asarray(v[r : r + 1]) for k, v in b.items()}
            logits = packed_fn(model, row["inputs"], row["positions"], row["segment_ids"])
            total, count = cross_entropy_sums(logits, row["targets"], row["loss_mask"])
            parts_sum, parts_count = 0.0, 0.0
            for s in np.unique(seg):
                idx = np.nonzero(seg == s)[0]
                # No other document in the call: only this one's tokens, then padding (its
                # positions continue the document's, so it comes after it either way).
                pad = len(seg) - len(idx)
                ids, targets, mask = (np.pad(b[k][r, idx], (0, pad))[None] for k in keys)
                pos = b["positions"][r, idx]
                pos = np.concatenate([pos, pos[-1] + 1 + np.arange(pad)])[None]
                ls, c = alone_fn(model, ids, pos, targets, mask)
                parts_sum, parts_count = parts_sum + float(ls), parts_count + float(c)
            np.testing.assert_allclose(float(total), parts_sum, rtol=1e-5)
            assert float(count) == parts_count
            # The join targets are masked: any token there leaves the loss unchanged.
            masked = np.asarray(row["loss_mask"][0]) == 0
            assert masked.any()
            scrambled = np.asarray(row["targets"]).copy()
            scrambled[0, masked] = (scrambled[0, masked] + 17) % 256
            again, _ = cross_entropy_sums(logits, jnp.asarray(scrambled), row["loss_mask"])
            assert float(again) == float(total)
        if found >= 3:
            break
    assert found >= 3, "the data should pack several documents into some rows"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, prepared) -> tuple[dict, Path]:
    """A completed 4-step run with an eval (its config and directory), for the tests that read
    it or must leave it as it is."""
    out = tmp_path_factory.mktemp("finished")
    cfg = tiny_config(prepared, str(out), run_id="inf", evals=[{"name": "val", "batches": 2}],
                      training={"target_tokens": 16 * 8 * 4})  # fmt: skip
    r = _train(cfg, resume=False)
    assert r.summary["best_eval"]["name"] == "val"
    return cfg, out / "inf"


def test_eval_and_sample_from_checkpoint(finished_run):
    run_dir = str(finished_run[1])
    ev = eval_checkpoint(run_dir, "best")
    assert ev["step"] == 4 and ev["results"][0]["token_count"] > 0
    assert Path(ev["path"]).is_file()
    s1 = sample_checkpoint(
        run_dir, "latest", [72, 101], max_new_tokens=8, temperature=1.0, top_k=1, seed=0
    )
    s2 = sample_checkpoint(
        run_dir, "4", [72, 101], max_new_tokens=8, temperature=1.0, top_k=1, seed=5
    )
    assert s1["new_ids"] == s2["new_ids"] and len(s1["new_ids"]) <= 8
    assert json.loads(Path(s1["path"]).read_text())["new_ids"] == s1["new_ids"]


def test_existing_run_is_not_overwritten(tmp_path, finished_run):
    cfg, run_dir = finished_run
    before = (run_dir / "metrics/train.jsonl").read_text()
    path = write_config(tmp_path / "keep.toml", cfg)
    res = run_cli("local", str(path))
    assert res.returncode == 2 and "pass --resume" in res.stderr and "Traceback" not in res.stderr
    assert (run_dir / "metrics/train.jsonl").read_text() == before


def test_cli_inspect_config_and_preflight(tmp_path, prepared):
    cfg = tiny_config(prepared, str(tmp_path), run_id="cli", training={"target_tokens": 16 * 8 * 4})
    path = write_config(tmp_path / "cli.toml", cfg)
    check = run_cli("config", "check", str(path), "--json")
    assert check.returncode == 0, check.stderr
    info = json.loads(check.stdout)
    assert info["tokens_per_step"] == 16 * 8 and info["total_steps"] == 4
    pre = run_cli("preflight", str(path), "--json")
    assert pre.returncode == 0, pre.stdout + pre.stderr
    assert {c["name"] for c in json.loads(pre.stdout)["checks"]} >= {
        "devices",
        "mesh",
        "data",
        "output",
        "memory",
    }
    assert run_cli("local", str(path)).returncode == 0
    ins = run_cli("inspect", str(tmp_path / "cli"), "--json")
    assert ins.returncode == 0, ins.stderr
    rep = json.loads(ins.stdout)
    assert rep["status"] == "completed" and rep["steps"] == 4 and rep["latest_checkpoint"] == 4
    # The plain-text inspect, eval and sample: tests/test_human_output.py.
    ev = run_cli("eval", "checkpoint", str(tmp_path / "cli"), "--checkpoint", "best", "--json")
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["step"] == 4
    args = ["sample", "checkpoint", str(tmp_path / "cli"), "--checkpoint", "latest", "--prompt-ids", "72,101",
            "--max-new-tokens", "5", "--top-k", "1", "--json"]  # fmt: skip
    a = run_cli(*args)  # reproducible from its seed: tests/test_sample.py
    assert a.returncode == 0, a.stderr
    assert len(json.loads(a.stdout)["new_ids"]) == 5
    # A mistyped --prompt-ids is refused before JAX loads (here a jax that cannot be imported).
    stub = tmp_path / "no-jax" / "jax"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('jax was imported')\n")
    path_env = os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))
    bad = run_cli("sample", "checkpoint", str(tmp_path / "cli"), "--prompt-ids", "1,x",
                  env={"PYTHONPATH": path_env})  # fmt: skip
    assert bad.returncode == 2 and "--prompt-ids" in bad.stderr and "Traceback" not in bad.stderr
    assert len(stderr_lines(bad.stderr)) == 1, bad.stderr


@pytest.fixture(scope="module")
def no_remat_losses(tmp_path_factory, prepared) -> list[float]:
    """The losses of 4 steps without remat, the reference both remat cases compare with."""
    out = tmp_path_factory.mktemp("remat")
    a = tiny_config(prepared, str(out), run_id="r-none", training={"target_tokens": 16 * 8 * 4})
    _train(a, resume=False)
    return _losses(out / "r-none")


@pytest.mark.parametrize("remat", ["block", "full"])
def test_remat_trains_the_same(tmp_path, prepared, remat, no_remat_losses):
    b = tiny_config(prepared, str(tmp_path), run_id=f"r-{remat}", training={"target_tokens": 16 * 8 * 4},
                    model={"remat": remat})  # fmt: skip
    _train(b, resume=False)
    np.testing.assert_allclose(no_remat_losses, _losses(tmp_path / f"r-{remat}"), rtol=1e-5)


def test_moe_router_bias_resumes_exactly(tmp_path, prepared):
    """The MoE routing biases are train state: checkpointed and restored, so resume stays exact."""
    # The rate of the eval test below: one compiled step for both.
    moe = {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "router_bias_update_rate": 0.05}  # fmt: skip
    steps = {"target_tokens": 16 * 8 * 4}
    _train(
        tiny_config(prepared, str(tmp_path), run_id="moe-whole", model=moe, training=steps),
        resume=False,
    )
    split = tiny_config(prepared, str(tmp_path), run_id="moe-split", model=moe, training=steps)
    _train(split, resume=False, max_steps=2)
    _train(split, resume=True)
    whole = read_jsonl(tmp_path / "moe-whole/metrics/train.jsonl")
    parted = read_jsonl(tmp_path / "moe-split/metrics/train.jsonl")
    assert [r["loss"] for r in whole] == [r["loss"] for r in parted]
    assert all("expert_load_max_over_mean" in r for r in whole)
    assert [r["expert_load_max_over_mean"] for r in whole] == [
        r["expert_load_max_over_mean"] for r in parted
    ]


def test_moe_router_bias_is_what_evals_route_with(tmp_path, prepared):
    """In-run evals and offline evals both route with the trained biases (the train step donates
    the biases it was given, so an eval holding the initial ones would read deleted arrays)."""
    moe = {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "router_bias_update_rate": 0.05}  # fmt: skip
    cfg = tiny_config(prepared, str(tmp_path), run_id="moe-eval", model=moe,
                      training={"target_tokens": 16 * 8 * 4, "eval_every": 2},
                      evals=[{"name": "validation", "batches": 2}])  # fmt: skip
    assert _train(cfg, resume=False).status == "completed"
    evals = read_jsonl(tmp_path / "moe-eval/metrics/eval.jsonl")
    assert [e["step"] for e in evals] == [2, 4]
    offline = eval_checkpoint(str(tmp_path / "moe-eval"), "latest")["results"][0]
    assert offline["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-6)
    # The biases did move, so routing with the initial ones would be another model.
    _, _, _, parts, _ = restore_checkpoint(str(tmp_path / "moe-eval"), "latest")
    assert any(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(parts.others))


def test_a_checkpoint_the_index_missed_still_counts(tmp_path, prepared):
    """A crash between Orbax's commit and the index write leaves a committed step unindexed;
    starting again must see it (refuse a fresh start, continue on resume) rather than overwrite."""
    from jobspec.errors import ConfigError

    cfg = tiny_config(
        prepared, str(tmp_path), run_id="lost", training={"target_tokens": 16 * 8 * 4}
    )
    assert _train(cfg, resume=False, max_steps=2).status == "stopped"
    (tmp_path / "lost/checkpoints/index.json").unlink()
    with pytest.raises(ConfigError, match="already has checkpoints"):
        _train(cfg, resume=False)
    r = _train(cfg, resume="auto")
    assert r.status == "completed" and r.summary["steps"] == 4
    rows = read_jsonl(tmp_path / "lost/metrics/train.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]


def test_a_failure_is_recorded_at_the_step_it_happened(tmp_path, prepared, monkeypatch):
    """A save that fails at step 4 of a run resumed at step 2 is recorded at step 4, not at the
    attempt's start step (as a disk-full failure once was)."""
    from jobspec.errors import StorageError
    from runtime.run.checkpoint.service import CheckpointService

    cfg = tiny_config(prepared, str(tmp_path), run_id="fails", checkpoint={"every": 2},
                      training={"target_tokens": 16 * 8 * 6})  # fmt: skip
    assert _train(cfg, resume=False, max_steps=2).status == "stopped"
    real_save = CheckpointService.save

    def save(self, step, **kw):
        if step == 4:
            raise StorageError("no space left on device")
        return real_save(self, step, **kw)

    monkeypatch.setattr(CheckpointService, "save", save)
    with pytest.raises(StorageError, match="no space"):
        _train(cfg, resume=True)
    failure = [e for e in read_jsonl(tmp_path / "fails/events.jsonl") if e["event"] == "failure"]
    assert [(f["step"], f["error"]) for f in failure] == [(4, "no space left on device")]
    manifest = json.loads((tmp_path / "fails/manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["steps"] == 4
