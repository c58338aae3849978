"""The run-config contract: shipped configs, README reference, overrides, FLOPs and peaks."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from flax import nnx

from jobspec.accelerators import peak_bf16_flops
from jobspec.docs import readme_block
from jobspec.load import load_run_config, parse_run_config, to_toml
from jobspec.run_config import ModelConfig
from runtime.commands.cli import _overrides
from runtime.model.flops import flops_per_token, parameter_counts
from runtime.model.qwen3 import Decoder
from runtime.run.compat import fingerprint

from runs import ROOT


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path):
    cfg, _ = load_run_config(path)
    assert cfg.training.total_steps > 0
    assert (
        parse_run_config(__import__("tomllib").loads(to_toml(cfg))) == cfg
    )  # serialise round trip


def test_readme_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    assert readme_block() in readme, (
        "README config reference is stale: run `python -m jobspec.docs --write`"
    )


def test_smoke_resume_continues_smoke():
    smoke, _ = load_run_config(ROOT / "configs/smoke.toml")
    more, _ = load_run_config(ROOT / "configs/smoke_resume.toml")
    fp = dict(manifest_fingerprint="m", tokenizer_id="byte")
    assert fingerprint(smoke, **fp) == fingerprint(more, **fp)
    assert more.run.id == smoke.run.id
    assert more.training.target_tokens > smoke.training.target_tokens


def test_overrides_parse_toml_literals():
    assert _overrides(
        ("training.target_tokens=2000", "data.order=sequential", "model.tie_word_embeddings=false")
    ) == {
        "training": {"target_tokens": 2000},
        "data": {"order": "sequential"},
        "model": {"tie_word_embeddings": False},
    }


@pytest.mark.parametrize(
    "kind,name,peak",
    [  # the vendors' dense (no sparsity) bf16 FLOP/s per chip
        ("TPU v4", "tpu-v4", 275e12),
        ("TPU v5 lite", "tpu-v5e", 197e12),
        ("TPU v5p", "tpu-v5p", 459e12),
        ("TPU v6 lite", "tpu-v6e", 918e12),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312e12),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312e12),
        ("NVIDIA H100 80GB HBM3", "h100-80gb", 989e12),
        ("NVIDIA H100 PCIe", "h100-pcie", 756e12),
        ("NVIDIA H200", "h200", 989e12),
    ],
)
def test_known_peaks(kind, name, peak):
    assert peak_bf16_flops(kind) == (name, peak)


@pytest.mark.parametrize(
    "kind", ["cpu", "TFRT_CPU_0", "NVIDIA GeForce RTX 4090", "Some Future Chip"]
)
def test_unknown_devices_get_no_peak(kind):
    assert peak_bf16_flops(kind) is None


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_match_the_model(tied):
    cfg = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, tie_word_embeddings=tied)  # fmt: skip
    model = Decoder(cfg, rngs=nnx.Rngs(params=0))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    counts = parameter_counts(cfg)
    assert counts["total"] == actual
    f = flops_per_token(cfg, seq_len=16)
    # The head matmul counts once either way; the input embedding is a lookup, never counted.
    assert f["params_counted"] == actual - 97 * 32 + (97 * 32 if tied else 0)
    assert f["attention"] == 12 * 2 * 16 * 4 * 8
    assert f["total"] == 6 * f["params_counted"] + f["attention"]
