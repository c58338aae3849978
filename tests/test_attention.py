"""Attention kernels behind `model.attention` against the einsum reference, and compiled for the
hardware they are for.

On CPU: splash runs in Pallas interpret mode (with and without a mesh, so through shard_map),
and the cudnn wrapper's own call to `jax.nn.dot_product_attention` runs through jax's XLA path;
both must equal `xla_attention` with packed documents and GQA, values and gradients. With no
accelerator: splash is compiled for a TPU v5p topology and cudnn for a deviceless H100 (the
latter needs the cuDNN library, `pip install nvidia-cudnn-cu12`, for jax's version probe).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from runtime.model import sharding
from runtime.model.attention import kernels as attention

T = 256  # two splash blocks of 128: block skipping and cross-block segments are exercised
D = 32

# Row 0: three documents then padding (id 0); row 1: a document boundary inside a block and an
# id that recurs after another (equal ids attend to each other, wherever they are).
_ROW0 = [1] * 70 + [2] * 100 + [3] * 50 + [0] * 36
_ROW1 = [5] * 64 + [6] * 3 + [7] * 61 + [5] * 128
PACKED = np.asarray([_ROW0, _ROW1], np.int32)

# A GpuTargetConfigProto (protobuf text) for an H100 SXM 80GB from its published
# specifications: compute capability 9.0, 132 SMs, 2,048 threads and 64K registers per SM,
# 228 KiB shared memory per SM (227 KiB opt-in per block), 50 MiB L2, 80 GiB HBM3 at
# 3.35 TB/s, 1.98 GHz boost clock.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85899345920
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def qkv(b: int, t: int, h: int, kvh: int, d: int = D, seed: int = 0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, t, h, d)), dtype)
    k = jnp.asarray(r.normal(size=(b, t, kvh, d)), dtype)
    v = jnp.asarray(r.normal(size=(b, t, kvh, d)), dtype)
    return q, k, v


def value_and_grads(fn, q, k, v, seg):
    """fn's output and the gradients of <fn(q,k,v), w> for a fixed random cotangent w."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), q.dtype)

    def loss(q, k, v):
        out = fn(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


# (heads, kv heads, segment ids): GQA H/KV = 2 and 4, one document and packed documents.
CASES = {
    "gqa2-one-doc": (4, 2, None),
    "gqa2-packed": (4, 2, PACKED),
    "gqa4-packed": (4, 1, PACKED),
}


@functools.cache
def case(name: str):
    """Inputs and the reference's value and gradients for a case (computed once per session)."""
    h, kvh, seg = CASES[name]
    q, k, v = qkv(2, T, h, kvh)
    seg = None if seg is None else jnp.asarray(seg)
    return (q, k, v, seg), value_and_grads(attention.xla_attention, q, k, v, seg)


def assert_matches_reference(fn, name: str, *, atol=2e-5):
    (q, k, v, seg), (want, want_g) = case(name)
    got, got_g = value_and_grads(fn, q, k, v, seg)
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)
    for name_, g, wg in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, wg, atol=atol * 5, rtol=1e-4, err_msg=f"d{name_}")


@pytest.mark.parametrize("name", ["gqa2-one-doc", "gqa2-packed"])
def test_splash_equals_reference(name):
    assert_matches_reference(lambda q, k, v, s: attention.attend(q, k, v, s, impl="splash"), name)


def test_splash_under_a_mesh_runs_through_shard_map():
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1, 1, 1), sharding.MESH_AXES)

    def under_mesh(q, k, v, seg):
        with sharding.activation_mesh(mesh):
            return attention.attend(q, k, v, seg, impl="splash")

    (q, k, v, seg), _ = case("gqa4-packed")
    jaxpr = str(jax.make_jaxpr(under_mesh)(q, k, v, seg))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    assert_matches_reference(under_mesh, "gqa4-packed")


@pytest.mark.parametrize("name", sorted(CASES))
def test_cudnn_call_equals_reference(name):
    """The exact call the cudnn kernel makes (causal flag, document mask, GQA layout, default
    scale), run by jax's XLA implementation of `jax.nn.dot_product_attention`."""
    assert_matches_reference(
        lambda q, k, v, s: attention.cudnn_attention(q, k, v, s, implementation="xla"), name
    )


def test_cases_discriminate():
    """The parity cases can fail: ignoring the documents or the GQA head order changes results."""
    (q, k, v, seg), (want, _) = case("gqa2-packed")
    assert not np.allclose(attention.xla_attention(q, k, v, None), want, atol=1e-3)
    swapped = k[:, :, ::-1]  # query head 0 would read kv head 1
    assert not np.allclose(attention.xla_attention(q, swapped, v, seg), want, atol=1e-3)
    # Every row of PACKED has several documents, one of them across the 128-token block edge.
    assert all(len(set(row)) >= 3 for row in PACKED.tolist())


def test_bf16_splash_close_to_reference():
    q, k, v = qkv(1, T, 2, 1, dtype=jnp.bfloat16)
    seg = jnp.asarray(PACKED[:1])
    got = attention.attend(q, k, v, seg, impl="splash")
    assert got.dtype == jnp.bfloat16
    want = attention.xla_attention(q, k, v, seg)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2
    )


# --- choice of kernel -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "platform,kernel",
    [("tpu", "splash"), ("cuda", "cudnn"), ("gpu", "cudnn"), ("cpu", "xla"), ("rocm", "xla")],
)
def test_auto_resolves_per_platform(platform, kernel):
    assert attention.resolve("auto", platform) == kernel
    for explicit in ("xla", "cudnn", "splash"):
        assert attention.resolve(explicit, platform) == explicit


def test_unknown_impl_names_the_field():
    with pytest.raises(ValueError, match="model.attention must be one of"):
        attention.resolve("flash", "tpu")


def test_auto_without_a_mesh_follows_the_default_backend():
    assert attention.target_platform() == jax.default_backend() == "cpu"
    q, k, v = qkv(1, 16, 2, 1)
    jaxpr = str(
        jax.make_jaxpr(lambda q, k, v: attention.attend(q, k, v, None, impl="auto"))(q, k, v)
    )
    assert "pallas_call" not in jaxpr and "dot_general" in jaxpr


def test_splash_rejects_a_length_it_cannot_block():
    q, k, v = qkv(1, 200, 2, 1)
    with pytest.raises(ValueError, match=r"model.attention = 'splash'.*multiple of 128, got 200"):
        attention.attend(q, k, v, None, impl="splash")


def test_cudnn_on_cpu_is_jaxs_xla_form_of_the_call_and_refused_on_tpu():
    # As splash runs in interpret mode on CPU, cudnn runs the same dot_product_attention call
    # through jax's XLA implementation there (how its masks are checked without a GPU).
    q, k, v = qkv(1, 16, 2, 1)
    seg = jnp.asarray([[1] * 9 + [2] * 7])
    got = attention.attend(q, k, v, seg, impl="cudnn", window=5)
    want = attention.attend(q, k, v, seg, impl="xla", window=5)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-6
    why = attention.unsupported("cudnn", q, k, None, "tpu")
    assert why is not None and "CUDA GPUs" in why and "not tpu" in why


# --- compiling for real targets without the hardware ------------------------------------------


@functools.cache
def _tpu_devices() -> list:
    try:
        from jax.experimental.topologies import get_topology_desc

        return list(
            get_topology_desc(
                platform="tpu",
                topology_name="v5:2x2x1",
                chip_config_name="megacore",
                chips_per_host_bounds=(2, 2, 1),
                num_slices=1,
                wrap=(False, False, False),
            ).devices
        )
    except Exception as e:  # libtpu missing or unusable
        pytest.skip(f"no TPU compile-only topology (pip install 'jaxjob[plan]'): {e}")


@functools.cache
def _h100_devices() -> list:
    try:
        from jax.experimental.topologies import get_topology_desc

        return list(
            get_topology_desc(
                topology_name="h100",
                platform="cuda",
                target_config=H100_TARGET_CONFIG,
                topology="1x1x8",
            ).devices
        )
    except Exception as e:  # the CUDA plugin missing
        pytest.skip(f"no deviceless CUDA topology (pip install 'jaxjob[plan]'): {e}")


def _mesh(devices: list, shape: tuple[int, int, int, int]) -> Mesh:
    """(slice, data, fsdp, tensor) sizes; the expert and context axes are 1."""
    grid = (*shape[:2], 1, shape[2], 1, shape[3])
    return Mesh(np.asarray(devices).reshape(grid), sharding.MESH_AXES)


def _abstract(mesh: Mesh, b: int, t: int, h: int, kvh: int, d: int, dtype=jnp.bfloat16):
    def sds(shape, names, dt):
        spec = sharding.mesh_spec(names, shape, mesh)
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    q = sds((b, t, h, d), ("batch", None, "heads", None), dtype)
    k = sds((b, t, kvh, d), ("batch", None, "kv_heads", None), dtype)
    seg = sds((b, t), ("batch", None), jnp.int32)
    return q, k, k, seg


def _train_like(mesh: Mesh, impl: str):
    """Forward and backward of attend as the train step traces it (under activation_mesh)."""

    def step(q, k, v, seg):
        with sharding.activation_mesh(mesh):

            def loss(q, k, v):
                return attention.attend(q, k, v, seg, impl=impl).astype(jnp.float32).sum()

            return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(step)


def test_auto_under_a_mesh_follows_its_devices():
    tpu = _mesh(_tpu_devices(), (1, 1, 4, 1))
    with sharding.activation_mesh(tpu):
        assert attention.target_platform() == "tpu"
    cpu = _mesh(jax.devices()[:1], (1, 1, 1, 1))
    with sharding.activation_mesh(cpu):
        assert attention.target_platform() == "cpu"


def test_auto_on_tpu_lowers_splash_and_falls_back_where_it_cannot():
    mesh = _mesh(_tpu_devices(), (1, 1, 2, 2))
    fn = _train_like(mesh, "auto")
    assert "tpu_custom_call" in fn.lower(*_abstract(mesh, 4, 256, 4, 2, 128)).as_text()
    # 200 tokens do not split into 128-wide blocks: auto takes the xla kernel instead ...
    assert "tpu_custom_call" not in fn.lower(*_abstract(mesh, 4, 200, 4, 2, 128)).as_text()
    # ... while an explicit splash says why.
    with pytest.raises(ValueError, match="multiple of 128"):
        _train_like(mesh, "splash").lower(*_abstract(mesh, 4, 200, 4, 2, 128))


def test_splash_compiles_for_tpu_v5p():
    """Batch over fsdp, heads over tensor; one kv head cannot split over tensor = 2, so each
    query head gets its own copy of it."""
    mesh = _mesh(_tpu_devices(), (1, 1, 2, 2))
    compiled = _train_like(mesh, "splash").lower(*_abstract(mesh, 4, 512, 8, 1, 128)).compile()
    text = compiled.as_text()
    # Forward, dK/dV and dQ kernels: Mosaic custom calls, with no T x T score tensor anywhere.
    assert text.count("tpu_custom_call") >= 3
    assert not re.search(r"\[\d+,\d+,512,512\]", text)
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20


def test_cudnn_compiles_for_a_deviceless_h100():
    mesh = _mesh(_h100_devices(), (1, 1, 8, 1))
    assert mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    with sharding.activation_mesh(mesh):
        assert attention.target_platform() == "cuda"
        assert attention.resolve("auto") == "cudnn"
    fn = _train_like(mesh, "cudnn")
    args = _abstract(mesh, 8, 1024, 8, 4, 128)
    try:
        lowered = fn.lower(*args)
    except RuntimeError as e:
        if "cuDNN not found" in str(e) or "cuDNN is not detected" in str(e):
            pytest.skip(
                "jax's cuDNN attention probes the cuDNN library's version while tracing "
                f"(jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version: {e}); "
                "libcudnn.so.9 comes from the nvidia-cudnn-cu12 wheel, which is not installed"
            )
        raise
    text = lowered.compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert "__cudnn$fmhaScaleBiasSoftmax" in targets
    assert "__cudnn$fmhaScaleBiasSoftmaxBackward" in targets


def test_cudnn_on_gpu_refuses_fp32():
    mesh = _mesh(_h100_devices(), (1, 1, 8, 1))
    with pytest.raises(ValueError, match="cudnn needs bfloat16 or float16"):
        _train_like(mesh, "cudnn").lower(*_abstract(mesh, 8, 256, 8, 4, 128, jnp.float32))
    # auto takes xla for fp32 rather than failing.
    text = _train_like(mesh, "auto").lower(*_abstract(mesh, 8, 256, 8, 4, 128, jnp.float32))
    assert "cudnn" not in text.as_text()


# ---- sliding window and scale (Gemma 4's sliding layers: window W, scaling 1.0) -------------

WINDOW = 100  # crosses splash's 128-blocks and the documents of PACKED


def _windowed_reference(q, k, v, seg):
    """The window spelled out as a dense mask: key s is visible to query t when
    t - WINDOW < s <= t and (with segment ids) both are in one document."""
    t = q.shape[1]
    idx = np.arange(t)
    mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - WINDOW)
    mask = jnp.asarray(mask)[None]
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    return attention.masked_attention(q, k, v, mask, scale=0.5)


@pytest.mark.parametrize("name", ["gqa2-one-doc", "gqa2-packed"])
@pytest.mark.parametrize("kernel", ["xla", "splash", "cudnn-as-xla"])
def test_sliding_window_and_scale_in_every_kernel(name, kernel):
    (q, k, v, seg), _ = case(name)
    want, want_g = value_and_grads(_windowed_reference, q, k, v, seg)
    if kernel == "cudnn-as-xla":

        def fn(q, k, v, s):
            return attention.cudnn_attention(
                q, k, v, s, implementation="xla", scale=0.5, window=WINDOW
            )
    else:

        def fn(q, k, v, s):
            return attention.attend(q, k, v, s, impl=kernel, scale=0.5, window=WINDOW)

    got, got_g = value_and_grads(fn, q, k, v, seg)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    for g, wg in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, wg, atol=1e-4, rtol=1e-4)
    # The window matters here: plain causal attention differs.
    plain = np.asarray(attention.attend(q, k, v, seg, impl="xla", scale=0.5))
    assert np.max(np.abs(plain - want)) > 1e-3


def test_cudnn_head_dim_bound_is_jaxs_own():
    """Without a Hopper device (a deviceless compile) cuDNN flash attention takes head dims up
    to 128, so a 256-wide head is refused in one sentence and `auto` falls back to xla."""
    q, k, _ = qkv(1, 8, 2, 1, d=256, dtype=jnp.bfloat16)
    why = attention.unsupported("cudnn", q, k, None, "cuda")
    assert why == "cudnn needs a head dim that is a multiple of 8 and at most 128, got 256"
    q, k, _ = qkv(1, 8, 2, 1, d=128, dtype=jnp.bfloat16)
    assert attention.unsupported("cudnn", q, k, None, "cuda") is None
