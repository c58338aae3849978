"""The "llama" and "mistral" families' decoder: the Qwen3 decoder with Llama's attention, MLP and
RoPE, computing what HF `LlamaForCausalLM` and `MistralForCausalLM` do.

Attention has no q/k norm; with `attention_bias` (llama) the q, k, v AND o projections carry a
bias (HF LlamaAttention's, unlike Qwen2's, which has none on o_proj); with `mlp_bias` the gate,
up and down projections do (biases zero at init, as HF's). RoPE is "rotate_half" with, under
`rope_scaling` (rope_type "llama3"), Llama 3.1's inverse frequencies: wavelengths 2*pi/f above
original/low_freq_factor are divided by `factor`, those below original/high_freq_factor are
kept, and those between interpolate smoothly (transformers' `_compute_llama3_parameters`, same
fp32 arithmetic; its attention factor is 1). With `sliding_window` W (mistral) every layer's
query sees itself and the W-1 keys before it (HF's `kv > q - W`), in training (the kernel's
window) and decoding (the cache mask; the cache keeps every slot). Everything else (scanned or
unrolled layers, remat, KV cache, sharding names) is `runtime.model.qwen3.decoder.Qwen3Decoder`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jobspec.families.llama import DecoderOptions, Llama3RopeScaling
from jobspec.families.model_config import ModelConfig
from runtime.model.attention import kernels as attention
from runtime.model.layers import ACT_ROPE, Dense, apply_rope, dtype_of
from runtime.model.qwen3.decoder import MLP, Attention, Qwen3Decoder
from runtime.model.sharding import constrain


def options(cfg: ModelConfig) -> DecoderOptions:
    """The llama/mistral settings of `cfg` (its family's own table, read by its class)."""
    read = getattr(cfg, "decoder_options", None)
    assert read is not None, f"runtime/model/llama builds llama and mistral, not {cfg.family}"
    return read()


def inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """fp32 RoPE inverse frequencies [head_dim / 2]: HF's default ones, then, with `scaling`,
    Llama 3.1's (transformers' `_compute_llama3_parameters`, in the same fp32 steps)."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    freq = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    if scaling is None:
        return freq
    s = scaling
    old = float(s.original_max_position_embeddings)
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = (np.float32(2 * math.pi) / freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, freq / np.float32(s.factor), freq).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(s.low_freq_factor))
              / np.float32(s.high_freq_factor - s.low_freq_factor)).astype(np.float32)  # fmt: skip
    smoothed = ((1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def window_mask(index: jax.Array, t: int, slots: int, window: int) -> jax.Array:
    """[1, T, slots]: slot s is within `window` of new token j (at slot index + j): s > index + j -
    window. ANDed with the causal cache mask, a query sees itself and the window-1 before it."""
    q_slots = index + jnp.arange(t)
    return (jnp.arange(slots)[None, :] > q_slots[:, None] - window)[None]


class LlamaAttention(Attention):
    """GQA attention without q/k norm; biases on q/k/v/o with `attention_bias`; a sliding
    window with `sliding_window`."""

    qk_norm = False

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        opts = options(cfg)
        d, hd = cfg.hidden_size, cfg.resolved_head_dim
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = hd
        self.compute_dtype = dtype_of(cfg.compute_dtype)
        kw = {"rngs": rngs, "eager_sharding": eager_sharding, "bias": opts.attention_bias}
        self.q_proj = Dense(d, cfg.num_heads * hd, ("embed", "heads"), cfg, **kw)
        self.k_proj = Dense(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg, **kw)
        self.v_proj = Dense(d, cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg, **kw)
        self.o_proj = Dense(cfg.num_heads * hd, d, ("heads", "embed"), cfg, **kw)
        self.impl = cfg.attention
        self.window = opts.sliding_window

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """As `Attention.__call__`, within the sliding window when there is one."""
        q, k, v = self.qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            out = attention.attend(q, k, v, segment_ids, impl=self.impl, window=self.window)
            return self._out(out), None
        assert index is not None and mask is not None
        if self.window is not None:
            mask = mask & window_mask(index, x.shape[1], kv[0].shape[1], self.window)
        out, new_kv = attention.cached_attention(q, k, v, kv, index, mask, self.compute_dtype)
        return self._out(out), new_kv


class LlamaMLP(MLP):
    """SwiGLU, its three projections biased with `mlp_bias`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = {"rngs": rngs, "eager_sharding": eager_sharding, "bias": options(cfg).mlp_bias}
        self.gate_proj = Dense(d, f, ("embed", "mlp"), cfg, **kw)
        self.up_proj = Dense(d, f, ("embed", "mlp"), cfg, **kw)
        self.down_proj = Dense(f, d, ("mlp", "embed"), cfg, **kw)


class LlamaDecoder(Qwen3Decoder):
    """The Qwen3 decoder with `LlamaAttention`, `LlamaMLP` and Llama's (scaled) RoPE."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> None:
        super().__init__(
            cfg,
            rngs=rngs,
            eager_sharding=eager_sharding,
            mlp_factory=LlamaMLP,
            attention_factory=LlamaAttention,
        )

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE cos/sin [B, T, head_dim] at Llama's frequencies, batch-sharded."""
        cfg = self.cfg
        freq = inv_freq(cfg.resolved_head_dim, cfg.rope_theta, options(cfg).rope_scaling)
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freq)
        emb = jnp.concatenate([angles, angles], axis=-1)
        return constrain(jnp.cos(emb), ACT_ROPE), constrain(jnp.sin(emb), ACT_ROPE)


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False) -> LlamaDecoder:
    """The Llama (or Mistral) decoder of `cfg`."""
    return LlamaDecoder(cfg, rngs=rngs, eager_sharding=eager_sharding)
