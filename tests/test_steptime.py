"""The plan's step-time estimate (runtime/plan/steptime.py): a roofline over the compiled HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from runtime.plan import steptime

CHIP = steptime.Chip("test", peak_flops=1e12, hbm_bytes_per_s=1e9, interconnect_bytes_per_s=1e9)


def _compiled_scan(layers: int = 16, d: int = 256, b: int = 8):
    def f(w, h):
        return lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)[0]

    w, h = jnp.ones((layers, d, d)), jnp.ones((b, d))
    return jax.jit(f).lower(w, h).compile()


def test_a_scan_reads_one_layer_per_iteration_and_counts_every_matmul():
    layers, d, b = 16, 256, 8
    est = steptime.estimate(_compiled_scan(layers, d, b).as_text(), CHIP, tokens_per_step=b)
    assert est["matmul_flops_per_chip"] == layers * 2 * b * d * d
    stack = layers * d * d * 4
    # Each iteration moves its layer (d x d; here sliced out, written, read by the matmul), not
    # the whole stack: a few stacks in all, where reading the stack every time would be 16.
    assert stack <= est["hbm_bytes_per_chip"] < 4 * stack, est
    assert abs(est["step_seconds"] - sum(est["seconds"].values())) < 1e-5
    # At 1 GB/s against 1 TFLOP/s the small matmuls are memory-bound.
    assert est["bound"] == "memory" and est["seconds"]["communication"] == 0
    assert est["tokens_per_s_per_chip"] == round(b / sum(est["seconds"].values()))


def test_kernel_flops_are_charged_against_peak():
    text = _compiled_scan().as_text()
    base = steptime.estimate(text, CHIP)
    more = steptime.estimate(text, CHIP, kernel_flops=5e12)
    assert more["seconds"]["compute"] >= base["seconds"]["compute"] + 5.0 - 1e-3


def test_chip_figures_come_from_the_table():
    c = steptime.chip("tpu-v5e", 197e12)
    assert c is not None and c.hbm_bytes_per_s == 819e9
    assert steptime.chip("tpu-v5e", None) is None  # no peak, no estimate
    assert steptime.chip("no-such-chip", 1e12) is None
