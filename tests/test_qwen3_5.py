"""Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`): logit parity with transformers'
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (layer patterns, partial M-RoPE, tied and untied
heads, lengths on and off the chunk grid), exact import/export (the experts fused, as the released
MoE checkpoints hold them, or per expert), the released multimodal checkpoint layout
(Qwen3_5{,Moe}ForConditionalGeneration: its language model imported, the vision tower and MTP
head left out in one note), packed documents, cached decode, counts and the real sizes, one train
step equal across meshes, bad settings in one sentence, and one fine-tune that resumes exactly,
exports and samples what transformers generates. CPU only, tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runs import LazyModule  # noqa: E402

torch = LazyModule("torch", "the HF parity tests need torch (CPU)")
transformers = LazyModule("transformers", "the HF parity tests need transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from hf_family import forward, hf_logits_of, logits_of, resume_is_exact  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jobspec.errors import ConfigError  # noqa: E402
from jobspec.families.model_config import ModelConfig  # noqa: E402
from jobspec.files.run_toml import read_toml  # noqa: E402
from jobspec.hf_config import hf_config_from_model, model_fields_from_hf  # noqa: E402
from jobspec.run_config import MeshConfig  # noqa: E402
from runtime.hf.convert import flat_params, model_config_from_hf  # noqa: E402
from runtime.hf.experts import fuse_experts, split_fused_experts  # noqa: E402
from runtime.hf.files import read_safetensors  # noqa: E402
from runtime.model.build import build_model  # noqa: E402
from runtime.model.flops import parameter_counts  # noqa: E402
from runtime.model.hf_weights import hf_from_params, write_hf  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402

from runs import ROOT, tiny_config, xla_flags  # noqa: E402

#: fp32 parity bound; observed differences are ~2e-6.
TOL = 1e-5
#: The delta rule's chunk in these tests (small: the chunked rule's compile time grows with it).
CHUNK = 8
BATCH = np.random.default_rng(0).integers(0, 128, (2, 19)).astype(np.int32)

BASE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=4, max_position_embeddings=256, initializer_range=0.1,
    layer_types=["linear_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
    bos_token_id=2,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
           shared_expert_intermediate_size=20)  # fmt: skip
#: Half the head dim rotated, as M-RoPE sections like the released ones ([11, 11, 10] of 64).
MROPE = dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5,
             mrope_section=[2, 1, 1], mrope_interleaved=True)  # fmt: skip

#: case -> (MoE?, overrides, tokens per row).
CASES = {
    # DeltaNet then full attention, partial M-RoPE, an untied head; 2 chunks and 3 tokens.
    "dense": (False, dict(rope_parameters=MROPE), 19),
    # Full attention first, one value head per key head, conv width 2, a tied head, transformers'
    # default rope (a quarter of the head dim); exactly 2 chunks.
    "dense-tied": (False, dict(layer_types=["full_attention", "linear_attention"],
                               linear_num_value_heads=2, linear_conv_kernel_dim=2,
                               tie_word_embeddings=True), 16),
    # Every layer an MoE with the shared expert; 1 chunk and 5 tokens.
    "moe": (True, dict(rope_parameters=MROPE), 13),
}  # fmt: skip


def text_config(moe: bool, **over):
    conf = {**BASE, **(MOE if moe else {}), **over}
    if moe:
        conf.pop("intermediate_size")
        return transformers.Qwen3_5MoeTextConfig(**conf)
    return transformers.Qwen3_5TextConfig(**conf)


def randomise(model) -> None:
    """Norm weights away from their initial 0 (zero-centred) and 1 (the gated norm)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "norm" in name and "visual" not in name:
                p.uniform_(-0.5, 0.5)


def causal_lm(moe: bool):
    return transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM


def hf_model(tmp: Path, moe: bool = False, **over) -> Path:
    """A text checkpoint; an MoE's experts fused, as the released checkpoints hold them."""
    torch.manual_seed(0)
    model = causal_lm(moe)(text_config(moe, **over)).eval()
    randomise(model)
    model.save_pretrained(tmp, save_original_format=not moe)
    return tmp


#: A tiny vision tower for the multimodal checkpoints (never run: the batches are text).
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)  # fmt: skip


def multimodal_model(
    tmp: Path, moe: bool = False, fused: bool = False, tie: bool = False, **over
) -> Path:
    """A released-style checkpoint: Qwen3_5{,Moe}ForConditionalGeneration (the language model
    under model.language_model.*, a vision tower under model.visual.*), plus two tensors of a
    multi-token-prediction head as the Hub checkpoints carry (`mtp.*`). `fused`: the experts as
    the released checkpoints hold them, else as transformers saves a model it built; `tie`: the
    top-level key ties the head (the text_config's says false)."""
    torch.manual_seed(0)
    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    text = text_config(moe, **over).to_dict()
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    config = cls(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    assert config.text_config.tie_word_embeddings is False
    model = model_cls(config).eval()
    randomise(model)
    model.save_pretrained(tmp, save_original_format=not fused)
    tensors = read_safetensors(tmp)
    d = text["hidden_size"]
    tensors["mtp.fc.weight"] = np.ones((d, 2 * d), np.float32)
    tensors["mtp.norm.weight"] = np.zeros((d,), np.float32)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return tmp


def language_model(path: Path) -> dict[str, np.ndarray]:
    """A multimodal checkpoint's language-model tensors under the text model's names."""
    prefix = "model.language_model."
    return {
        "model." + k[len(prefix) :] if k.startswith(prefix) else k: v
        for k, v in read_safetensors(path).items()
        if k.startswith((prefix, "lm_head."))
    }


def hf_logits(path: Path, batch: np.ndarray, cls) -> np.ndarray:
    return hf_logits_of(cls, path, batch)


def imported(path: Path, **over):
    cfg = model_config_from_hf(path, init_from=f"hf:{path}", **over)
    table = "qwen3_5_moe" if cfg.family == "qwen3_5_moe_text" else "qwen3_5"
    cfg = cfg.model_copy(
        update={table: getattr(cfg, table).model_copy(update={"chunk_size": CHUNK})}
    )
    parts = build_model(cfg, 0, build_mesh(MeshConfig()))
    return cfg, nnx.merge(parts.graphdef, parts.params, *parts.others)


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (HF dir, cfg, our imported model, its rows, its logits): each case's HF model is
    made, imported and compiled once for the tests that share it."""

    def get(case: str) -> tuple:
        if case not in _BUILT:
            moe, over, length = CASES[case]
            src = hf_model(tmp_path_factory.mktemp(case), moe, **over)
            cfg, model = imported(src)
            batch = BATCH[:, :length]
            _BUILT[case] = (src, cfg, model, batch, logits_of(model, batch))
        return _BUILT[case]

    yield get
    _BUILT.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_logit_parity_and_exact_round_trip(tmp_path, built, case):
    src, cfg, model, batch, ours = built(case)
    moe = CASES[case][0]
    assert cfg.family == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    ref = hf_logits(src, batch, causal_lm(moe))
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) < TOL, np.max(np.abs(ours - ref))
    # Import then export reproduces every tensor bit for bit (the tied head aside).
    theirs = read_safetensors(src)
    back = hf_from_params(cfg, flat_params(nnx.state(model, nnx.Param)))
    assert set(theirs) - set(back) <= {"lm_head.weight"} and set(back) <= set(theirs)
    for name, a in back.items():
        assert a.dtype == theirs[name].dtype and np.array_equal(a, theirs[name]), name
    # The export is a text-only checkpoint transformers loads, with the same logits.
    out = tmp_path / "out"
    write_hf(cfg, nnx.state(model, nnx.Param), out)
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == [causal_lm(moe).__name__]
    assert np.max(np.abs(hf_logits(out, batch, causal_lm(moe)) - ref)) == 0.0


@pytest.mark.parametrize("moe", [False, True], ids=["dense-tied", "moe-per-expert"])
def test_multimodal_checkpoint_imports_its_language_model(tmp_path, capsys, moe):
    """A released-style Qwen3_5{,Moe}ForConditionalGeneration checkpoint (the dense one's head
    tied by the top-level key alone; the MoE's experts per expert, as transformers saves a model
    it built): the text model imports with the logits transformers' multimodal model gives text,
    one note line says the vision tower (and the MTP head) were not imported, and the export is
    the language model exactly (the MoE's experts fused)."""
    src = multimodal_model(tmp_path / "mm", moe=moe, tie=not moe)
    cfg, model = imported(src)
    assert cfg.family == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert cfg.tie_word_embeddings is not moe
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(err) == 1, err
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    assert f"multimodal {arch} checkpoint" in err[0]
    assert "model.visual, mtp (vision tower and others: not imported)" in err[0]
    batch = BATCH[:, :10]
    ref = hf_logits(src, batch, getattr(transformers, arch))
    assert np.max(np.abs(logits_of(model, batch) - ref)) < TOL
    out = tmp_path / "out"
    write_hf(cfg, nnx.state(model, nnx.Param), out)
    original = language_model(src)
    if moe:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in original
        original = fuse_experts(original)
    else:
        assert "lm_head.weight" not in original
    exported = read_safetensors(out)
    assert set(exported) == set(original)
    assert all(np.array_equal(a, original[n]) for n, a in exported.items())
    assert np.max(np.abs(hf_logits(out, batch, causal_lm(moe)) - ref)) < TOL


def test_fused_and_per_expert_layouts_hold_the_same_values():
    """transformers' fused stacks (gate rows, then up rows) split into its per-expert tensors and
    fuse back bit for bit; a gate/up stack of odd width is one sentence."""
    rng = np.random.default_rng(0)
    fused = {"x.experts.gate_up_proj": rng.normal(size=(3, 4, 5)),
             "x.experts.down_proj": rng.normal(size=(3, 5, 2)), "x.norm": np.ones(5)}  # fmt: skip
    split = split_fused_experts(fused)
    assert np.array_equal(
        split["x.experts.2.gate_proj.weight"], fused["x.experts.gate_up_proj"][2, :2]
    )
    assert np.array_equal(
        split["x.experts.2.up_proj.weight"], fused["x.experts.gate_up_proj"][2, 2:]
    )
    assert np.array_equal(split["x.experts.1.down_proj.weight"], fused["x.experts.down_proj"][1])
    assert len(split) == 3 * 3 + 1
    back = fuse_experts(split)
    assert set(back) == set(fused) and all(np.array_equal(back[n], a) for n, a in fused.items())
    with pytest.raises(ConfigError, match="'x.experts.gate_up_proj' has shape .* an even second"):
        split_fused_experts({"x.experts.gate_up_proj": np.zeros((2, 3, 4))})


#: The released sizes' published totals: Qwen3.5-27B (27B) and Qwen3.5-397B-A17B (397B, 17B
#: active); the exact figures are transformers' own models of these configs (meta device).
REAL = {"qwen3.5-27b.toml": (26_000_000_000, 28_000_000_000),
        "qwen3.5-397b-a17b.toml": (396_000_000_000, 398_000_000_000)}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_size_files_count_and_round_trip(name):
    data = read_toml(ROOT / "configs/models" / name)
    assert list(data) == ["model"], "a model file holds only a [model] section"
    m = ModelConfig.model_validate(data["model"])
    hf = hf_config_from_model(m.model_dump())
    assert ModelConfig.model_validate({**m.model_dump(), **model_fields_from_hf(hf)}) == m
    moe = m.family == "qwen3_5_moe_text"
    config_cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    with torch.device("meta"):
        theirs = causal_lm(moe)(config_cls.from_dict(hf))
    total = parameter_counts(m)["total"]
    assert total == sum(p.numel() for p in theirs.parameters())
    lo, hi = REAL[name]
    assert lo < total < hi


def test_config_json_round_trip_and_counts(built):
    """Per case: the exported config.json imports back to the same model; the parameter count
    is the model's own and transformers'."""
    for case, (moe, over, _) in CASES.items():
        config = text_config(moe, **over)
        hf_total = sum(p.numel() for p in causal_lm(moe)(config).parameters())
        cfg = ModelConfig(**model_fields_from_hf(config.to_dict()))
        assert parameter_counts(cfg)["total"] == hf_total, case
        hf = hf_config_from_model(cfg.model_dump())
        assert ModelConfig(**model_fields_from_hf(hf)) == cfg, case
        assert ("intermediate_size" in hf) is not moe
    _, cfg, model, _, _ = built("moe")
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert parameter_counts(cfg)["total"] == ours


def test_packed_documents_stay_apart(built):
    """Three documents in one row (across chunk boundaries, one shorter than the conv) give the
    logits each gets alone, through the DeltaNet and the full-attention layer."""
    _, _, model, rows, _ = built("dense")
    docs = [list(BATCH[0, :9]), list(BATCH[1, :2]), list(BATCH[1, 5:13])]
    ids = np.array([sum(docs, [])], np.int32)
    pos = np.array([sum((list(range(len(d))) for d in docs), [])], np.int32)
    seg = np.array([sum(([i + 1] * len(d) for i, d in enumerate(docs)), [])], np.int32)
    packed = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
    start = 0
    for d in docs:
        alone = np.zeros_like(rows)
        alone[0, : len(d)] = d
        got = logits_of(model, alone)[0, : len(d)]
        assert np.max(np.abs(packed[0, start : start + len(d)] - got)) < 1e-5
        start += len(d)


def test_cached_decode_equals_the_full_forward(built):
    """A 4-token prefill, a 4-token block (the chunked rule from the cached state), then one
    token at a time (the recurrent step) give the no-cache logits. (The MoE decodes through the
    same cache: its fine-tune test samples transformers' greedy tokens.)"""
    _, _, model, rows, full = built("dense-tied")
    cache = model.init_cache(rows.shape[0], rows.shape[1])
    assert len(cache.conv) == len(cache.k) == 1
    decode = nnx.jit(lambda m, ids, pos, c: m.decode(ids, pos, c))
    worst, t = 0.0, 0
    for n in [4, 4] + [1] * (rows.shape[1] - 8):
        ids = jnp.asarray(rows[:, t : t + n])
        pos = jnp.broadcast_to(jnp.arange(t, t + n), ids.shape)
        logits, cache = decode(model, ids, pos, cache)
        worst = max(worst, float(np.max(np.abs(np.asarray(logits) - full[:, t : t + n]))))
        t += n
    assert worst < 1e-5, worst


# One subprocess with 8 CPU devices: one train step (SGD at lr 1, so the update is the
# gradient) of the MoE parity case's checkpoint on one device and on expert x fsdp x tensor. The
# MoE model holds every module the dense one has (DeltaNet and attention heads split over
# tensor, the SwiGLU MLP as the shared expert) plus the sparse dispatch and the router bias.
_MESHES = textwrap.dedent(
    """
    import json, sys, jax, jax.numpy as jnp, numpy as np, optax
    from jobspec.run_config import MeshConfig
    from runtime.hf.convert import model_config_from_hf
    from runtime.model.build import build_model
    from runtime.model.sharding import batch_sharding, build_mesh, on_mesh, replicated
    from runtime.train.state import new_state, state_shardings
    from runtime.train.step import make_train_step

    src, chunk = sys.argv[1], int(sys.argv[2])
    cfg = model_config_from_hf(src, init_from=f"hf:{src}", moe_dispatch="sparse",
                               router_bias_update_rate=0.01, qwen3_5_moe={"chunk_size": chunk})
    # Not id 0: transformers' embedding row for the pad id is zeros, whose norm's gradient is
    # huge (1 / sqrt(eps)), and the 1e-5 bound absolute.
    ids = np.random.default_rng(0).integers(1, 128, (1, 8, 13))
    seg = np.where(np.arange(12) < 5, 1, 2)
    batch = {"inputs": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": np.ones((1, 8, 12)),
             "segment_ids": np.broadcast_to(seg, (1, 8, 12)),
             "positions": np.broadcast_to(np.where(seg == 1, np.arange(12), np.arange(12) - 5),
                                          (1, 8, 12))}
    batch = {k: jnp.asarray(v, jnp.float32 if k == "loss_mask" else jnp.int32)
             for k, v in batch.items()}
    tx = optax.sgd(1.0)
    out = []
    for e, f, t in [(1, 1, 1), (2, 2, 2)]:
        mesh = build_mesh(MeshConfig(expert=e, fsdp=f, tensor=t), jax.devices()[: e * f * t])
        parts = build_model(cfg, 0, mesh)  # the checkpoint's weights, laid out on this mesh
        sh = state_shardings(parts, tx, mesh)
        step = make_train_step(parts.graphdef, tx, optax.constant_schedule(1.0),
                               router_bias_update_rate=cfg.router_bias_update_rate)
        step = jax.jit(on_mesh(step, mesh), out_shardings=(sh, replicated(mesh)),
                       in_shardings=(sh, batch_sharding(mesh, 3, leading=1)))
        state = new_state(parts, tx, sh, 0)
        new, metrics = step(state, batch)
        grads = [np.asarray(a) - np.asarray(b)
                 for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params))]
        out.append((float(metrics["loss"]), grads,
                    [np.asarray(b) for b in jax.tree.leaves(new.model_state)]))
    (l0, g0, b0), (l1, g1, b1) = out
    print(json.dumps({"loss": abs(l0 - l1),
                      "grad": max(float(np.max(np.abs(a - b))) for a, b in zip(g0, g1)),
                      "grad_max": max(float(np.max(np.abs(g))) for g in g0),
                      "bias": max(float(np.max(np.abs(a - b))) for a, b in zip(b0, b1)),
                      "moved": max(float(np.max(np.abs(b))) for b in b0)}))
    """
)


def test_one_train_step_is_the_same_on_every_mesh(built):
    """Loss, every gradient and the stepped router bias of one train step on an expert x fsdp x
    tensor = 2 x 2 x 2 mesh (the sparse dispatch's exchange over `expert`) equal one device's
    to 1e-5."""
    src = built("moe")[0]
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _MESHES, str(src), str(CHUNK)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["grad_max"] > 1e-3, row  # a real gradient
    assert row["loss"] < 1e-5 and row["grad"] < 1e-5 and row["bias"] == 0.0, row
    assert row["moved"] == pytest.approx(0.01)


def test_moe_layers_scanned_in_periods_are_the_unrolled_model(tmp_path):
    """Four MoE layers, DeltaNet then full attention twice: a period of 2, 2 repetitions.
    Scanned, the import gives the unrolled logits, exports the checkpoint's tensors bit for bit
    (the experts fused, as read), and the router bias update gives each layer its own row."""
    from runtime.model.moe.layer import update_router_bias

    src = hf_model(tmp_path / "hf", True, num_hidden_layers=4,
                   layer_types=["linear_attention", "full_attention"] * 2)  # fmt: skip
    batch = BATCH[:, :13]
    _, unrolled = imported(src)
    cfg, scanned = imported(src, scan_layers=True)
    ours = logits_of(scanned, batch)
    assert np.max(np.abs(ours - logits_of(unrolled, batch))) < 1e-5  # XLA fuses a scan otherwise
    theirs = read_safetensors(src)
    back = hf_from_params(cfg, flat_params(nnx.state(scanned, nnx.Param)))
    assert set(back) == set(theirs)
    for name, a in back.items():
        assert np.array_equal(a, theirs[name]), name
    graphdef, params, others = nnx.split(scanned, nnx.Param, ...)
    loads = jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(4), 4), jnp.float32)
    moved = nnx.merge(graphdef, params, update_router_bias(others, loads, 1.0)).layers.blocks
    want = np.sign(np.mean(np.asarray(loads), axis=-1, keepdims=True) - np.asarray(loads))
    for j in (0, 1):  # block j of repetition r is layer 2r + j
        np.testing.assert_array_equal(np.asarray(moved[j].mlp.router_bias[...]), want[j::2])


_TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=64)  # fmt: skip
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
               chunk_size=8)  # fmt: skip


def _table(family: str = "qwen3_5_text", top: dict | None = None, **own) -> dict:
    moe = family == "qwen3_5_moe_text"
    table = {**_TINY, "family": family, **({} if moe else {"intermediate_size": 48})}
    if moe:
        table |= {
            k: MOE[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        }
    table["qwen3_5_moe" if moe else "qwen3_5"] = {**_LINEAR, **own}
    return {**table, **(top or {})}


@pytest.mark.parametrize(
    "model, message",
    [
        (_table(layer_types=["linear_attention"]), "model.qwen3_5.layer_types has 1 entries but model.num_layers is 2"),
        (_table(linear_num_value_heads=3), "model.qwen3_5.linear_num_value_heads (3) must be a multiple of model.qwen3_5.linear_num_key_heads (2)"),
        (_table("qwen3_5_moe_text", partial_rotary_factor=0.1), "model.qwen3_5_moe.partial_rotary_factor = 0.1 rotates 1 of model.head_dim = 16 dims"),
        (_table(mrope_section=[1, 1]), "model.qwen3_5.mrope_section"),
        (_table(top={"router_bias_update_rate": 0.01}), "model.router_bias_update_rate needs MoE layers, but qwen3_5_text has none"),
        (_table(top={"num_experts": 4}), "need family = "),
        (_table("qwen3_5_moe_text", top={"num_experts": None}), "qwen3_5_moe_text routes every layer through experts: set model.num_experts"),
        (_table("qwen3_5_moe_text", top={"norm_topk_prob": False}), "model.norm_topk_prob = false is not available for qwen3_5_moe_text"),
        (_table("qwen3_5_moe_text", top={"intermediate_size": 48}), "model.intermediate_size is not used by qwen3_5_moe_text"),
        ({**_table(), "qwen3_5_moe": {"chunk_size": 8}}, "model.qwen3_5_moe needs model.family = 'qwen3_5_moe_text'"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_sentence_naming_the_field(tmp_path, model, message):
    from jobspec.files.run_toml import parse_run_config

    raw = tiny_config(str(tmp_path / "m.json"), str(tmp_path / "runs"))
    raw["model"] = model
    with pytest.raises(ConfigError) as e:
        parse_run_config(raw)
    assert message in str(e.value) and "\n" not in str(e.value).strip()


@pytest.mark.parametrize(
    "moe, change, says",
    [
        (False, {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        (False, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
        (False, {"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        (True, {"output_router_logits": True}, "output_router_logits = true"),
    ],
)  # fmt: skip
def test_unsupported_hf_settings_are_refused_in_one_sentence(tmp_path, moe, change, says):
    conf = {**text_config(moe).to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(tmp_path)
    assert says in str(e.value) and "which jaxjob cannot load" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(ConfigError, match="a model_type 'qwen3_5' config.json needs a text_config"):
        model_config_from_hf(tmp_path)


def test_finetune_resume_export_and_sample(tmp_path, prepared):
    """`model.init_from` a released-style Qwen3_5MoeForConditionalGeneration checkpoint (experts
    fused, an MTP head): 4 steps on packed documents, and 2 steps then a resume to 4, give
    bit-identical losses that fall; `runtime export hf` writes the text model in the source's
    layout, which transformers loads as Qwen3_5MoeForCausalLM with the run's logits, and greedy
    `runtime sample` equals transformers' greedy generate on it."""
    from runtime.commands.hf import export_checkpoint
    from runtime.commands.offline import restore_checkpoint, sample_checkpoint

    src = multimodal_model(tmp_path / "hf", moe=True, fused=True, vocab_size=260)
    cfg, _ = resume_is_exact(
        prepared, tmp_path / "runs", src, model={"qwen3_5_moe": {"chunk_size": CHUNK}}
    )
    assert cfg.model.family == "qwen3_5_moe_text"

    run_dir = tmp_path / "runs" / "whole"
    out = tmp_path / "export"
    # In process (`runtime export hf` and `runtime sample` as subprocesses: test_hf.py's chain).
    export_checkpoint(str(run_dir), "latest", str(out))
    exported, start = read_safetensors(out), language_model(src)
    assert set(exported) == set(start) and "model.layers.0.mlp.experts.gate_up_proj" in start
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.1.mlp.experts.gate_up_proj"):
        assert not np.array_equal(exported[name], start[name])  # the run's weights, trained
    _, _, _, parts, _ = restore_checkpoint(str(run_dir), "latest")
    ours = logits_of(nnx.merge(parts.graphdef, parts.params, *parts.others), BATCH)
    assert np.max(np.abs(ours - hf_logits(out, BATCH, transformers.Qwen3_5MoeForCausalLM))) < TOL

    prompt = [5, 17, 99, 3, 42, 8]
    sampled = sample_checkpoint(
        str(run_dir), "latest", prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=0
    )
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert sampled["new_ids"] == gen[0, len(prompt) :].tolist()
