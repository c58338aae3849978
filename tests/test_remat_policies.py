"""The remat policies between block and full: what each layer keeps, that training under them is
exactly training under full, a bad name is one sentence, and `--fit` searches them."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jobspec.families.model_config import ModelConfig
from jobspec.files.run_toml import merge, parse_run_config
from runtime.commands.preflight import memory_estimate
from runtime.model.layers import REMAT_POLICIES
from runtime.model.qwen3.decoder import Qwen3Decoder as Decoder
from runtime.plan import fit
from runtime.train.loop import train
from runtime.train.program import compile_first_fitting, remat_choices

from runs import ROOT, read_jsonl, tiny_config

#: Splash runs in Pallas interpret mode on CPU; it takes lengths that are multiples of 128.
SPLASH_MODEL = {"vocab_size": 260, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 64,
                "max_position_embeddings": 128, "attention": "splash"}  # fmt: skip


def test_every_config_name_has_a_policy() -> None:
    names = typing.get_args(ModelConfig.model_fields["remat"].annotation)
    assert set(names) == {"none", *REMAT_POLICIES}
    # --fit compiles concrete policies; "auto" is a choice among them made at compile time.
    assert set(names) == {*fit.REMAT_ORDER, "auto"}


def test_auto_compiles_attention_on_a_tpu_and_full_where_attention_does_not_fit() -> None:
    cfg = parse_run_config(tiny_config("unused", "runs", model={"remat": "auto"}))
    assert remat_choices(cfg, "tpu") == ("attention", "full")
    # Without the splash kernel "attention" keeps nothing more than "full".
    assert remat_choices(cfg, "cpu") == remat_choices(cfg, "gpu") == ("full",)
    xla = parse_run_config(
        tiny_config("unused", "runs", model={"remat": "auto", "attention": "xla"})
    )
    assert remat_choices(xla, "tpu") == ("full",)
    block = parse_run_config(tiny_config("unused", "runs", model={"remat": "block"}))
    assert remat_choices(block, "tpu") == ("block",)

    tried: list[str] = []

    def compile_one(c, oom: set[str], returns: bool):
        tried.append(c.model.remat)
        if c.model.remat in oom:
            err = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
            if returns:
                return c, err
            raise err
        return c, "compiled"

    for returns in (False, True):  # the plan returns the compiler's error, a run's compile raises
        tried.clear()
        prog, out = compile_first_fitting(cfg, "tpu", lambda c, r=returns: compile_one(c, set(), r))
        assert (prog.model.remat, out, tried) == ("attention", "compiled", ["attention"])
        tried.clear()
        prog, out = compile_first_fitting(
            cfg, "tpu", lambda c, r=returns: compile_one(c, {"attention"}, r)
        )
        assert (prog.model.remat, out, tried) == ("full", "compiled", ["attention", "full"])
    # Neither fits: the plan gets the last error, a run raises it; any other error is raised.
    prog, out = compile_first_fitting(
        cfg, "tpu", lambda c: compile_one(c, {"attention", "full"}, True)
    )
    assert prog.model.remat == "full" and isinstance(out, RuntimeError)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        compile_first_fitting(cfg, "tpu", lambda c: compile_one(c, {"attention", "full"}, False))

    def broken(c):
        raise ValueError("not a memory error")

    with pytest.raises(ValueError, match="not a memory error"):
        compile_first_fitting(cfg, "tpu", broken)


def test_preflight_estimates_every_policy() -> None:
    base = tiny_config("unused", "runs", model={"attention": "splash"})
    kept = {
        remat: memory_estimate(parse_run_config(merge(base, {"model": {"remat": remat}})), 1)
        for remat in fit.REMAT_ORDER
    }
    acts = {remat: e["parts"]["activations"] for remat, e in kept.items()}
    assert acts["attention_host"] == acts["full"] < acts["attention"] < acts["block"] < acts["none"]


def _residuals(capsys, remat: str) -> list[str]:
    """The residuals a scanned splash decoder keeps for its backward pass under `remat`."""
    cfg = ModelConfig(**{**SPLASH_MODEL, "vocab_size": 97}, remat=remat)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    ids, pos = jnp.zeros((1, 128), jnp.int32), jnp.arange(128)[None]
    capsys.readouterr()
    print_saved_residuals(lambda p: nnx.merge(graphdef, p)(ids, pos).sum(), params)
    return [line.split(" ")[0] for line in capsys.readouterr().out.splitlines()]


def test_attention_policies_keep_the_kernels_output_per_layer(capsys) -> None:
    # Stacked over the 2 layers: the kernel's output [L, B, H, T, D] and log-sum-exp [L, B, H, T]
    # (in host memory for attention_host), beside the block inputs [L, B, T, hidden] all keep.
    kernel = ["f32[2,1,4,128,8]", "f32[2,1,4,128]"]
    host = ["f32<host>[2,1,4,128,8]", "f32<host>[2,1,4,128]"]
    kept = {remat: _residuals(capsys, remat) for remat in ("full", "attention", "attention_host")}
    for remat, out in kept.items():
        assert "f32[2,1,128,32]" in out, (remat, out)
    assert not set(kernel + host) & set(kept["full"])
    assert set(kernel) <= set(kept["attention"]) and not set(host) & set(kept["attention"])
    assert set(host) <= set(kept["attention_host"]) and not set(kernel) & set(
        kept["attention_host"]
    )


def _losses(tmp_path: Path, prepared: str, remat: str) -> list[float]:
    run = tiny_config(
        prepared, str(tmp_path), run_id=f"r-{remat.replace('_', '-')}", model=SPLASH_MODEL | {"remat": remat},
        training={"seq_len": 128, "global_batch_size": 2, "target_tokens": 128 * 2 * 3, "loss_chunk_size": 0},
    )  # fmt: skip
    train(parse_run_config(run), "# test\n", resume=False, emit=lambda _line: None)
    return [r["loss"] for r in read_jsonl(tmp_path / run["run"]["id"] / "metrics/train.jsonl")]


@pytest.fixture(scope="module")
def full_losses(tmp_path_factory, prepared) -> list[float]:
    return _losses(tmp_path_factory.mktemp("full"), prepared, "full")


@pytest.mark.parametrize("remat", ["attention", "attention_host"])
def test_attention_policies_train_as_full(tmp_path, prepared, remat, full_losses):
    losses = _losses(tmp_path, prepared, remat)
    assert len(losses) == 3
    np.testing.assert_array_equal(losses, full_losses)


def test_a_remat_name_that_is_not_a_policy_is_one_sentence(tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "runtime", "plan", "configs/tiny_plan.toml", "--accelerator", "cpu",
         "--set", "model.remat=attn"],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model.remat" in lines[0]
    assert "'attention', 'attention_host'" in lines[0] and "(got 'attn')" in lines[0]


def test_fit_tries_the_attention_policies_with_splash_only() -> None:
    seq = {"seq_len": 512, "target_tokens": 8 * 512}
    run = tiny_config("unused", "runs", model={"max_position_embeddings": 512}, training=seq)
    cfg = parse_run_config(run)
    by_kernel: dict[str, list[str]] = {}
    for c in fit.candidates(cfg, "tpu", batch_shards=1):
        if c.accumulation == 1 and c.loss_chunk_size == 256:
            by_kernel.setdefault(c.attention, []).append(c.remat)
    assert by_kernel == {
        "splash": ["full", "attention_host", "attention", "block", "none"],
        "xla": ["full", "block", "none"],
    }
    assert {c.remat for c in fit.candidates(cfg, "gpu", 1)} == {"full", "block", "none"}
    # A policy that does not fit rules out those that keep more, never one that keeps less.
    one = {r: fit.Candidate("splash", r, 256, 1) for r in fit.REMAT_ORDER}
    assert one["attention"].needs_at_least(one["attention_host"])
    assert one["block"].needs_at_least(one["attention"])
    assert not one["attention_host"].needs_at_least(one["attention"])
