"""Autoregressive generation from a `FamilyModel` with its KV cache.

One jitted program per (prompt length, max_new_tokens, top_k, greedy) does the whole job: prefill
the prompt in one `decode` call, then a `lax.while_loop` of one-token steps that stops at
max_new_tokens or at eos. Temperature, seed and eos id are traced, so changing them never
recompiles.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jobspec.errors import ConfigError
from runtime.model.spec import FamilyModel


def _pick(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, *, greedy: bool, top_k: int | None
) -> jax.Array:
    """Next token ids [B] from last-position logits [B, V]."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # Sample among exactly the k best (ties at the k-th value do not widen the set).
        vals, idx = lax.top_k(scaled, top_k)
        choice = jax.random.categorical(key, vals, axis=-1)
        return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnums=(0,), static_argnames=("max_new_tokens", "greedy", "top_k")
)
def _generate_jit(
    graphdef: Any,
    state: Any,
    prompt: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    eos_id: jax.Array,
    *,
    max_new_tokens: int,
    greedy: bool,
    top_k: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (tokens [N] padded with -1, count generated, whether eos stopped it)."""
    model = nnx.merge(graphdef, state)
    batch, plen = prompt.shape
    pick = functools.partial(_pick, temperature=temperature, greedy=greedy, top_k=top_k)

    cache = model.init_cache(batch, plen + max_new_tokens)
    positions = jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), (batch, plen))
    logits, cache = model.decode(prompt, positions, cache)
    tok = pick(logits[:, -1], jax.random.fold_in(key, 0))
    out = jnp.full((max_new_tokens,), -1, jnp.int32).at[0].set(tok[0])

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~done

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, tok, cache, out, _ = carry
        # Token i-1 sits at position plen + i - 1; its logits choose token i.
        pos = jnp.full((batch, 1), plen + i - 1, jnp.int32)
        logits, cache = model.decode(tok[:, None], pos, cache)
        tok = pick(logits[:, -1], jax.random.fold_in(key, i))
        return i + 1, tok, cache, out.at[i].set(tok[0]), tok[0] == eos_id

    init = (jnp.asarray(1, jnp.int32), tok, cache, out, tok[0] == eos_id)
    n, _, _, out, done = lax.while_loop(cond, body, init)
    return out, n, done


def _validate(
    model: FamilyModel,
    prompt: np.ndarray,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    eos_id: int | None,
) -> None:
    cfg = model.cfg
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise ConfigError(f"max_new_tokens must be an integer, got {max_new_tokens!r}.")
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}.")
    if prompt.ndim != 1 or prompt.size == 0:
        raise ConfigError(
            f"The prompt must be a non-empty 1-D list of token ids, got shape {prompt.shape}."
        )
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ConfigError(f"The prompt must hold integer token ids, got dtype {prompt.dtype}.")
    if prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
        raise ConfigError(
            f"Prompt token ids must lie in [0, {cfg.vocab_size}), got ids from {prompt.min()} to {prompt.max()}."
        )
    if prompt.size + max_new_tokens > cfg.max_position_embeddings:
        raise ConfigError(
            f"The prompt ({prompt.size} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_position_embeddings ({cfg.max_position_embeddings}); shorten one of them."
        )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float | np.number)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ConfigError(f"temperature must be a finite number >= 0, got {temperature}.")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1
    ):
        raise ConfigError(f"top_k must be an integer >= 1 or unset, got {top_k!r}.")
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ConfigError(f"eos_id must lie in [0, {cfg.vocab_size}), got {eos_id}.")


def generate(
    model: FamilyModel,
    prompt_ids: list[int] | np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    eos_id: int | None = None,
) -> dict[str, Any]:
    """Generate up to max_new_tokens after prompt_ids (one sequence).

    temperature 0 or top_k 1 is greedy; otherwise sample softmax(logits / temperature) over the
    top_k best (all tokens when top_k is None or >= vocab). Returns {"tokens": new ids (ending
    with eos_id when it stopped there), "stop_reason": "eos" | "max_new_tokens",
    "prompt_len": int}. Raises ConfigError on bad arguments.
    """
    prompt = np.asarray(prompt_ids)
    if prompt.size == 0:
        prompt = prompt.astype(np.int32)  # np.asarray([]) is float; report emptiness, not dtype
    _validate(model, prompt, max_new_tokens, temperature, top_k, eos_id)
    greedy = temperature == 0 or top_k == 1
    # top_k >= vocab restricts nothing; greedy ignores it (and so does not compile per value).
    top_k = None if top_k is None or greedy else min(int(top_k), model.cfg.vocab_size)

    graphdef, state = nnx.split(model)
    out, n, done = _generate_jit(
        graphdef,
        state,
        jnp.asarray(prompt[None, :], jnp.int32),
        jax.random.key(seed),
        jnp.asarray(temperature if temperature > 0 else 1.0, jnp.float32),
        jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
        max_new_tokens=int(max_new_tokens),
        greedy=greedy,
        top_k=top_k,
    )
    tokens = np.asarray(out)[: int(n)].tolist()
    return {
        "tokens": tokens,
        "stop_reason": "eos" if bool(done) else "max_new_tokens",
        "prompt_len": int(prompt.size),
    }
