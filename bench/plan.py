"""Plans a matrix of real model sizes for real targets and prints one JSON row per plan.

Each plan is `runtime plan CFG --accelerator A --json` in its own process (the exact train step a
worker would run, compiled on this machine for the target's compile-only devices; no hardware,
no data). Rows: model, target, seq, batch per chip, remat, scan, fits, peak GiB per chip, HBM
GiB, compiled and analytic FLOPs per step and their ratio, collective bytes per chip and step, compile
seconds. All figures are compiled estimates, not measurements on the chip.

    python bench/plan.py                       # the issue's matrix (minutes per TPU pod plan)
    python bench/plan.py --only qwen3-8b-v5p   # rows whose name contains the string
    python bench/plan.py --quick               # a tiny model on small targets (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (run config, accelerator, extra CLI args, --set overrides)
V5P_8B = "configs/plan/qwen3-8b-v5p-256.toml"
V5P_1_7B = "configs/plan/qwen3-1.7b-v5p-256.toml"
QNEXT = "configs/plan/qwen3-next-80b-a3b-v5p-256.toml"
# FLOPs against 6N + 12LHQT: the xla attention (a custom-call kernel's FLOPs are invisible to the
# HLO count; xla computes the full T x T product, exactly the 12LHQT convention).
XLA = ["model.attention=xla"]
TINY_MOE = ["model.family=qwen3_moe", "model.num_experts=8", "model.num_experts_per_tok=2",
            "model.moe_intermediate_size=64", "mesh.fsdp=2"]  # fmt: skip
MATRIX: dict[str, tuple[str, str, list[str], list[str]]] = {
    "qwen3-8b-v5p256-seq4096": (V5P_8B, "tpu-v5p-256", [], []),
    "qwen3-8b-4L-v5p256-seq4096": (V5P_8B, "tpu-v5p-256", [], ["model.num_layers=4"]),
    "qwen3-8b-v5p256-seq2048": (V5P_8B, "tpu-v5p-256", [], ["training.seq_len=2048"]),
    "qwen3-1.7b-v5p256-seq4096": (V5P_1_7B, "tpu-v5p-256", [], []),
    "qwen3-1.7b-v5p256-seq2048": (V5P_1_7B, "tpu-v5p-256", [], ["training.seq_len=2048"]),
    "qwen3-8b-h100x32-seq4096": ("configs/plan/qwen3-8b-h100x32.toml", "h100-80gb", ["--hosts", "4"], []),
    "qwen3-32b-v5p256-seq4096": ("configs/plan/qwen3-32b-v5p-256.toml", "tpu-v5p-256", [], []),
    "flops-qwen3-8b-v5p256-remat-full-xla": (V5P_8B, "tpu-v5p-256", [], XLA),
    "flops-qwen3-8b-8L-v5p256-remat-none-xla-whole-loss": (
        V5P_8B, "tpu-v5p-256", [],
        [*XLA, "model.remat=none", "model.num_layers=8", "training.loss_chunk_size=0"]),
    "flops-qwen3-8b-8L-v5p256-remat-none-xla": (
        V5P_8B, "tpu-v5p-256", [], [*XLA, "model.remat=none", "model.num_layers=8"]),
    "gemma4-31b-v5p128-seq4096": ("configs/plan/gemma4-31b-v5p-128.toml", "tpu-v5p-128", [], []),
    "gemma4-31b-h100x32-seq4096": (
        "configs/plan/gemma4-31b-h100x32.toml", "h100-80gb", ["--hosts", "4"], []),
    "qwen3-next-80b-a3b-v5p256-fsdp128-seq4096": (QNEXT, "tpu-v5p-256", [], []),
    "qwen3-next-80b-a3b-v5p256-fsdp32-tensor4-seq4096": (
        QNEXT, "tpu-v5p-256", [],
        ["mesh.fsdp=32", "mesh.tensor=4", "training.global_batch_size=32"]),
    # Expert parallelism (mesh.expert = 8), dropless sparse dispatch.
    "qwen3-30b-a3b-v5p256-ep8-fsdp16-seq4096": (
        "configs/plan/qwen3-30b-a3b-v5p-256.toml", "tpu-v5p-256", [], []),
    "qwen3-30b-a3b-h100x32-ep8-fsdp4-seq4096": (
        "configs/plan/qwen3-30b-a3b-h100x32.toml", "h100-80gb", ["--hosts", "4"], []),
    "qwen3-30b-a3b-h100x32-ep8-fsdp4-cf1.25-seq4096": (
        "configs/plan/qwen3-30b-a3b-h100x32.toml", "h100-80gb", ["--hosts", "4"],
        ["model.moe_capacity_factor=1.25"]),
}  # fmt: skip


def run_plan(cfg: str, accelerator: str, extra: list[str], sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "runtime", "plan", cfg, "--accelerator", accelerator, "--json"]
    cmd += extra
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        msg = f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        raise SystemExit(msg) from None
    report["_wall_s"] = wall
    return report


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def row(name: str, report: dict) -> dict:
    mem, flops = report["memory"], report["flops"]
    model, t = report["model"], report["training"]
    compiled = flops.get("compiled") or {}
    coll = report.get("collectives") or {}
    return {
        "name": name,
        "parameters": model["parameters"],
        "target": report["target"]["accelerator"],
        "devices": report["target"]["devices"],
        "seq": t["seq_len"],
        "batch_per_chip": t["sequences_per_chip"],
        "remat": model["remat"],
        "scan_layers": model["scan_layers"],
        "attention": model["attention"],
        "moe_dispatch": report.get("moe_dispatch"),
        "fits": mem["fits"],
        "peak_gib_per_chip": _gib(mem.get("peak_bytes")),
        "temp_gib_per_chip": _gib(mem.get("temp_bytes")),
        "args_gib_per_chip": _gib(mem.get("argument_bytes")),
        "hbm_gib": _gib(mem.get("hbm_bytes")),
        "headroom": mem.get("headroom"),
        "compiled_flops_per_step": compiled.get("per_step"),
        "analytic_flops_per_step": flops["analytic"]["per_step"],
        "compiled_over_analytic": flops.get("compiled_over_analytic"),
        "attention_in_kernels": flops.get("attention_in_kernels"),
        "compiled_over_analytic_dense": flops.get("compiled_over_analytic_dense"),
        "uncounted_custom_calls": flops.get("uncounted_custom_calls"),
        # Per chip: every collective's result bytes, loop bodies times their trip count.
        "collective_bytes_per_chip": (coll.get("total") or {}).get("bytes"),
        # The MoE exchanges (part of the total): the most rows each can send, every loop trip.
        "ragged_all_to_all_bytes_per_chip": (coll.get("ragged_all_to_all") or {}).get("bytes"),
        "all_to_all_bytes_per_chip": ((coll.get("by_kind") or {}).get("all-to-all") or {}).get(
            "bytes"
        ),
        "collectives_across_slices_bytes": sum(
            v["bytes"] for v in (coll.get("across_slices") or {}).values()
        ),
        "compile_s": report["compile_seconds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the rows whose name contains this")
    ap.add_argument("--quick", action="store_true", help="tiny model, small targets (seconds)")
    args = ap.parse_args()
    matrix = MATRIX
    if args.quick:
        tiny = "configs/tiny_plan.toml"
        matrix = {
            "tiny-v5p8": (tiny, "tpu-v5p-8", [], ["mesh.fsdp=4"]),
            "tiny-h100x8": (tiny, "h100-80gb", ["--hosts", "1"], ["mesh.fsdp=8"]),
            "tiny-moe-ep2-v5p8": (tiny, "tpu-v5p-8", [], [*TINY_MOE, "mesh.expert=2"]),
        }
    for name, (cfg, acc, extra, sets) in matrix.items():
        if args.only in name:
            print(json.dumps(row(name, run_plan(cfg, acc, extra, sets))), flush=True)


if __name__ == "__main__":
    main()
