"""gpt-oss (`gpt_oss`): logit parity with transformers' GptOssForCausalLM (attention sinks,
sliding and full layers, biases, the biased router, clamped-SwiGLU experts, YaRN and plain
RoPE; dense and sparse expert dispatch), exact import/export, an MXFP4 checkpoint built here and
dequantized on import, cached decode, packing, one train step equal across meshes, splash with
sinks, counts and the real sizes, bad settings in one sentence, and a fine-tune from the MXFP4
checkpoint that resumes exactly, exports and samples what transformers generates. CPU only."""

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
from hf_family import forward, hf_logits_of, imported, logits_of, resume_is_exact  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jobspec.errors import ConfigError  # noqa: E402
from jobspec.families.model_config import ModelConfig  # noqa: E402
from jobspec.files.run_toml import read_toml  # noqa: E402
from jobspec.hf_config import hf_config_from_model, model_fields_from_hf  # noqa: E402
from runtime.hf.convert import flat_params, model_config_from_hf  # noqa: E402
from runtime.hf.files import read_safetensors  # noqa: E402
from runtime.hf.mxfp4 import E2M1, dequantize  # noqa: E402
from runtime.model.attention import kernels as attention  # noqa: E402
from runtime.model.flops import flops_per_token, parameter_counts  # noqa: E402
from runtime.model.hf_weights import hf_from_params, write_hf  # noqa: E402

from runs import ROOT, xla_flags  # noqa: E402

#: fp32 parity bound; observed differences are ~4e-6 on logits of magnitude ~3.
TOL = 1e-5
WINDOW = 4
BATCH = np.random.default_rng(0).integers(0, 128, (2, 11)).astype(np.int32)
#: YaRN with a short original context, so the ramp splits the 8 frequencies of a 16-wide head.
YARN = dict(rope_type="yarn", factor=8.0, beta_fast=4.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64, rope_theta=10_000.0)  # fmt: skip
BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
    initializer_range=0.1, rope_parameters=YARN, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip
#: "yarn": transformers' defaults (sliding then full, biases, untied, YaRN). "plain": default
#: RoPE, no attention biases, a tied head, full then sliding, and a clamp that bites everywhere.
CASES = {
    "yarn": {},
    "plain": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, attention_bias=False,
        tie_word_embeddings=True, layer_types=["full_attention", "sliding_attention"],
        swiglu_limit=0.5, swiglu_alpha=1.0,
    ),
}  # fmt: skip


def hf_model(tmp: Path, seed: int = 0, **over) -> Path:
    """A tiny random GptOssForCausalLM saved to `tmp`: norms, biases and sinks away from their
    initial 1 / 0, the experts scaled up so the SwiGLU clamp takes effect."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**BASE, **over})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")):
                p.uniform_(-1.0, 1.0)
            elif "experts" in name:
                p.mul_(5.0)
    model.save_pretrained(tmp)
    return tmp


def hf_logits(path: Path, batch: np.ndarray, **kw) -> np.ndarray:
    return hf_logits_of(transformers.GptOssForCausalLM, path, batch, **kw)


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (HF dir, cfg, imported model, its logits on BATCH), each made once."""

    def get(case: str) -> tuple:
        if case not in _BUILT:
            src = hf_model(tmp_path_factory.mktemp(case), **CASES[case])
            cfg, model = imported(src)
            _BUILT[case] = (src, cfg, model, logits_of(model, BATCH))
        return _BUILT[case]

    yield get
    _BUILT.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_logit_parity_and_exact_round_trip(tmp_path, built, case):
    src, cfg, model, ours = built(case)
    ref = hf_logits(src, BATCH)
    assert np.max(np.abs(ref)) > 1.0
    assert np.max(np.abs(ours - ref)) < TOL, np.max(np.abs(ours - ref))
    # Import then export reproduces every tensor bit for bit (the tied head aside).
    theirs = read_safetensors(src)
    back = hf_from_params(cfg, flat_params(nnx.state(model, nnx.Param)))
    assert set(theirs) - set(back) <= {"lm_head.weight"} and set(back) <= set(theirs)
    for name, a in back.items():
        assert a.dtype == theirs[name].dtype and np.array_equal(a, theirs[name]), name
    # The export loads in transformers with the same logits.
    out = tmp_path / "out"
    write_hf(cfg, nnx.state(model, nnx.Param), out)
    assert np.array_equal(hf_logits(out, BATCH), ref)


@pytest.mark.parametrize("case", list(CASES))
def test_each_feature_moves_the_logits(built, case):
    """transformers' own logits change with each feature turned off (sinks zeroed, a window
    wider than the rows, a clamp that never bites, no YaRN), so the parity above, 1e-5 apart,
    tests each of them."""
    src, _, _, ours = built(case)
    ref = hf_logits(src, BATCH)
    off = [dict(sliding_window=64), dict(swiglu_limit=1e4)]
    if case == "yarn":
        off.append(dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}))
    for change in [None, *off]:
        torch.manual_seed(0)
        config = transformers.GptOssConfig.from_pretrained(src, **(change or {}))
        model = transformers.GptOssForCausalLM.from_pretrained(
            src, config=config, attn_implementation="eager", dtype=torch.float32
        ).eval()
        with torch.no_grad():
            if change is None:
                for layer in model.model.layers:
                    layer.self_attn.sinks.zero_()
            other = model(torch.from_numpy(BATCH.astype(np.int64))).logits.numpy()
        assert np.max(np.abs(other - ref)) > 1e-3, change or "sinks"


def test_the_sparse_moe_dispatch_matches_transformers(built):
    """The same weights through the sparse dispatch (grouped matmuls with the expert biases and
    the clamped activation as options of runtime/model/moe/dispatch.py)."""
    src, _, _, dense = built("yarn")
    _, model = imported(src, moe_dispatch="sparse")
    ours = logits_of(model, BATCH)
    assert np.max(np.abs(ours - hf_logits(src, BATCH))) < TOL
    assert np.max(np.abs(ours - dense)) < 1e-5


def test_packed_documents_stay_apart(built):
    """Two documents in one row give exactly the logits each gets alone (each the start of a
    right-padded row of BATCH's shape), on sliding and full layers."""
    _, _, model, _ = built("yarn")
    a, b = list(BATCH[0, :7]), list(BATCH[1, :4])
    ids = np.array([a + b, BATCH[1]], np.int32)
    pos = np.array([list(range(len(a))) + list(range(len(b))), range(11)], np.int32)
    seg = np.array([[1] * len(a) + [2] * len(b), [1] * 11], np.int32)
    packed = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
    alone = np.zeros_like(ids)
    alone[0, : len(a)], alone[1, : len(b)] = a, b
    alone = logits_of(model, alone)
    worst = max(np.max(np.abs(packed[0, : len(a)] - alone[0, : len(a)])),
                np.max(np.abs(packed[0, len(a) :] - alone[1, : len(b)])))  # fmt: skip
    assert worst < 1e-5, worst


def test_cached_decode_equals_the_full_forward(built):
    """A 3-token prefill then one token at a time (the sliding layer's ring of WINDOW slots
    wraps twice) gives the no-cache logits."""
    prefill = 3
    _, cfg, model, full = built("yarn")
    cache = model.init_cache(BATCH.shape[0], BATCH.shape[1])
    assert [k.shape[1] for k in cache.k] == [WINDOW, BATCH.shape[1]]  # sliding, full
    decode = nnx.jit(lambda m, ids, pos, c: m.decode(ids, pos, c))
    worst, t = 0.0, 0
    for n in [prefill] + [1] * (BATCH.shape[1] - prefill):
        ids = jnp.asarray(BATCH[:, t : t + n])
        logits, cache = decode(model, ids, jnp.broadcast_to(jnp.arange(t, t + n), ids.shape), cache)
        worst = max(worst, float(np.max(np.abs(np.asarray(logits) - full[:, t : t + n]))))
        t += n
    assert int(cache.index) == BATCH.shape[1] and worst < 1e-5, worst


def test_layers_scanned_in_periods_are_the_unrolled_model(tmp_path):
    """Four layers, sliding then full twice: a period of 2, 2 repetitions. Scanned
    (`layers.blocks.{j}`, [2, ...]) the import gives the unrolled logits and the same loss and
    gradients, exports bit for bit and decodes from the cache (the sliding layers' rings)."""
    src = hf_model(tmp_path / "hf", num_hidden_layers=4)
    _, unrolled = imported(src)
    cfg, scanned = imported(src, scan_layers=True)
    flat = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
    assert flat[("layers", "blocks", 0, "self_attn", "sinks")].shape == (2, 4)
    ours = logits_of(scanned, BATCH)
    assert np.max(np.abs(ours - logits_of(unrolled, BATCH))) < 1e-5  # XLA fuses a scan otherwise
    theirs = read_safetensors(src)
    back = hf_from_params(cfg, flat_params(nnx.state(scanned, nnx.Param)))
    assert set(back) == set(theirs)
    for name, a in back.items():
        assert np.array_equal(a, theirs[name]), name

    def loss_and_grads(model):
        def loss(m):
            logp = jax.nn.log_softmax(m(jnp.asarray(BATCH[:, :-1]), pos), axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(BATCH[:, 1:, None]), axis=-1))

        pos = jnp.broadcast_to(jnp.arange(BATCH.shape[1] - 1), (BATCH.shape[0], BATCH.shape[1] - 1))
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        return float(value), grads

    (a, ga), (b, gb) = loss_and_grads(unrolled), loss_and_grads(scanned)
    assert b == pytest.approx(a, rel=1e-6)
    ga = hf_from_params(cfg.model_copy(update={"scan_layers": False}), flat_params(ga))
    for name, g in hf_from_params(cfg, flat_params(gb)).items():
        np.testing.assert_allclose(g, ga[name], rtol=1e-5, atol=1e-7, err_msg=name)

    cache = scanned.init_cache(BATCH.shape[0], BATCH.shape[1])
    assert [k.shape[1] for k in cache.k] == [WINDOW, BATCH.shape[1]] * 2
    decode = nnx.jit(lambda m, ids, pos, c: m.decode(ids, pos, c))
    t = 0
    for n in [3, 1, 1, 1, 1, 1]:  # past the window: the rings wrap
        ids = jnp.asarray(BATCH[:, t : t + n])
        logits, cache = decode(
            scanned, ids, jnp.broadcast_to(jnp.arange(t, t + n), ids.shape), cache
        )
        assert np.max(np.abs(np.asarray(logits) - ours[:, t : t + n])) < 1e-5, t
        t += n


# ---- MXFP4 ------------------------------------------------------------------------------------


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our own MXFP4 packing of an expert tensor [E, C, R] (HF's x @ w layout), per the OCP MX
    spec: blocks of 32 along C share an E8M0 scale 2^(s - 127), the smallest that keeps the
    block's largest magnitude within E2M1's 6; each value rounds to the nearest E2M1 code; two
    codes a byte, the even element in the low nibble; stored row by row of w transposed, as
    transformers' `convert_moe_packed_tensors` reads them."""
    rows = np.swapaxes(w, 1, 2).astype(np.float32)  # [E, R, C]
    e, r, c = rows.shape
    blocks = rows.reshape(e, r, c // 32, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), np.float32(2.0**-126))
    exp = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127).astype(np.int32)
    scaled = blocks / np.exp2(exp.astype(np.float32))[..., None]
    magnitude = np.abs(np.abs(scaled)[..., None] - E2M1[:8]).argmin(axis=-1)
    codes = (magnitude + 8 * (scaled < 0)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # Contiguous copies: safetensors writes an array's buffer as it lies in memory.
    return np.ascontiguousarray(packed), np.ascontiguousarray((exp + 127).astype(np.uint8))


def mxfp4_checkpoint(src: Path, out: Path) -> Path:
    """`src`'s HF dir with its experts stored as MXFP4 (`*_blocks` + `*_scales`, the other
    tensors as they were), as the released checkpoints hold them."""
    out.mkdir()
    tensors = read_safetensors(src)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensors.pop(name))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def mxfp4_logits(path: Path, batch: np.ndarray) -> np.ndarray:
    """transformers' own reading of an MXFP4 checkpoint (dequantized, as on a CPU)."""
    return hf_logits(path, batch, quantization_config=transformers.Mxfp4Config(dequantize=True))


def test_mxfp4_packing_is_transformers_layout():
    """Our packing dequantizes (runtime/hf/mxfp4.py) to transformers' values, and to the E2M1
    grid point nearest each weight; random bytes (every code, extreme scales) too."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 64, 40)).astype(np.float32) * 0.05
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    ours = dequantize(blocks, scales, np.float32)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()  # fmt: skip
    assert ours.shape == w.shape and np.array_equal(ours, theirs)
    step = np.exp2(scales.astype(np.float32) - 127)  # per block; E2M1 steps are <= 2 of it
    assert np.max(np.abs(ours - w) / np.repeat(np.swapaxes(step, 1, 2), 32, axis=1)) <= 1.0
    raw = rng.integers(0, 256, (2, 8, 3, 16)).astype(np.uint8)
    exps = rng.integers(0, 255, (2, 8, 3)).astype(np.uint8)
    ref = convert_moe_packed_tensors(torch.from_numpy(raw), torch.from_numpy(exps),
                                     dtype=torch.float32).numpy()  # fmt: skip
    assert np.array_equal(dequantize(raw, exps, np.float32), ref)


def test_an_mxfp4_checkpoint_imports_dequantized_and_exports_unquantized(tmp_path, built, capfd):
    src = mxfp4_checkpoint(built("yarn")[0], tmp_path / "mxfp4")
    capfd.readouterr()  # building the source (transformers' save prints progress) is not ours
    cfg, model = imported(src)
    note = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(note) == 1 and note[0].startswith("note: the checkpoint holds 4 MXFP4 tensors")
    assert "dequantized them to float32 (model.param_dtype)" in note[0]
    assert np.max(np.abs(logits_of(model, BATCH) - mxfp4_logits(src, BATCH))) < TOL
    # In bfloat16 the dequantized experts are the same numbers (E2M1 x 2^k is exact there).
    cfg16, model16 = imported(src, param_dtype="bfloat16")
    ours16 = flat_params(nnx.state(model16, nnx.Param))
    key = ("layers", 0, "mlp", "experts", "gate_up_proj")
    assert ours16[key].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(ours16[key], np.float32), flat_params(nnx.state(model))[key])
    # The export is unquantized, in the run's dtype, and transformers reads the same experts.
    out = tmp_path / "out"
    write_hf(cfg16, nnx.state(model16, nnx.Param), out)
    exported = read_safetensors(out)
    assert not any(n.endswith(("_blocks", "_scales")) for n in exported)
    assert exported["model.layers.1.mlp.experts.down_proj"].dtype == jnp.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    loaded = transformers.GptOssForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = loaded.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    assert np.array_equal(got, np.asarray(ours16[key], np.float32))


# ---- sinks in the kernels ---------------------------------------------------------------------


def test_splash_takes_the_sinks_and_the_window_exactly():
    """Splash (Pallas interpret mode here) with sinks, a window and packed documents equals the
    einsum reference, values and gradients (the sinks' too); cudnn, which has no sinks, is
    refused by name rather than run without them."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 128, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 128, 1, 16)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(2,)) * 2, jnp.float32)
    seg = jnp.asarray([[1] * 50 + [2] * 78], jnp.int32)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def grads(impl: str):
        def loss(q, k, v, s):
            return jnp.sum(attention.attend(q, k, v, seg, impl=impl, window=40, sinks=s) * w)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    (ref, ref_g), (got, got_g) = grads("xla"), grads("splash")
    assert abs(float(got - ref)) < 1e-3 * max(1.0, abs(float(ref)))
    for a, b in zip(got_g, ref_g, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    no_sinks = attention.attend(q, k, v, seg, impl="xla", window=40)
    assert (
        float(jnp.max(jnp.abs(no_sinks - attention.attend(q, k, v, seg, window=40, sinks=sinks))))
        > 1e-2
    )
    why = attention.unsupported("cudnn", q.astype(jnp.bfloat16), k, None, "cuda", sinks=True)
    assert why is not None and "sinks" in why


# ---- one train step on several meshes -----------------------------------------------------

_MESH_STEP = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jobspec.run_config import MeshConfig
    from runtime.hf.convert import flat_params, model_config_from_hf
    from runtime.model.build import build_model
    from runtime.model.hf_weights import hf_from_params
    from runtime.model.sharding import batch_sharding, build_mesh, on_mesh

    src = sys.argv[1]
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 128, (4, 13)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12), (4, 12))
    seg = jnp.asarray([[1] * 12, [1] * 5 + [2] * 7, [1] * 12, [1] * 9 + [2] * 3], jnp.int32)
    out = []
    # The split mesh runs the layers scanned (a period of sliding, full); gradients compare by
    # their HF names.
    for mesh_keys, scan in [({}, False), ({"expert": 2, "fsdp": 2, "tensor": 2}, True)]:
        mesh_cfg = MeshConfig(**mesh_keys)
        mesh = build_mesh(mesh_cfg, jax.devices()[: mesh_cfg.size])
        cfg = model_config_from_hf(src, init_from=f"hf:{src}", scan_layers=scan)
        parts = build_model(cfg, 0, mesh)

        def loss(params, ids, pos, seg):
            model = nnx.merge(parts.graphdef, params, *parts.others)
            logits, loads = model.forward_with_loads(ids[:, :-1], pos, seg)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), loads

        rows = batch_sharding(mesh, 2)
        batch = [jax.device_put(a, rows) for a in (ids, pos, seg)]
        step = jax.jit(on_mesh(jax.value_and_grad(loss, has_aux=True), mesh))
        (value, loads), grads = step(parts.params, *batch)
        flat = {k: np.asarray(v).tolist()
                for k, v in hf_from_params(cfg, flat_params(grads)).items()}
        out.append({"mesh": mesh_keys, "loss": float(value),
                    "loads": np.asarray(loads).tolist(), "grads": flat})
    print(json.dumps(out))
    """
)


def test_one_train_step_is_the_same_on_an_expert_fsdp_tensor_mesh(built):
    """Loss, expert loads and every gradient of one step on 8 devices, expert x fsdp x tensor
    = 2 x 2 x 2 (parameters over fsdp, heads and expert widths over tensor; the sparse dispatch
    with its exchange over `expert` and the expert biases split over experts and the hidden
    width; the layers scanned), equal the single-device unrolled step's (the dense dispatch) to
    1e-5."""
    src = built("yarn")[0]
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           }  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _MESH_STEP, str(src)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    base, *others = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(base["grads"]) == set(read_safetensors(src))
    for run in others:
        where = run["mesh"]
        assert run["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6), where
        np.testing.assert_allclose(run["loads"], base["loads"], atol=1e-6, err_msg=str(where))
        for name, want in base["grads"].items():
            want = np.asarray(want)
            scale = max(float(np.max(np.abs(want))), 1e-6)
            got = np.asarray(run["grads"][name])
            np.testing.assert_allclose(
                got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{where} {name}"
            )


# ---- config, counts, real sizes ---------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_config_json_round_trip_and_counts(built, case):
    """The exported config.json imports back to the same model; the parameter count is the
    model's and transformers' own; sliding layers count min(window, T) keys."""
    config = transformers.GptOssConfig(**{**BASE, **CASES[case]})
    hf_total = sum(p.numel() for p in transformers.GptOssForCausalLM(config).parameters())
    cfg = ModelConfig(**model_fields_from_hf(config.to_dict()))
    assert cfg == built(case)[1].model_copy(update={"init_from": None})
    assert parameter_counts(cfg)["total"] == hf_total  # a tied head counted once by both
    assert ModelConfig(**model_fields_from_hf(hf_config_from_model(cfg.model_dump()))) == cfg
    model = built(case)[2]
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert parameter_counts(cfg)["total"] == ours
    per_key = 12 * 4 * 16
    assert flops_per_token(cfg, 64)["attention"] == per_key * (WINDOW + 64)


#: The published config.json of openai/gpt-oss-20b (as released: legacy `rope_scaling` and a
#: top-level `rope_theta`, MXFP4 experts); gpt-oss-120b differs in num_hidden_layers (36) and
#: num_local_experts (128).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                            "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088,
}  # fmt: skip
#: file: (layers, experts, total, active per token with the head, not the embedding table), the
#: model cards' "21B parameters, 3.6B active" and "117B parameters, 5.1B active".
REAL = {"gpt-oss-20b.toml": (24, 32, 21e9, 3.6e9), "gpt-oss-120b.toml": (36, 128, 117e9, 5.1e9)}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_sizes_are_the_released_models(name):
    layers, experts, total, active = REAL[name]
    m = ModelConfig.model_validate(read_toml(ROOT / "configs/models" / name)["model"])
    assert m.family == "gpt_oss" and m.scan_layers is True
    released = {**GPT_OSS_20B, "num_hidden_layers": layers, "num_local_experts": experts,
                "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}  # fmt: skip
    # The released config.json is this file's model (the layer pattern the file leaves out
    # comes back spelled out), and so is our own export of it.
    for hf in (released, hf_config_from_model(m.model_dump())):
        back = ModelConfig.model_validate({**m.model_dump(), **model_fields_from_hf(hf)})
        assert back.gpt_oss.resolved_layer_types(layers) == m.gpt_oss.resolved_layer_types(layers)
        assert back.model_copy(update={"gpt_oss": m.gpt_oss}) == m
        assert back.gpt_oss.model_copy(update={"layer_types": None}) == m.gpt_oss
    counts = parameter_counts(m)
    assert counts["total"] == pytest.approx(total, rel=0.02)
    used = counts["active_non_embedding"] + counts["lm_head"]  # the cards count the head
    assert used == pytest.approx(active, rel=0.02)


# ---- bad settings -----------------------------------------------------------------------------


def _model_table(**g) -> dict:
    return {
        "family": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 32,
        "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, **g},
    }  # fmt: skip


@pytest.mark.parametrize(
    "g, top, message",
    [
        ({"layer_types": ["full_attention"] * 3}, {}, "model.gpt_oss.layer_types has 3 entries but model.num_layers is 2"),
        ({"num_experts_per_tok": 5}, {}, "model.gpt_oss.num_experts_per_tok (5) exceeds model.gpt_oss.num_local_experts (4)"),
        ({}, {"attention": "cudnn"}, "model.attention = 'cudnn' cannot honour gpt_oss's attention sinks"),
        ({}, {"norm_topk_prob": False}, "model.norm_topk_prob = false is not available for gpt_oss"),
        ({}, {"router_bias_update_rate": 0.01}, "model.router_bias_update_rate is not available for gpt_oss"),
        ({}, {"num_experts": 4}, "need family = "),
        ({}, {"head_dim": 7, "num_heads": 4}, "model.head_dim (7) must be even"),
    ],
)  # fmt: skip
def test_bad_gpt_oss_settings_are_one_sentence_naming_the_field(tmp_path, g, top, message):
    from jobspec.files.run_toml import parse_run_config

    from runs import tiny_config

    raw = tiny_config(str(tmp_path / "m.json"), str(tmp_path / "runs"))
    raw["model"] = {**_model_table(**g), **top}
    with pytest.raises(ConfigError) as e:
        parse_run_config(raw)
    assert message in str(e.value) and "\n" not in str(e.value).strip()


@pytest.mark.parametrize(
    "change, says",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method = 'fp8' (only 'mxfp4')"),
        ({"output_router_logits": True}, "output_router_logits = true"),
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
        ({"rope_scaling": {**GPT_OSS_20B["rope_scaling"], "mscale": 0.7}}, "rope_parameters.mscale = 0.7"),
    ],
)  # fmt: skip
def test_unsupported_hf_settings_are_refused_in_one_sentence(tmp_path, change, says):
    (tmp_path / "config.json").write_text(json.dumps({**GPT_OSS_20B, **change}))
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(tmp_path)
    assert says in str(e.value) and "which jaxjob cannot load" in str(e.value)


# ---- the CLI chain ----------------------------------------------------------------------------


def test_finetune_resume_export_and_sample(tmp_path, prepared):
    """Start from an MXFP4 checkpoint, train 4 steps on packed documents; 2 steps then a resume
    to 4 give bit-identical losses; the export (unquantized) loads in transformers with the
    run's logits, and greedy `runtime sample` equals transformers' greedy generate."""
    from runtime.commands.hf import export_checkpoint
    from runtime.commands.offline import restore_checkpoint, sample_checkpoint

    src = mxfp4_checkpoint(hf_model(tmp_path / "hf", vocab_size=260), tmp_path / "mxfp4")
    resume_is_exact(prepared, tmp_path / "runs", src)

    run_dir = tmp_path / "runs" / "whole"
    out = tmp_path / "export"
    # In process (`runtime export hf` and `runtime sample` as subprocesses: test_hf.py's chain).
    export_checkpoint(str(run_dir), "latest", str(out))
    exported = read_safetensors(out)
    assert "model.layers.0.mlp.experts.gate_up_proj" in exported
    assert not any(n.endswith("_blocks") for n in exported)
    _, _, _, parts, _ = restore_checkpoint(str(run_dir), "latest")
    ours = logits_of(nnx.merge(parts.graphdef, parts.params, *parts.others), BATCH)
    assert np.max(np.abs(ours - hf_logits(out, BATCH))) < TOL

    prompt = [5, 17, 99, 3, 42, 8]
    sampled = sample_checkpoint(
        str(run_dir), "latest", prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=0
    )
    new_ids = sampled["new_ids"]
    hf = transformers.GptOssForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert new_ids == gen[0, len(prompt) :].tolist()
