"""Gated DeltaNet core: the chunked form against the per-token scan (values, final states and
gradients), parity with transformers' Qwen3-Next reference functions, document resets in packed
rows, bf16 inputs, and a decode loop of one-token steps. Tiny shapes, CPU."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model.deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule

CHUNK = 8
TOL = dict(rtol=1e-4, atol=1e-5)

# The shapes are tiny, so compiling is most of this file's time: skip XLA CPU's backend
# optimisations and fusion emitters (that cuts compiling to about a quarter). Results come
# back as NumPy, so the checks compile nothing more.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
jit = partial(jax.jit, compiler_options=FAST_COMPILE)
chunked = jit(chunked_gated_delta_rule, static_argnames=("chunk_size", "use_qk_l2norm"))
recurrent = jit(recurrent_gated_delta_rule, static_argnames=("use_qk_l2norm",))


def inputs(
    b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0
) -> tuple[np.ndarray, ...]:
    """Random q, k, v, g (log-decays <= 0, as Qwen3-Next's -exp(A) * softplus(.)), beta in (0, 1),
    and an initial state, all fp32 NumPy."""
    r = np.random.default_rng(seed)
    f = np.float32
    q = r.normal(size=(b, t, hk, dk)).astype(f)
    k = r.normal(size=(b, t, hk, dk)).astype(f)
    v = r.normal(size=(b, t, hv, dv)).astype(f)
    g = (-np.exp(r.normal(size=hv) * 0.5) * np.log1p(np.exp(r.normal(size=(b, t, hv))))).astype(f)
    beta = (1 / (1 + np.exp(-r.normal(size=(b, t, hv))))).astype(f)
    state = r.normal(size=(b, hv, dk, dv)).astype(f)
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state=None) -> tuple[np.ndarray, np.ndarray]:
    """The recurrence token by token in NumPy fp32 (HF's semantics: grouped heads, q and k
    l2-normalised, q scaled by dk**-0.5): an independent check that compiles nothing."""
    q, k, v, g, beta = (np.asarray(x, np.float32) for x in (q, k, v, g, beta))
    rep = v.shape[2] // q.shape[2]
    q, k = (np.repeat(x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6), rep, 2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    b, t, h, dk = q.shape
    s = np.zeros((b, h, dk, v.shape[-1]), np.float32) if state is None else np.array(state)
    out = np.zeros(v.shape, np.float32)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None, None]
        delta = (v[:, i] - np.einsum("bhkv,bhk->bhv", s, k[:, i])) * beta[:, i, :, None]
        s = s + k[:, i, ..., None] * delta[..., None, :]
        out[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i])
    return out, s


# Packed rows of 21 tokens (chunks [0, 8), [8, 16), [16, 21) + padding): row 0 one document from
# a zero state; row 1 a document crossing a chunk edge, one starting on a chunk edge, then
# padding; row 2 leading padding (the initial state flows through it into document 1), padding
# across a chunk edge between documents, a document to the end.
SEG = np.array(
    [[1] * 21, [1] * 5 + [2] * 11 + [3] * 2 + [0] * 3, [0] * 2 + [1] * 6 + [0] * 2 + [2] * 11],
    np.int32,
)


@pytest.fixture(scope="module")
def forms() -> dict:
    """Both forms' outputs, final states and gradients on a plain batch (T a multiple of the
    chunk, zero state) and on the packed batch (ragged T, given states, SEG), plus chunked-only
    values for the other state/T combinations (T=13 with grouped value heads, with q/k
    normalised by the caller, with a chunk of 6), and the packed batch again with other values in its padding.
    One compiled program, called twice."""
    plain = inputs(2, 16, 2, 2, 8, 6, seed=1)
    ragged = inputs(2, 13, 1, 2, 8, 6, seed=2)  # grouped value heads: Hk=1 serves Hv=2
    packed = inputs(3, 21, 2, 2, 8, 6, seed=3)
    packed[5][0] = 0.0  # row 0 starts from a zero state
    r = np.random.default_rng(3)
    fns = {"chunked": partial(chunked_gated_delta_rule, chunk_size=CHUNK),
           "recurrent": recurrent_gated_delta_rule}  # fmt: skip

    # A random linear loss on the outputs and the final state, the same for both forms.
    weights = {
        case: (
            r.normal(size=x[2].shape).astype(np.float32),
            r.normal(size=x[5].shape).astype(np.float32),
        )
        for case, x in (("plain", plain), ("packed", packed))
    }

    def value_and_grads(fn, case, args, s0, seg):
        w_out, w_state = weights[case]

        def loss(*args):
            out, state = fn(*args, initial_state=s0, segment_ids=seg)
            return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

        grads, (out, state) = jax.grad(loss, (0, 1, 2, 3, 4), has_aux=True)(*args)
        return out, state, grads

    # A caller that l2-normalises and scales q/k itself passes use_qk_l2norm=False, scale=1.0.
    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    prenormed = (l2(ragged[0]) * 8**-0.5, l2(ragged[1]))

    @jit
    def run(plain, ragged, packed, prenormed):
        res = {}
        for name, fn in fns.items():
            res[f"{name}/plain"] = value_and_grads(fn, "plain", plain[:5], None, None)
            res[f"{name}/packed"] = value_and_grads(fn, "packed", packed[:5], packed[5], SEG)
        chunk = fns["chunked"]
        res["plain_s0"] = chunk(*plain[:5], initial_state=plain[5])
        res["ragged"] = chunk(*ragged[:5])
        res["ragged_s0"] = chunk(*ragged[:5], initial_state=ragged[5])
        res["ragged_s0_c6"] = chunked_gated_delta_rule(  # a chunk that is not a power of two
            *ragged[:5], chunk_size=6, initial_state=ragged[5]
        )
        res["ragged_s0_prenormed"] = chunk(*prenormed, *ragged[2:5], initial_state=ragged[5],
                                           use_qk_l2norm=False, scale=1.0)  # fmt: skip
        return res

    res = jax.tree.map(np.asarray, run(plain, ragged, packed, prenormed))
    pad = (SEG == 0)[..., None, None]
    noisy = [np.where(pad, x * 7 + 3, x) for x in packed[:3]]
    noisy += [np.where(pad[..., 0], x * 5 - 2, x) for x in packed[3:5]]
    res["noisy"] = jax.tree.map(
        np.asarray, run(plain, ragged, (*noisy, packed[5]), prenormed)["chunked/packed"]
    )
    return {"inputs": {"plain": plain, "ragged": ragged, "packed": packed}, **res}


def test_chunked_equals_recurrent(forms: dict) -> None:
    for case in ("plain", "packed"):
        out_c, st_c, grad_c = forms[f"chunked/{case}"]
        out_r, st_r, grad_r = forms[f"recurrent/{case}"]
        np.testing.assert_allclose(out_c, out_r, **TOL, err_msg=case)
        np.testing.assert_allclose(st_c, st_r, **TOL, err_msg=case)
        for name, gc, gr in zip("q k v g beta".split(), grad_c, grad_r, strict=True):
            assert np.all(np.isfinite(gc)), (case, name)
            np.testing.assert_allclose(gc, gr, rtol=1e-4, atol=1e-4, err_msg=f"{case} d/d{name}")
    # Every T/state combination against the NumPy recurrence.
    for case in ("chunked/plain", "plain_s0", "ragged", "ragged_s0", "ragged_s0_c6"):
        args = forms["inputs"][case.removeprefix("chunked/").split("_")[0]]
        want, want_state = reference(*args[:5], args[5] if "_s0" in case else None)
        out, state = forms[case][:2]
        np.testing.assert_allclose(out, want, **TOL, err_msg=case)
        np.testing.assert_allclose(state, want_state, **TOL, err_msg=case)


def test_matches_transformers(forms: dict) -> None:
    torch = pytest.importorskip("torch", reason="HF parity needs torch (CPU)")
    pytest.importorskip("transformers", reason="HF parity needs transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    # Ragged T with grouped value heads (Hk=1 serves Hv=2), dk != dv and a carried state; T a
    # multiple of the chunk from a zero state. HF l2-normalises in its kernel, as Qwen3-Next calls it.
    for case, state in (("ragged", True), ("plain", False)):
        q, k, v, g, beta, s0 = forms["inputs"][case]
        args = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
        kw = dict(initial_state=torch.from_numpy(s0) if state else None, output_final_state=True)
        wants = (
            hf.torch_chunk_gated_delta_rule(
                *args, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True, **kw
            ),
            hf.torch_recurrent_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, **kw),
        )
        ours = (
            ["ragged_s0", "ragged_s0_prenormed"] if state else ["chunked/plain", "recurrent/plain"]
        )
        for want in wants:
            for name in ours:
                np.testing.assert_allclose(forms[name][0], want[0].numpy(), **TOL, err_msg=name)
                np.testing.assert_allclose(forms[name][1], want[1].numpy(), **TOL, err_msg=name)


def test_segments_reset_at_document_boundaries(forms: dict) -> None:
    q, k, v, g, beta, s0 = forms["inputs"]["packed"]
    out, state, _ = forms["chunked/packed"]
    for row in range(len(SEG)):
        ids = [i for i in np.unique(SEG[row]) if i]
        for doc in ids:
            (pos,) = np.nonzero(SEG[row] == doc)
            one = [x[row : row + 1, pos] for x in (q, k, v, g, beta)]
            # The row's first document continues the initial state; the others start from zero.
            alone, alone_state = reference(*one, s0[row : row + 1] if doc == ids[0] else None)
            np.testing.assert_allclose(
                out[row : row + 1, pos], alone, **TOL, err_msg=f"{row}/{doc}"
            )
            if doc == ids[-1]:  # the final state is the one after the row's last real token
                np.testing.assert_allclose(state[row : row + 1], alone_state, **TOL)
        assert not np.any(out[row, SEG[row] == 0]), "padding outputs are zero"
    # Padding affects nothing: other values in the padded positions change no output or state.
    noisy_out, noisy_state, _ = forms["noisy"]
    np.testing.assert_array_equal(noisy_out, out)
    np.testing.assert_array_equal(noisy_state, state)


def test_bf16_inputs_stay_healthy() -> None:
    # Long memory and strong writes (g near 0, beta near 1): where a low-precision state drifts.
    q, k, v, _, _, s0 = inputs(2, 48, 2, 2, 16, 16, seed=7)
    r = np.random.default_rng(8)
    g = -r.uniform(0.0, 0.05, size=(2, 48, 2)).astype(np.float32)
    beta = r.uniform(0.8, 1.0, size=(2, 48, 2)).astype(np.float32)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)]  # NumPy (ml_dtypes) bf16
    out, state = chunked(*bf, chunk_size=16, initial_state=s0)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.all(np.isfinite(state))
    # The fp32 answer on the same (bf16-rounded) inputs: only the output rounding differs.
    want, want_state = reference(*bf, s0)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-4)


def test_decode_steps_continue_the_prefill() -> None:
    q, k, v, g, beta, s0 = inputs(2, 12, 2, 2, 8, 6, seed=9)
    full, full_state = chunked(q, k, v, g, beta, chunk_size=CHUNK, initial_state=s0)
    prefill = 5
    out, state = chunked(*(x[:, :prefill] for x in (q, k, v, g, beta)), chunk_size=CHUNK,
                         initial_state=s0)  # fmt: skip
    outs = [out]
    for t in range(prefill, 12):
        step = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        out, state = recurrent(*step, initial_state=state)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, **TOL)
    np.testing.assert_allclose(state, full_state, **TOL)


def test_bad_shapes_name_the_contract() -> None:
    q, k, v, g, beta, _ = inputs(1, 4, 2, 3, 8, 6)
    with pytest.raises(ValueError, match="Hv a multiple of Hk"):
        chunked_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, _ = inputs(1, 4, 2, 2, 8, 6)
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=np.zeros((1, 2, 6, 8)))
