"""The accelerator check of the Qwen3 model: bf16 vs fp32 logits, and train-step tokens/s + MFU.

    python bench/gpu_check.py [--size qwen3-0.6b|tiny] [--seq-len 2048] [--batch 8] [--steps 10]

Prints one JSON object:
  logits   one random batch through the same parameters twice, compute_dtype float32 and
           bfloat16 (parameters float32 in both): max and mean |bf16 - fp32| of the logits, and
           how often the argmax agrees.
  step     the runtime's own jitted train step (as runtime/train/loop.py builds it: AdamW, clip,
           accumulation scan, donation) on compute_dtype bfloat16: steady-state tokens/s over
           `--steps` steps after one warm step, and MFU = tokens/s × FLOPs/token / peak, where the
           device's peak is in the catalogue (none on CPU: MFU is then null, never a guess);
           and runtime_over_baseline, its tokens/s over the hand-written step of
           bench/step_overhead.py (baseline_step) on the same batch in the same process.
`--size tiny` runs the same code in seconds on a CPU, which is how it is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_overhead, beside this file

from step_overhead import baseline_step, runtime_step, time_steps  # noqa: E402

from jobspec.files.run_toml import parse_run_config  # noqa: E402
from runtime.model.build import build_model  # noqa: E402
from runtime.model.flops import flops_per_token  # noqa: E402
from runtime.model.sharding import build_mesh  # noqa: E402
from runtime.run.artifacts import device_peak  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    # Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 q / 8 kv heads of 128, SwiGLU 3072, tied).
    "qwen3-0.6b": {
        "vocab_size": 151936, "hidden_size": 1024, "num_layers": 28, "num_heads": 16,
        "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "tie_word_embeddings": True,
    },
    "tiny": {
        "vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256,
    },
}  # fmt: skip


def run_config(size: str, seq_len: int, batch: int, compute_dtype: str, remat: str):
    return parse_run_config(
        {
            "run": {"id": "gpu-check", "seed": 0},
            "model": {**SIZES[size], "compute_dtype": compute_dtype, "remat": remat},
            "data": {"manifest": "unused/manifest.json"},
            "training": {
                "seq_len": seq_len,
                "global_batch_size": batch,
                "target_tokens": seq_len * batch * 1000,
            },
        }  # fmt: skip
    )


def logits_diff(size: str, seq_len: int, batch: int) -> dict[str, Any]:
    mesh = build_mesh(run_config(size, seq_len, batch, "float32", "none").mesh)
    rng = np.random.default_rng(0)
    vocab = SIZES[size]["vocab_size"]
    inputs = rng.integers(0, vocab, (batch, seq_len), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len))
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = run_config(size, seq_len, batch, dtype, "none")
        parts = build_model(cfg.model, cfg.run.seed, mesh)  # same seed: the same fp32 params
        # Parameters are an argument, not closed-over constants (0.6B of them would be baked in).
        fwd = jax.jit(
            lambda params, x, p, g=parts.graphdef, o=parts.others: nnx.merge(g, params, *o)(x, p)
        )
        out[dtype] = np.asarray(fwd(parts.params, inputs, positions))
    diff = np.abs(out["bfloat16"] - out["float32"])
    agree = out["bfloat16"].argmax(-1) == out["float32"].argmax(-1)
    return {
        "shape": list(out["float32"].shape),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "fp32_logit_std": float(out["float32"].std()),
        "argmax_agreement": float(agree.mean()),
    }


def step_throughput(size: str, seq_len: int, batch: int, steps: int, remat: str) -> dict[str, Any]:
    cfg = run_config(size, seq_len, batch, "bfloat16", remat)
    fn, state, device_batch, parts, tx = runtime_step(cfg)
    base_fn, base = baseline_step(cfg, parts, tx)  # before `fn` donates parts.params
    t0 = time.perf_counter()
    state, out = fn(state, device_batch)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    _, dt = time_steps(fn, state, device_batch, steps)
    tps = steps * batch * seq_len / dt
    # The same batch through the hand-written step in this process, after the runtime's.
    del state
    _, base_dt = time_steps(base_fn, base, device_batch, steps)
    base_tps = steps * batch * seq_len / base_dt
    fpt = flops_per_token(cfg.model, seq_len)["total"]
    devices = jax.devices()
    name, peak = device_peak(devices)
    stats = devices[0].memory_stats() or {}
    return {
        "seq_len": seq_len,
        "batch": batch,
        "steps": steps,
        "remat": remat,
        "first_step_s": round(first_s, 2),
        "step_s": round(dt / steps, 4),
        "tokens_per_s": round(tps),
        "baseline_tokens_per_s": round(base_tps),
        "runtime_over_baseline": round(tps / base_tps, 3),
        "flops_per_token": fpt,
        "accelerator": name,
        "peak_bf16_flops": peak,
        "mfu": round(tps * fpt / (peak * len(devices)), 4) if peak else None,
        "peak_memory_gib": round(stats["peak_bytes_in_use"] / 2**30, 2)
        if "peak_bytes_in_use" in stats
        else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="qwen3-0.6b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--remat", choices=("none", "block", "full"), default="block")
    ap.add_argument("--logits-batch", type=int, default=2)
    args = ap.parse_args()
    devices = jax.devices()
    result = {
        "bench": "gpu_check",
        "size": args.size,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "parameters": int(
            sum(
                np.prod(s.shape)
                for s in jax.tree.leaves(
                    build_model(
                        run_config(args.size, 8, 1, "float32", "none").model,
                        0,
                        build_mesh(run_config(args.size, 8, 1, "float32", "none").mesh),
                        materialise=False,
                    ).params
                )
            )
        ),  # fmt: skip
        "logits": logits_diff(args.size, min(args.seq_len, 512), args.logits_batch),
        "step": step_throughput(args.size, args.seq_len, args.batch, args.steps, args.remat),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
