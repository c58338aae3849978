"""The qwen2 family (Qwen2: a bias on q/k/v, no q/k norm) against transformers' Qwen2: logit
parity through an HF import, scanned and unrolled, tied and untied; exact tensor round trips;
its config.json both ways; counts that match the parameters; cached decoding. CPU only, nothing
downloaded."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runs import LazyModule  # noqa: E402

torch = LazyModule("torch", "the HF parity tests need torch (CPU)")
transformers = LazyModule("transformers", "the HF parity tests need transformers")

from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jobspec.hf_config import hf_config_from_model, model_fields_from_hf  # noqa: E402
from jobspec.run_config import MeshConfig  # noqa: E402
from runtime.hf.convert import flat_params, model_config_from_hf  # noqa: E402
from runtime.hf.files import SINGLE  # noqa: E402
from runtime.model.build import build_model  # noqa: E402
from runtime.model.flops import parameter_counts  # noqa: E402
from runtime.model.generate import generate  # noqa: E402
from runtime.model.hf_weights import write_hf  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402

TOL = 1e-4
BATCH = np.array([[1, 5, 9, 77, 3, 120, 64, 2], [100, 0, 42, 42, 7, 19, 88, 127]], np.int32)


def _hf_model(tmp: Path, *, tied: bool) -> Path:
    """A tiny random Qwen2ForCausalLM saved to `tmp`; norms and the (zero-initialised) q/k/v
    biases randomised, so the parity sees them."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=tied,
        max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp)
    return tmp


def _hf_logits(path: Path, batch: np.ndarray) -> np.ndarray:
    model = transformers.Qwen2ForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(torch.from_numpy(batch.astype(np.int64))).logits.numpy()


def _import(path: Path, **overrides):
    cfg = model_config_from_hf(path, init_from=f"hf:{path}", **overrides)
    parts = build_model(cfg, 0, build_mesh(MeshConfig()))
    return cfg, parts, nnx.merge(parts.graphdef, parts.params, *parts.others)


def _logits(model, batch: np.ndarray) -> np.ndarray:
    positions = jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)
    return np.asarray(model(jnp.asarray(batch), positions))


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logit_parity_and_exact_round_trip(tmp_path, tied, scan):
    src = _hf_model(tmp_path / "hf", tied=tied)
    cfg, parts, model = _import(src, scan_layers=scan)
    assert cfg.family == "qwen2" and cfg.tie_word_embeddings is tied and cfg.scan_layers is scan
    bias = (
        ("layers", "self_attn", "k_proj", "bias")
        if scan
        else ("layers", 0, "self_attn", "k_proj", "bias")
    )
    assert bias in flat_params(parts.params)
    diff = float(np.max(np.abs(_logits(model, BATCH) - _hf_logits(src, BATCH))))
    print(f"qwen2 import max abs diff: {diff:.3g}")
    assert diff <= TOL

    out = tmp_path / "exported"
    write_hf(cfg, parts.params, out)
    original, back = load_file(str(src / SINGLE)), load_file(str(out / SINGLE))
    assert sorted(original) == sorted(back)
    for name, a in original.items():
        assert a.dtype == back[name].dtype and a.tobytes() == back[name].tobytes(), name
    np.testing.assert_array_equal(_hf_logits(out, BATCH), _hf_logits(src, BATCH))


def test_config_json_round_trip_and_counts(tmp_path):
    src = _hf_model(tmp_path / "hf", tied=False)
    cfg, parts, _ = _import(src)
    hf = hf_config_from_model(cfg.model_dump())
    assert hf["model_type"] == "qwen2" and hf["architectures"] == ["Qwen2ForCausalLM"]
    assert "attention_bias" not in hf  # Qwen2's q/k/v always carry a bias
    # Imported back, the same model (head_dim now spelled out), so a second export is the first.
    fields = model_fields_from_hf(hf)
    assert {k: getattr(cfg, k) for k in fields if k != "head_dim"} == {
        k: v for k, v in fields.items() if k != "head_dim"
    }
    assert fields["head_dim"] == cfg.resolved_head_dim
    assert hf_config_from_model({**cfg.model_dump(), **fields}) == hf
    counts = parameter_counts(cfg)
    assert counts["total"] == sum(x.size for x in jax.tree.leaves(parts.params))


def test_cached_decode_matches_the_full_forward(tmp_path):
    src = _hf_model(tmp_path / "hf", tied=True)
    _, _, model = _import(src, scan_layers=False)
    prompt = [1, 5, 9, 77]
    out = generate(model, prompt, max_new_tokens=4, temperature=0.0, top_k=None, seed=0)
    ids = list(prompt)
    for _ in range(4):  # greedy, one full forward per token
        ids.append(int(np.argmax(_logits(model, np.array([ids], np.int32))[0, -1])))
    assert out["tokens"] == ids[len(prompt) :]
