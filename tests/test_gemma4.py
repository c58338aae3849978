"""Gemma 4 (`gemma4_text`): logit parity with transformers' Gemma4ForCausalLM over a matrix of
features, exact import/export, the multimodal checkpoint layout, KV-cache decode, packing, bad
configs in one sentence, and a short fine-tune that resumes exactly and exports. CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the HF parity tests need torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the HF parity tests need transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jobspec.errors import ConfigError  # noqa: E402
from jobspec.run_config import MeshConfig, ModelConfig  # noqa: E402
from runtime.hf.convert import (  # noqa: E402
    flat_params,
    hf_from_params,
    load_hf_params,
    model_config_from_hf,
    write_hf,
)
from runtime.hf.files import read_safetensors  # noqa: E402
from runtime.model.build import build_model  # noqa: E402
from runtime.model.flops import parameter_counts  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402

#: fp32 parity bound (the issue's); observed differences are ~1e-6.
TOL = 1e-4
WINDOW = 4
BATCH = np.array([[1, 5, 9, 77, 3, 120, 64, 2, 11, 40], [100, 0, 42, 42, 7, 19, 88, 127, 5, 6]], np.int32)

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    sliding_window=WINDOW, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
    bos_token_id=2, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)  # fmt: skip
PER_LAYER = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)

#: Each case turns features on and off; "all-on" has every one at once.
CASES = {
    "sliding-full": {},
    "per-layer-inputs": PER_LAYER,
    "kv-shared": dict(num_kv_shared_layers=2),
    "k-eq-v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "moe": MOE,
    "double-wide": dict(num_kv_shared_layers=2, use_double_wide_mlp=True),
    "untied-no-softcap": dict(tie_word_embeddings=False, final_logit_softcapping=None),
    "last-layer-forced-full": dict(layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 2),
    "default-layer-types": dict(layer_types=None, num_hidden_layers=7),
    "all-on": dict(
        **PER_LAYER, **MOE, num_kv_shared_layers=2, attention_k_eq_v=True,
        num_global_key_value_heads=1, use_double_wide_mlp=True,
    ),
}  # fmt: skip


def hf_config(**over):
    return transformers.Gemma4TextConfig(**{**BASE, **over})


def randomise(model) -> None:
    """Norm weights, layer scalars, router scales away from 1, so each one is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)


def hf_model(tmp: Path, seed: int = 0, **over) -> Path:
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(hf_config(**over)).eval()
    randomise(model)
    model.save_pretrained(tmp)
    return tmp


def hf_logits(path: Path, batch: np.ndarray, cls=None) -> np.ndarray:
    cls = cls or transformers.Gemma4ForCausalLM
    model = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        # output_hidden_states: transformers 5.23 otherwise slices the KV-shared layers' inputs
        # and fails on a model without per-layer inputs (None[:, ...]); the logits are the same.
        ids = torch.from_numpy(batch.astype(np.int64))
        return model(ids, output_hidden_states=True).logits.numpy()


def positions_of(batch: np.ndarray) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)


def imported(path: Path, **over):
    cfg = model_config_from_hf(path, init_from=f"hf:{path}", **over)
    parts = build_model(cfg, 0, build_mesh(MeshConfig()))
    return cfg, nnx.merge(parts.graphdef, parts.params, *parts.others)


@pytest.mark.parametrize("case", list(CASES))
def test_logit_parity_and_exact_round_trip(tmp_path, case):
    src = hf_model(tmp_path / "hf", **CASES[case])
    ref = hf_logits(src, BATCH)
    cfg, model = imported(src)
    ours = np.asarray(model(jnp.asarray(BATCH), positions_of(BATCH)))
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) < TOL, np.max(np.abs(ours - ref))
    # Import then export reproduces every tensor bit for bit (the tied head aside).
    theirs = read_safetensors(src)
    back = hf_from_params(cfg, flat_params(nnx.state(model, nnx.Param)))
    ignored = {n for n in theirs if n not in back}
    assert ignored <= {"lm_head.weight"}
    for name, a in back.items():
        assert a.dtype == theirs[name].dtype and np.array_equal(a, theirs[name]), name
    # Export loads in transformers with the same logits.
    out = tmp_path / "out"
    write_hf(cfg, nnx.state(model, nnx.Param), out)
    assert np.max(np.abs(hf_logits(out, BATCH) - ref)) == 0.0
