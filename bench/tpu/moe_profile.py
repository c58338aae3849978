"""bench/accel_step.py with each profiled step's trace summarised to a file, plus two bench-only
MoE knobs, to measure where jaxjob's MoE step spends its time on the chip.

    python3 bench/tpu/moe_profile.py --out-dir DIR [--hlo] ACCEL_STEP_ARGS...

Runs bench/accel_step.py's main with ACCEL_STEP_ARGS (give it `--profile-top K`). For every
profiled shape and variant it writes DIR/profile-N.json (bench/tpu/xplane_summary.py's summary
of the 3 traced steps, with the variant's settings) and, with --hlo, DIR/hlo-N.txt.gz (the
compiled step's optimised HLO, whose op names the summary's ops carry). The row's `top_ops` are
the K ops with the most self time (a `while` loop's body is counted in its ops, not the loop).

Besides accel_step's kernel knobs a `--variant` may set (they swap a function of
runtime/model/moe/dispatch.py for this process, to size a change first; since 2026-12-07 the
runtime's defaults are tiles 512 x 1024 x 1024 fitted this way and the lean gather permutes, so
these now compare other settings against those defaults):
  kernel.gmm_tiling=TMxTKxTN   megablox tiles: TM rows, and the contracted / output widths
                               each split into the largest multiple of 128 that divides them
                               and is at most TK / TN (the runtime's default: 512 x 1024 x 1024;
                               it was 128 x 512 x 512, which split 768 into 512 + 256)
  kernel.permute=gather        one device, dropless: the tokens are repeated k times and
                               permuted with a gather whose gradient is the inverse gather,
                               and the results come back the same way (the runtime's default is the
                               lean variant below)
  kernel.permute=gather_lean   the same, and the inverse permutation by a sort and the
                               expert counts by a compare-and-sum (the runtime's default)
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import accel_step  # noqa: E402  (chooses the platform before jax)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import xplane_summary  # noqa: E402

from runtime.model.moe import dispatch as moe_dispatch  # noqa: E402

ORIGINAL_GMM = moe_dispatch._grouped_matmul
ORIGINAL_PER_DEVICE = moe_dispatch._per_device
ORIGINAL_KNOBS = accel_step.apply_kernel_knobs
ORIGINAL_MEASURE = accel_step.measure
STATE: dict[str, Any] = {"out": None, "hlo": False, "n": 0, "label": {}}


def lut(tm: int, tk: int, tn: int) -> Any:
    """A megablox tiling function: the runtime's rule (moe_dispatch.megablox_tiling) with its
    own width caps for the contracted and output widths."""
    if tk == tn:
        return moe_dispatch.megablox_tiling(tm, tk)
    return _lut(tm, tk, tn)


@functools.cache
def _lut(tm: int, tk: int, tn: int) -> Any:  # one object per triple: a static kernel argument
    def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
        return (min(tm, m), moe_dispatch.fit_tile(k, tk), moe_dispatch.fit_tile(n, tn))

    return tiling


def tiled_gmm(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, kernel: str, tiles: tuple[int, int, int]
) -> jax.Array:
    """moe_dispatch._grouped_matmul with the megablox tiles of `tiles` (see `lut`)."""
    if kernel != "megablox":
        return ORIGINAL_GMM(x, w, group_sizes, kernel)
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    r = x.shape[0]
    tm = tiles[0] if r >= tiles[0] else -(-r // 8) * 8
    pad = -r % tm
    rows = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    interpret = moe_dispatch.target_platform() != "tpu"  # off a TPU: Pallas' interpreter
    out = gmm(rows, w, group_sizes, x.dtype, lut(tm, *tiles[1:]), None, None, False, interpret)
    return out[:r] if pad else out


permute_rows = moe_dispatch._permute  # x[perm], gradient g[inverse]: the runtime's own


def per_device_gather(
    tokens: jax.Array,
    index: jax.Array,
    w: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: Any,
    cap: int | None,
    expert_axis: str | None,
    tensor_axis: str | None,
    ragged: bool = False,
    kernel: str = "ragged_dot",
    lean: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """moe_dispatch._per_device on one device, dropless, with gathers both ways (no scatter);
    `lean` also finds the inverse permutation and the group sizes without a scatter."""
    if cap is not None or expert_axis is not None or tensor_axis is not None:
        return ORIGINAL_PER_DEVICE(
            tokens, index, w, gate, up, down, activation, cap, expert_axis, tensor_axis,
            ragged, kernel,
        )  # fmt: skip
    n, d = tokens.shape
    k = index.shape[1]
    m = n * k
    flat = index.reshape(m)
    order = jnp.argsort(flat, stable=True)
    if lean:  # a sort and a compare-and-sum instead of two scatters (the runtime's)
        inverse = jnp.argsort(order)
        experts = jnp.arange(gate.shape[0], dtype=flat.dtype)
        counts = jnp.sum(flat[:, None] == experts[None, :], axis=0, dtype=jnp.int32)
    else:
        inverse = moe_dispatch._inverse(order)
        counts = jax.ops.segment_sum(jnp.ones((m,), jnp.int32), flat, num_segments=gate.shape[0])
    rows = permute_rows(jnp.repeat(tokens, k, axis=0), order, inverse)  # = tokens[order // k]
    gmm = functools.partial(
        moe_dispatch._grouped_matmul, group_sizes=counts.astype(jnp.int32), kernel=kernel
    )
    out = gmm(activation(gmm(rows, gate)) * gmm(rows, up), down)
    per_assignment = permute_rows(out, inverse, order).reshape(n, k, d)
    y = jnp.einsum("nkd,nk->nd", per_assignment, w.astype(per_assignment.dtype))
    return y, jnp.zeros((1,), jnp.int32)


def apply_knobs(knobs: dict[str, Any]) -> None:
    """accel_step's kernel knobs, plus gmm_tiling and permute (this module's docstring)."""
    rest = dict(knobs)
    tiles = rest.pop("gmm_tiling", None)
    permute = rest.pop("permute", None)
    if permute not in (None, "gather", "gather_lean"):
        raise SystemExit(f"error: kernel.permute={permute!r}; it is gather or gather_lean")
    moe_dispatch._grouped_matmul = ORIGINAL_GMM
    if tiles:
        triple = tuple(int(t) for t in str(tiles).split("x"))
        moe_dispatch._grouped_matmul = functools.partial(tiled_gmm, tiles=triple)
    moe_dispatch._per_device = ORIGINAL_PER_DEVICE
    if permute:
        lean = permute == "gather_lean"
        moe_dispatch._per_device = functools.partial(per_device_gather, lean=lean)
    STATE["label"] = {"knobs": dict(knobs)}
    ORIGINAL_KNOBS(rest)


def measure(model: str, seq_len: int, batch: int, steps: int, sets: dict, profile_top: int):
    STATE["label"] = {**STATE["label"], "sets": sets, "seq_len": seq_len, "batch": batch}
    return ORIGINAL_MEASURE(model, seq_len, batch, steps, sets, profile_top)


def top_ops(fn: Any, state: Any, batch: Any, k: int, steps: int = 3):
    """accel_step.top_ops, keeping the trace's summary (and the HLO) under --out-dir."""
    n = STATE["n"]
    STATE["n"] += 1
    folder = tempfile.mkdtemp(prefix=f"moe-trace-{n}-")
    try:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            state, out = fn(state, batch)
        jax.block_until_ready((state, out))
        jax.profiler.stop_trace()
        summary = {**STATE["label"], **xplane_summary.summarise(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    with open(os.path.join(STATE["out"], f"profile-{n}.json"), "w") as f:
        json.dump(summary, f)
    if STATE["hlo"]:
        with gzip.open(os.path.join(STATE["out"], f"hlo-{n}.txt.gz"), "wt") as f:
            f.write(fn.as_text())
    print(f"[moe_profile] profile-{n} {json.dumps(STATE['label'])}", file=sys.stderr)
    print(xplane_summary.table(summary, 30), file=sys.stderr, flush=True)
    return state, [
        {"op": r["op"], "self_ms": r["self_ms"], "share": r["share"],
         "category": r["stats"].get("hlo_category")}
        for r in summary["ops"][:k]
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--hlo", action="store_true", help="also write each profiled step's HLO")
    args, rest = ap.parse_known_args()
    os.makedirs(args.out_dir, exist_ok=True)
    # Number after the profiles already there, so a second run into the same folder adds to it.
    taken = len(glob.glob(os.path.join(args.out_dir, "profile-*.json")))
    STATE.update(out=args.out_dir, hlo=args.hlo, n=taken)
    accel_step.apply_kernel_knobs = apply_knobs
    accel_step.measure = measure
    accel_step.top_ops = top_ops
    sys.argv = [os.path.join(os.path.dirname(HERE), "accel_step.py"), *rest]
    accel_step.main()


if __name__ == "__main__":
    main()
