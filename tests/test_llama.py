"""Llama 3 (`llama`) and Mistral (`mistral`) against transformers' LlamaForCausalLM and
MistralForCausalLM: logit parity over llama3 RoPE scaling, attention and MLP biases, tied and
untied heads, scanned and unrolled layers and a sliding window; exact import/export; counts and
config.json both ways (the real sizes too); packed documents; cached decode and greedy tokens;
one train step equal on every mesh; bad settings in one sentence; a short fine-tune that resumes
exactly, exports and samples what transformers generates. CPU only, tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runs import LazyModule  # noqa: E402

torch = LazyModule("torch", "the HF parity tests need torch (CPU)")
transformers = LazyModule("transformers", "the HF parity tests need transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from hf_family import forward, logits_of, resume_is_exact  # noqa: E402
from mesh_step import same_step_on_meshes  # noqa: E402

from jobspec.errors import ConfigError  # noqa: E402
from jobspec.families.model_config import ModelConfig  # noqa: E402
from jobspec.files.run_toml import read_toml  # noqa: E402
from jobspec.hf_config import hf_config_from_model, model_fields_from_hf  # noqa: E402
from jobspec.run_config import MeshConfig  # noqa: E402
from runtime.hf.convert import flat_params, model_config_from_hf  # noqa: E402
from runtime.hf.files import read_safetensors  # noqa: E402
from runtime.model.build import build_model  # noqa: E402
from runtime.model.flops import flops_per_token, parameter_counts  # noqa: E402
from runtime.model.generate import generate  # noqa: E402
from runtime.model.hf_weights import hf_from_params, write_hf  # noqa: E402
from runtime.model.llama.decoder import inv_freq  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402

from runs import ROOT, tiny_config  # noqa: E402

#: fp32 parity bound; observed differences are ~1e-7.
TOL = 1e-5
WINDOW = 4
BATCH = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)

#: Llama 3.1's rope_scaling with an original context short enough that the tiny head's eight
#: wavelengths (6 to 20,000 positions at theta 10,000) fall in all three bands: kept (< 64),
#: interpolated (64-256) and stretched (> 256).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ALL_ON = dict(rope_parameters=LLAMA3, attention_bias=True, mlp_bias=True)

#: case -> (family, HF config overrides, our import overrides).
# fmt: off
CASES = {
    # Llama 3.2's shape: llama3 RoPE, the head tied; scanned layers (the default).
    "llama3-tied": ("llama", dict(rope_parameters=LLAMA3, tie_word_embeddings=True), {}),
    # Every Llama feature: llama3 RoPE, q/k/v/o and MLP biases, an untied head; unrolled.
    "all-on-untied": ("llama", dict(ALL_ON, tie_word_embeddings=False), {"scan_layers": False}),
    # Plain RoPE at Llama 3's base, biases on, tied.
    "biases-plain-rope": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
        {},
    ),
    # Mistral: every layer slides a window of 4 over rows of 12.
    "mistral-window": ("mistral", dict(sliding_window=WINDOW, tie_word_embeddings=False), {}),
}
# fmt: on
def _hf(family: str) -> tuple:
    """transformers' (config class, model class) of `family`."""
    name = {"llama": "Llama", "mistral": "Mistral"}[family]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")


def hf_model(tmp: Path, family: str = "llama", seed: int = 0, **over) -> Path:
    """A tiny random HF model saved to `tmp`; norm weights and the (zero-initialised) biases
    randomised, so the parity sees them."""
    torch.manual_seed(seed)
    config_cls, model_cls = _hf(family)
    model = model_cls(config_cls(**{**BASE, **over})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp)
    return tmp


def hf_loaded(path: Path, family: str):
    model = _hf(family)[1].from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def hf_logits(path: Path, batch: np.ndarray, family: str = "llama") -> np.ndarray:
    with torch.no_grad():
        return hf_loaded(path, family)(torch.from_numpy(batch.astype(np.int64))).logits.numpy()


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (HF dir, cfg, our imported model, our logits on BATCH): each case's HF model is
    made, imported and compiled once for the tests that share it."""

    def get(case: str) -> tuple:
        if case not in _BUILT:
            family, hf_over, ours = CASES[case]
            src = hf_model(tmp_path_factory.mktemp(case), family, **hf_over)
            cfg = model_config_from_hf(src, init_from=f"hf:{src}", **ours)
            parts = build_model(cfg, 0, build_mesh(MeshConfig()))
            model = nnx.merge(parts.graphdef, parts.params, *parts.others)
            _BUILT[case] = (src, cfg, model, logits_of(model, BATCH))
        return _BUILT[case]

    yield get
    _BUILT.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_logit_parity_and_exact_round_trip(tmp_path, built, case):
    src, cfg, model, ours = built(case)
    family, _, ours_over = CASES[case]
    assert cfg.family == family and cfg.scan_layers is ours_over.get("scan_layers", True)
    ref = hf_logits(src, BATCH, family)
    diff = float(np.max(np.abs(ours - ref)))
    print(f"{case}: max abs logit difference {diff:.3g}")
    assert diff < TOL
    # Import then export reproduces every tensor bit for bit (a tied head is not saved).
    theirs = read_safetensors(src)
    back = hf_from_params(cfg, flat_params(nnx.state(model, nnx.Param)))
    assert set(back) == set(theirs) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    for name, a in back.items():
        assert a.dtype == theirs[name].dtype and np.array_equal(a, theirs[name]), name
    # The export loads in transformers with the same logits.
    out = tmp_path / "out"
    write_hf(cfg, nnx.state(model, nnx.Param), out)
    assert np.array_equal(hf_logits(out, BATCH, family), ref)


def test_the_llama3_frequencies_are_transformers_own():
    """Llama 3.1 8B's and 3.2 1B's RoPE (real sizes) from our config files equal the inverse
    frequencies transformers computes from the config.json we export, bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("llama-3.1-8b.toml", "llama-3.2-1b.toml"):
        m = ModelConfig.model_validate(read_toml(ROOT / "configs/models" / name)["model"])
        hf = transformers.LlamaConfig(**hf_config_from_model(m.model_dump()))
        theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
        ours = inv_freq(m.resolved_head_dim, m.rope_theta, m.llama.rope_scaling)
        assert scale == 1.0 and np.array_equal(ours, theirs.numpy()), name


#: Parameters on the model cards: meta-llama/Llama-3.2-1B (1.24B), Llama-3.1-8B (8.03B),
#: Llama-3.1-70B (70.6B); the exact figures are those of transformers' models of these configs.
REAL = {"llama-3.2-1b.toml": 1_235_814_400, "llama-3.1-8b.toml": 8_030_261_248,
        "llama-3.1-70b.toml": 70_553_706_496}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_size_files_count_and_round_trip(name):
    data = read_toml(ROOT / "configs/models" / name)
    assert list(data) == ["model"], "a model file holds only a [model] section"
    m = ModelConfig.model_validate(data["model"])
    assert m.family == "llama" and m.llama.rope_scaling is not None
    assert m.tie_word_embeddings is (name == "llama-3.2-1b.toml")
    assert parameter_counts(m)["total"] == REAL[name]
    # Export a config.json, import it: the same model, so a second export is the first.
    hf = hf_config_from_model(m.model_dump())
    assert hf["rope_parameters"]["rope_type"] == "llama3"
    assert ModelConfig.model_validate({**m.model_dump(), **model_fields_from_hf(hf)}) == m


def test_config_json_round_trip_and_counts(built):
    """Per case: the exported config.json imports back to the same model; the parameter count
    is the model's and transformers' own. A released Llama 3.1 config.json (`rope_scaling` and
    a top-level `rope_theta`) reads as its rope_parameters form does."""
    for case, (family, hf_over, ours) in CASES.items():
        config = _hf(family)[0](**{**BASE, **hf_over})
        hf_total = sum(p.numel() for p in _hf(family)[1](config).parameters())
        cfg = ModelConfig(**model_fields_from_hf(config.to_dict()), **ours)
        assert parameter_counts(cfg)["total"] == hf_total, case
        exported = hf_config_from_model(cfg.model_dump())
        assert ModelConfig(**model_fields_from_hf(exported), **ours) == cfg
    _, cfg, model, _ = built("all-on-untied")
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert parameter_counts(cfg)["total"] == sum(int(np.prod(x.shape)) for x in leaves)
    released = {**transformers.LlamaConfig(**BASE).to_dict(), "rope_theta": 10_000.0,
                "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}  # fmt: skip
    del released["rope_parameters"]
    assert ModelConfig(**model_fields_from_hf(released)).llama == cfg.llama.model_copy(
        update={"attention_bias": False, "mlp_bias": False}
    )
    # FLOPs: a sliding window counts the keys a token sees.
    _, mistral, _, _ = built("mistral-window")
    per_key = 12 * 2 * 4 * 16  # layers x heads x head_dim
    assert flops_per_token(mistral, 64)["attention"] == WINDOW * per_key
    assert flops_per_token(cfg, 64)["attention"] == 64 * per_key


def test_packed_documents_stay_apart(built):
    """Three documents in one row give exactly the logits each gets alone, through the sliding
    window (documents longer than it) and through Llama's full attention."""
    docs = [list(BATCH[0, :5]), list(BATCH[1, :2]), list(BATCH[1, 4:9])]
    ids = np.array([sum(docs, [])], np.int32)
    pos = np.array([sum((list(range(len(d))) for d in docs), [])], np.int32)
    seg = np.array([sum(([i + 1] * len(d) for i, d in enumerate(docs)), [])], np.int32)
    for case in ("mistral-window", "all-on-untied"):
        _, _, model, _ = built(case)
        packed = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
        start = 0
        for d in docs:
            alone = np.zeros_like(BATCH)  # right-padded to BATCH's shape: one compile
            alone[0, : len(d)] = d
            got = packed[0, start : start + len(d)]
            assert np.max(np.abs(got - logits_of(model, alone)[0, : len(d)])) < 1e-5, case
            start += len(d)


@pytest.mark.parametrize("case", ["llama3-tied", "mistral-window", "all-on-untied"])
def test_cached_decode_equals_the_full_forward(built, case):
    """A 4-token prefill then one token at a time (past the window for Mistral) give the
    no-cache logits."""
    _, _, model, full = built(case)
    cache = model.init_cache(BATCH.shape[0], BATCH.shape[1])
    decode = nnx.jit(lambda m, ids, pos, c: m.decode(ids, pos, c))
    worst, t = 0.0, 0
    for n in [4] + [1] * (BATCH.shape[1] - 4):
        ids = jnp.asarray(BATCH[:, t : t + n])
        pos = jnp.broadcast_to(jnp.arange(t, t + n), ids.shape)
        logits, cache = decode(model, ids, pos, cache)
        worst = max(worst, float(np.max(np.abs(np.asarray(logits) - full[:, t : t + n]))))
        t += n
    assert worst < 1e-5, worst


def test_greedy_tokens_equal_transformers_generate(built):
    """Greedy decoding through our KV cache picks transformers' tokens (its own cache, the
    sliding window's too) past the window."""
    src, _, model, _ = built("mistral-window")
    prompt = [5, 17, 99, 3, 42, 8]
    ours = generate(model, prompt, max_new_tokens=8, temperature=0.0, top_k=None, seed=0)
    with torch.no_grad():
        gen = hf_loaded(src, "mistral").generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    assert ours["tokens"] == gen[0, len(prompt) :].tolist()


# One subprocess with 4 CPU devices runs one real train step (train_program: the run's jit,
# shardings and chunked loss; SGD at lr 1, so the update is minus the gradient) on packed rows
# for each (model, mesh) and reports the loss and the largest gradient difference from the
# first mesh of that model. (Mistral's window is a mask in the same kernel: one mesh run less.)

_TINY = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=64)  # fmt: skip
#: Every Llama feature, on one device and on fsdp x tensor (heads, MLP and the biases split).
_MESH_CASES = [
    ("llama", {**_TINY, "family": "llama", "llama": {
        "attention_bias": True, "mlp_bias": True,
        "rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 32}}}, mesh)
    for mesh in ({}, {"fsdp": 2, "tensor": 2})
]  # fmt: skip


def test_one_train_step_is_the_same_on_every_mesh():
    for res in same_step_on_meshes(_MESH_CASES):
        where = f"{res['name']} on {res['mesh']}"
        assert res["grad_max"] > 1e-3, where  # a real gradient
        assert abs(res["loss"] - res["ref_loss"]) < 1e-5, where
        assert res["grad_err"] < 1e-5, where


def _model_table(family: str = "llama", **own) -> dict:
    return {"family": family, **_TINY, **({family: own} if own else {})}


@pytest.mark.parametrize(
    "model, message",
    [
        (_model_table(rope_scaling={"low_freq_factor": 4.0, "high_freq_factor": 4.0}),
         "model.llama.rope_scaling.high_freq_factor (4.0) must exceed model.llama.rope_scaling.low_freq_factor (4.0)"),
        (_model_table(rope_scaling={"rope_type": "yarn"}), "model.llama.rope_scaling.rope_type"),
        (_model_table(sliding_window=4), "model.llama.sliding_window"),
        (_model_table("mistral", sliding_window=0), "model.mistral.sliding_window"),
        ({**_model_table("mistral"), "llama": {"mlp_bias": True}}, "model.llama needs model.family = 'llama'"),
        ({**_model_table(), "mistral": {"sliding_window": 4}}, "model.mistral needs model.family = 'mistral'"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_sentence_naming_the_field(tmp_path, model, message):
    from jobspec.files.run_toml import parse_run_config

    raw = tiny_config(str(tmp_path / "m.json"), str(tmp_path / "runs"))
    raw["model"] = model
    with pytest.raises(ConfigError) as e:
        parse_run_config(raw)
    assert message in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
         "rope_type 'yarn' is not supported (only default and llama3 RoPE)"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
         "rope_type 'llama3' without low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ("llama", {"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ("mistral", {"rope_parameters": LLAMA3}, "rope_type 'llama3' is not supported (only default RoPE)"),
    ],
)  # fmt: skip
def test_unsupported_hf_settings_are_refused_in_one_sentence(tmp_path, family, change, message):
    conf = {**_hf(family)[0](**BASE).to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(tmp_path)
    assert message in str(e.value) and "which jaxjob cannot load" in str(e.value), str(e.value)


def test_finetune_resume_export_and_sample(tmp_path, prepared):
    """Import a tiny Llama with every feature on, train 4 steps on packed documents; 2 steps then
    a resume to 4 give bit-identical losses; the export loads in transformers with the run's
    logits, and greedy `runtime sample` equals transformers' greedy generate."""
    from runtime.commands.hf import export_checkpoint
    from runtime.commands.offline import restore_checkpoint, sample_checkpoint

    src = hf_model(tmp_path / "hf", **ALL_ON, vocab_size=260, tie_word_embeddings=True)
    cfg, _ = resume_is_exact(prepared, tmp_path / "runs", src)
    assert cfg.model.family == "llama" and cfg.model.llama.rope_scaling is not None

    run_dir = tmp_path / "runs" / "whole"
    out = tmp_path / "export"
    # In process (`runtime export hf` and `runtime sample` as subprocesses: test_hf.py's chain).
    export_checkpoint(str(run_dir), "latest", str(out))
    exported, start = read_safetensors(out), read_safetensors(src)
    assert set(exported) == set(start) - {"lm_head.weight"}
    name = "model.layers.1.self_attn.o_proj.bias"
    assert not np.array_equal(exported[name], start[name])  # the biases trained
    _, _, _, parts, _ = restore_checkpoint(str(run_dir), "latest")
    ours = logits_of(nnx.merge(parts.graphdef, parts.params, *parts.others), BATCH)
    assert np.max(np.abs(ours - hf_logits(out, BATCH))) < TOL

    prompt = [5, 17, 99, 3, 42, 8]
    sampled = sample_checkpoint(
        str(run_dir), "latest", prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=0
    )
    with torch.no_grad():
        gen = hf_loaded(out, "llama").generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    assert sampled["new_ids"] == gen[0, len(prompt) :].tolist()
