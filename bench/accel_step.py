"""The runtime's own train step on whatever accelerator is attached: tokens/s, MFU and memory.

    python bench/accel_step.py [--model configs/models/qwen3-0.6b.toml|tiny] [--shapes 2048x8,4096x4]
                               [--steps 20] [--set model.remat=block ...] [--profile-top 15]
                               [--variant 'NAME:KEY=VALUE;KEY=VALUE' ...]

Each `--variant` runs every shape again with its settings on top of the `--set` ones (rows carry
`variant`), in the same process, so variants are compared under the same conditions. Besides
run-config keys a variant may set two kernel knobs that are not run settings:
`kernel.splash_block=N` (splash attention's block sizes, all eight of them) and
`kernel.fused_ce=false` (the chunked loss with autodiff's recomputed logits instead of the
fused gradient, train/loss.py FUSED_CROSS_ENTROPY).

For each shape (seq_len x global batch), in one process, one after another (each step, its
state and its compiled program are dropped before the next shape is built, so two models never
share the chip), it builds the step exactly as `runtime/train/loop.py` does
(bench/step_overhead.py `runtime_step`: AdamW, clip, accumulation, donation), compiles it ahead
of time, runs one warm step and `--steps` timed ones, and prints one JSON row:

  tokens_per_s, step_s          steady state, over the timed steps
  mfu, mfu_causal               tokens/s x FLOPs/token / peak; `mfu` counts attention in full
                                (6N + 12LTHD, jaxjob's and torchtitan's count), `mfu_causal`
                                halves attention's term (6N + 6LTHD, as MaxText counts)
  compiled                      memory_analysis() of the step compiled here, per device:
                                arguments, outputs, aliased, temporaries, XLA's live peak,
                                the bound (= arguments + temporaries + outputs - aliased),
                                and the device's usable HBM (memory_stats bytes_limit)
  measured_peak_gib             memory_stats()["peak_bytes_in_use"] after the steps (buffers:
                                parameters, optimizer state, batches; not the program's
                                temporaries, which the TPU runtime reserves apart)
  compile_s, first_step_s       ahead-of-time compile; the first (warm) step
  top_ops                       with --profile-top K: the K XLA ops with the most device time
                                over 3 traced steps (ms per step, share of the step)

A shape that does not fit is a row with "error" (the compiler's RESOURCE_EXHAUSTED), and the
next shape runs. The model is the [model] table of `--model` (its remat, dtypes and attention
as a run config including it gets them); `--model tiny` runs in seconds on a CPU
(tests/test_bench_accel.py).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_overhead, gpu_check

from runtime.host import platform  # noqa: E402

platform.choose()  # before jax: the attached accelerator, without probing the others

import jax  # noqa: E402
from gpu_check import SIZES  # noqa: E402
from step_overhead import runtime_step  # noqa: E402

from jobspec.files.run_toml import merge, parse_run_config  # noqa: E402
from runtime.model.attention import kernels as attention_module  # noqa: E402
from runtime.model.flops import flops_per_token  # noqa: E402
from runtime.run.artifacts import device_peak  # noqa: E402

GIB = 2**30
DEFAULT_SPLASH_BLOCKS = attention_module._SPLASH_BLOCKS


def model_table(model: str) -> dict[str, Any]:
    if model in SIZES:
        return {**SIZES[model], "compute_dtype": "bfloat16"}
    import tomllib

    with open(model, "rb") as f:
        return tomllib.load(f)["model"]


def run_config(model: str, seq_len: int, batch: int, sets: dict[str, Any]):
    base = {
        "run": {"id": "accel-step", "seed": 0},
        "model": model_table(model),
        "data": {"manifest": "unused/manifest.json"},
        "training": {
            "seq_len": seq_len, "global_batch_size": batch,
            "target_tokens": seq_len * batch * 1000,
        },
    }  # fmt: skip
    return parse_run_config(merge(base, sets))


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    import tomllib

    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        cur = out
        *parents, leaf = key.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[leaf] = value
    return out


def apply_kernel_knobs(knobs: dict[str, Any]) -> None:
    """Set (or reset, for an empty dict) the bench-only kernel knobs of a variant."""
    from runtime.train import loss

    unknown = set(knobs) - {"splash_block", "fused_ce"}
    if unknown:
        raise SystemExit(f"error: unknown kernel knob(s) {sorted(unknown)}")
    block = knobs.get("splash_block")
    attention_module._SPLASH_BLOCKS = (block,) if block else DEFAULT_SPLASH_BLOCKS
    attention_module._splash_kernel.cache_clear()
    loss.FUSED_CROSS_ENTROPY = bool(knobs.get("fused_ce", True))


def compiled_memory(compiled) -> dict[str, float] | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    args, out = m.argument_size_in_bytes, m.output_size_in_bytes
    alias, temp = m.alias_size_in_bytes, m.temp_size_in_bytes
    return {
        "arguments_gib": round(args / GIB, 3),
        "outputs_gib": round(out / GIB, 3),
        "aliased_gib": round(alias / GIB, 3),
        "temporaries_gib": round(temp / GIB, 3),
        # XLA's liveness peak (what the chip needs; runtime/plan/compile.py memory_report) and
        # the sum of the totals, which overstates it.
        "peak_gib": round(int(getattr(m, "peak_memory_in_bytes", 0) or 0) / GIB, 3) or None,
        "bound_gib": round((args + temp + out - alias) / GIB, 3),
    }


def top_ops(fn, state, batch, k: int, steps: int = 3) -> tuple[Any, list[dict[str, Any]]]:
    """The k XLA ops with the most device time over `steps` traced steps."""
    from jax._src.lib import _profile_data

    totals: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory(prefix="accel-step-trace-") as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            state, out = fn(state, batch)
        jax.block_until_ready((state, out))
        jax.profiler.stop_trace()
        for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
            data = _profile_data.ProfileData.from_file(path)
            for plane in data.planes:
                if not plane.name.startswith("/device:"):
                    continue
                for line in plane.lines:
                    if line.name == "XLA Ops":
                        for e in line.events:
                            totals[e.name] += e.duration_ns
    busy = sum(totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:k]
    return state, [
        {"op": name, "ms_per_step": round(ns / steps / 1e6, 3), "share": round(ns / busy, 4)}
        for name, ns in rows
    ]


def measure(model: str, seq_len: int, batch: int, steps: int, sets: dict, profile_top: int):
    """One shape's row; remat "auto" as a run resolves it (runtime.train.program.remat_choices:
    the first policy whose step compiles within the chip's memory; `remat` says which)."""
    from runtime.train.program import OUT_OF_MEMORY, remat_choices, with_remat

    cfg = run_config(model, seq_len, batch, sets)
    choices = remat_choices(cfg, jax.devices()[0].platform)
    for remat in choices:
        row = measure_config(with_remat(cfg, remat), steps, sets, profile_top)
        if not OUT_OF_MEMORY.search(row.get("error", "")):
            break
    return {**row, "remat": remat}


def measure_config(cfg, steps: int, sets: dict, profile_top: int) -> dict[str, Any]:
    seq_len, batch = cfg.training.seq_len, cfg.training.global_batch_size
    row: dict[str, Any] = {"seq_len": seq_len, "batch": batch, "sets": sets}
    devices = jax.devices()
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    fn, state, device_batch, parts, _ = runtime_step(cfg)
    del parts  # the state holds the parameters; nothing else may keep a second copy alive
    try:
        t0 = time.perf_counter()
        compiled = fn.lower(state, device_batch).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        row["compiled"] = compiled_memory(compiled)
        if row["compiled"] and limit:
            row["compiled"]["hbm_gib"] = round(limit / GIB, 3)
        t0 = time.perf_counter()
        state, out = compiled(state, device_batch)
        jax.block_until_ready(out)
        row["first_step_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, out = compiled(state, device_batch)
        jax.block_until_ready((state, out))
        dt = (time.perf_counter() - t0) / steps
        row["loss"] = float(out["loss"]) if isinstance(out, dict) and "loss" in out else None
        tps = cfg.training.tokens_per_step / dt  # x gradient_accumulation_steps
        f = flops_per_token(cfg.model, seq_len)
        causal = f["total"] - f.get("attention", 0.0) / 2
        name, peak = device_peak(devices)
        n = len(devices)
        row.update(
            step_s=round(dt, 4),
            tokens_per_s=round(tps),
            flops_per_token=f["total"],
            flops_per_token_causal=causal,
            accelerator=name,
            mfu=round(tps * f["total"] / (peak * n), 4) if peak else None,
            mfu_causal=round(tps * causal / (peak * n), 4) if peak else None,
        )
        stats = devices[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            row["measured_peak_gib"] = round(stats["peak_bytes_in_use"] / GIB, 3)
        if profile_top:
            state, row["top_ops"] = top_ops(compiled, state, device_batch, profile_top)
    except Exception as e:  # noqa: BLE001 - an OOM is this shape's row, not the bench's end
        row["error"] = str(e).splitlines()[0][:400]
    finally:
        del state, device_batch, fn
        gc.collect()
        jax.clear_caches()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="configs/models/qwen3-0.6b.toml",
        help="a TOML file with a [model] table, or 'tiny'",
    )
    ap.add_argument("--shapes", default="2048x8", help="seq_len x global batch, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--profile-top", type=int, default=0, metavar="K")
    ap.add_argument("--variant", dest="variants", action="append", default=[],
                    metavar="NAME:KEY=VALUE;...")  # fmt: skip
    args = ap.parse_args()
    variants = []
    for v in args.variants or [":"]:
        name, _, pairs = v.partition(":")
        more = parse_sets(args.sets + [p for p in pairs.split(";") if p.strip()])
        variants.append((name or None, more.pop("kernel", {}), more))
    devices = jax.devices()
    head = {"bench": "accel_step", "model": args.model, "backend": jax.default_backend(),
            "device_kind": devices[0].device_kind, "devices": len(devices)}  # fmt: skip
    for name, knobs, sets in variants:
        apply_kernel_knobs(knobs)
        for shape in args.shapes.split(","):
            seq, _, batch = shape.strip().partition("x")
            row = measure(args.model, int(seq), int(batch), args.steps, sets, args.profile_top)
            tag = {"variant": name, "kernel": knobs} if name else {}
            print(json.dumps({**head, **tag, **row}), flush=True)


if __name__ == "__main__":
    main()
