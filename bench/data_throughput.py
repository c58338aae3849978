"""Loader throughput: the Grain pipeline's tokens/s against raw np.memmap slicing of the same shards.

    python bench/data_throughput.py [--steps 200] [--seq-len 256] [--batch 32] [--manifest M]

Prints one JSON object. Without --manifest, prepares `{stdlib}/**/*.py` (max 20 MB, byte
tokenizer) into a temp folder first. Both paths run in this process, one after the other, on the
same record ids, so the ratio is the loader's overhead (index math, Grain threads, layout arrays).

Importable: measure_loader(manifest_uri, seq_len, batch, steps, order, prefetch) -> dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_overhead, beside this file

from runtime.data.loader import TokenBatches  # noqa: E402
from runtime.data.manifest import load_manifest  # noqa: E402
from runtime.data.prepare.build import prepare_dataset  # noqa: E402

WARMUP_STEPS = 5  # thread start-up and the first epoch permutation are not throughput


def prepare_bench_data(out: str, max_bytes: int = 20_000_000) -> str:
    """Prepare the standard library's .py files into `out`; returns the manifest URI."""
    prepare_dataset(["{stdlib}/**/*.py"], "byte", out, val_fraction=0.01, max_bytes=max_bytes)
    return os.path.join(out, "manifest.json")


def _raw_memmap(tb: TokenBatches, steps: int) -> float:
    """Seconds to slice the same rows straight from np.memmap into int32 inputs/targets."""
    m = tb.manifest
    maps = [
        np.memmap(m.uri_of(sh.path), dtype=m.token_dtype, mode="r") for sh in m.splits.train.shards
    ]
    starts = np.cumsum([0] + [sh.tokens for sh in m.splits.train.shards])
    T, rows = tb.seq_len, tb.local_rows
    ids = [tb.local_record_ids(s).ravel() for s in range(WARMUP_STEPS + steps)]
    buf = np.empty((rows, T + 1), np.int32)

    def step(rids: np.ndarray) -> None:
        for r, rid in enumerate(rids):
            a = int(rid) * T
            k = int(np.searchsorted(starts, a, side="right")) - 1
            lo = a - starts[k]
            if lo + T + 1 <= len(maps[k]):
                buf[r] = maps[k][lo : lo + T + 1]
            else:  # row crosses a shard end
                buf[r] = np.concatenate([maps[k][lo:], maps[k + 1][: lo + T + 1 - len(maps[k])]])
        np.ascontiguousarray(buf[:, :-1]), np.ascontiguousarray(buf[:, 1:])

    for s in range(WARMUP_STEPS):
        step(ids[s])
    t0 = time.perf_counter()
    for s in range(WARMUP_STEPS, WARMUP_STEPS + steps):
        step(ids[s])
    return time.perf_counter() - t0


def measure_loader(
    manifest_uri: str,
    seq_len: int = 256,
    batch: int = 32,
    steps: int = 200,
    order: str = "shuffle",
    prefetch: int = 2,
) -> dict[str, Any]:
    """Tokens/s of TokenBatches.iterate (Grain) vs raw memmap slicing of the same rows."""
    m = load_manifest(manifest_uri)
    for sh in m.splits.train.shards:  # page the shards in, so neither side pays first-touch faults
        int(np.memmap(m.uri_of(sh.path), dtype=m.token_dtype, mode="r").sum())
    tb = TokenBatches(m, "train", seq_len, batch, order=order, seed=0, prefetch=prefetch)  # type: ignore[arg-type]
    tokens = steps * batch * seq_len
    t_first = time.perf_counter()
    with tb.iterate() as it:
        next(it)
        first_s = time.perf_counter() - t_first
        for _ in range(WARMUP_STEPS - 1):
            next(it)
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        loader_s = time.perf_counter() - t0
    raw_s = _raw_memmap(tb, steps)
    loader_tps, raw_tps = tokens / loader_s, tokens / raw_s
    return {
        "order": order,
        "seq_len": seq_len,
        "batch": batch,
        "steps": steps,
        "prefetch": prefetch,
        "first_batch_s": round(first_s, 4),
        "loader_tokens_per_s": round(loader_tps),
        "raw_memmap_tokens_per_s": round(raw_tps),
        "loader_over_raw": round(loader_tps / raw_tps, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--orders", default="sequential,shuffle,document_buffer")
    ap.add_argument("--manifest", default=None, help="an existing manifest.json (skips prepare)")
    ap.add_argument(
        "--step-config",
        default="configs/smoke.toml",
        help="model whose train step consumes the same seq_len x batch (the comparison)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.manifest
        prepare_s = None
        if uri is None:
            t0 = time.perf_counter()
            uri = prepare_bench_data(os.path.join(tmp, "stdlib"))
            prepare_s = round(time.perf_counter() - t0, 2)
        m = load_manifest(uri)
        results = [
            measure_loader(uri, args.seq_len, args.batch, args.steps, order, args.prefetch)
            for order in args.orders.split(",")
        ]
        step_tps = _step_tokens_per_s(args.step_config, args.seq_len, args.batch)
        for r in results:
            r["loader_over_step"] = round(r["loader_tokens_per_s"] / step_tps, 1)
        report = {
            "bench": "data_throughput",
            "train_tokens": m.splits.train.tokens,
            "train_documents": m.splits.train.documents,
        }
        if prepare_s is not None:  # with --manifest nothing was prepared: no figure at all
            report["prepare_s"] = prepare_s
        report |= {
            "step_config": args.step_config,
            "step_tokens_per_s": round(step_tps),
            "goal": "loader_over_step >= 10 for every order",
            "results": results,
        }
        print(json.dumps(report, indent=2))


def _step_tokens_per_s(config: str, seq_len: int, batch: int) -> float:
    """The runtime train step's own consumption for the same rows per step and seq_len."""
    from step_overhead import measure_step

    from jobspec.files.run_toml import load_run_config

    over = {"training": {"seq_len": seq_len, "global_batch_size": batch},
            "model": {"max_position_embeddings": max(seq_len, 512)}}  # fmt: skip
    cfg, _ = load_run_config(config, over)
    return measure_step(cfg, steps=10)


if __name__ == "__main__":
    main()
