"""KV-cache decoding and generation: cache == full forward, greedy == argmax, seeded sampling."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jobspec.errors import ConfigError
from jobspec.families.model_config import ModelConfig
from runtime.model.generate import _generate_jit, generate
from runtime.model.qwen3.decoder import KVCache, Qwen3Decoder

TINY: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=32,
    init_std=0.2,  # spread-out logits: no near-ties for argmax to flip on
)


@pytest.fixture(scope="module")
def model() -> Qwen3Decoder:
    return Qwen3Decoder(ModelConfig(**TINY), rngs=nnx.Rngs(params=0))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: Any, params: Any, ids: jax.Array) -> jax.Array:
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return nnx.merge(graphdef, params)(ids, pos)


def forward(model: Qwen3Decoder, ids: jax.Array) -> jax.Array:
    return _forward(*nnx.split(model), ids)


TRACES: list[int] = []


@functools.partial(jax.jit, static_argnums=0)
def _decode(
    graphdef: Any, params: Any, ids: jax.Array, pos: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    TRACES.append(ids.shape[1])  # runs only while tracing
    return nnx.merge(graphdef, params).decode(ids, pos, cache)


def test_decode_with_cache_matches_full_forward(model: Qwen3Decoder) -> None:
    batch, prompt_len, steps = 2, 5, 6
    ids = jnp.asarray(
        np.random.default_rng(1).integers(0, 97, (batch, prompt_len + steps)), jnp.int32
    )
    full = forward(model, ids)
    graphdef, params = nnx.split(model)

    cache = model.init_cache(batch, prompt_len + steps + 3)  # spare slots must stay masked
    pos = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    logits, cache = _decode(graphdef, params, ids[:, :prompt_len], pos, cache)
    np.testing.assert_allclose(logits, full[:, :prompt_len], rtol=1e-5, atol=1e-5)
    assert int(cache.index) == prompt_len

    TRACES.clear()
    for i in range(prompt_len, prompt_len + steps):
        pos = jnp.full((batch, 1), i, jnp.int32)
        logits, cache = _decode(graphdef, params, ids[:, i : i + 1], pos, cache)
        assert logits.shape == (batch, 1, 97) and logits.dtype == jnp.float32
        np.testing.assert_allclose(logits[:, 0], full[:, i], rtol=1e-5, atol=1e-5)
    assert TRACES == [1]  # one trace serves every step
    assert int(cache.index) == prompt_len + steps
    assert cache.k[0].shape == (batch, prompt_len + steps + 3, 2, 8)


def _greedy_by_full_forward(model: Qwen3Decoder, prompt: list[int], n: int) -> list[int]:
    # One fixed-length buffer (one compile): causality makes the zero tail irrelevant.
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, : len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        logits = forward(model, jnp.asarray(buf))
        buf[0, i] = int(jnp.argmax(logits[0, i - 1]))
    return buf[0, len(prompt) :].tolist()


def test_greedy_generation_equals_full_forward_argmax(model: Qwen3Decoder) -> None:
    prompt = [5, 17, 42, 8]
    want = _greedy_by_full_forward(model, prompt, 8)
    top1 = generate(model, prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=0)
    assert top1 == {"tokens": want, "stop_reason": "max_new_tokens", "prompt_len": 4}
    # Deterministic whatever the seed, and temperature 0 is the same greedy path.
    again = generate(model, np.asarray(prompt), max_new_tokens=8, temperature=1.0, top_k=1, seed=9)
    assert again["tokens"] == want
    zero_t = generate(model, prompt, max_new_tokens=8, temperature=0.0, top_k=None, seed=3)
    assert zero_t["tokens"] == want


def test_sampling_is_reproducible_from_seed(model: Qwen3Decoder) -> None:
    kw: dict[str, Any] = dict(max_new_tokens=12, temperature=1.5, top_k=None)
    a = generate(model, [1, 2, 3], seed=7, **kw)
    b = generate(model, [1, 2, 3], seed=7, **kw)
    c = generate(model, [1, 2, 3], seed=8, **kw)
    assert a == b
    assert len(a["tokens"]) == 12
    assert a["tokens"] != c["tokens"]
    # top_k at or above the vocabulary restricts nothing.
    assert generate(model, [1, 2, 3], seed=7, **{**kw, "top_k": 500}) == a
    assert all(0 <= t < 97 for t in a["tokens"])


def test_top_k_restricts_choices(model: Qwen3Decoder) -> None:
    prompt = [3, 1, 4, 1, 5]
    last = forward(model, jnp.asarray([prompt], jnp.int32))[0, -1]
    allowed = set(np.argsort(-np.asarray(last))[:3].tolist())
    # A hot temperature makes unrestricted sampling wander; top_k=3 must not.
    firsts = {
        generate(model, prompt, max_new_tokens=1, temperature=10.0, top_k=3, seed=s)["tokens"][0]
        for s in range(12)
    }
    assert firsts <= allowed and len(firsts) > 1


def test_generation_stops_at_eos(model: Qwen3Decoder) -> None:
    prompt = [5, 17, 42, 8]
    greedy = _greedy_by_full_forward(model, prompt, 3)
    eos = greedy[2]
    out = generate(model, prompt, max_new_tokens=8, temperature=0.0, top_k=None, seed=0, eos_id=eos)
    stop = greedy.index(eos)
    assert out["tokens"] == greedy[: stop + 1]
    assert out["stop_reason"] == "eos"


def test_new_seed_or_temperature_does_not_recompile(model: Qwen3Decoder) -> None:
    kw: dict[str, Any] = dict(max_new_tokens=4, top_k=5)
    generate(model, [1, 2], temperature=0.9, seed=0, **kw)
    size = _generate_jit._cache_size()
    generate(model, [3, 4], temperature=0.5, seed=1, eos_id=2, **kw)
    assert _generate_jit._cache_size() == size


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be positive"),
        ([1, 2], {"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ([1, 2], {"max_new_tokens": 31}, "max_position_embeddings"),
        ([], {}, "non-empty"),
        ([[1, 2]], {}, "1-D"),
        ([1, 97], {}, r"\[0, 97\)"),
        ([-1, 2], {}, r"\[0, 97\)"),
        ([1, 2], {"temperature": -0.1}, "temperature"),
        ([1, 2], {"temperature": float("nan")}, "temperature"),
        ([1, 2], {"top_k": 0}, "top_k"),
        ([1, 2], {"eos_id": 97}, "eos_id"),
    ],
)
def test_bad_arguments_raise_config_error(
    model: Qwen3Decoder, prompt: Any, kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = dict(max_new_tokens=4, temperature=1.0, top_k=None, seed=0)
    with pytest.raises(ConfigError, match=match):
        generate(model, prompt, **{**args, **kwargs})
