"""Rollout loader throughput: one-rollout-per-row batches (with advantages and old log-probs)
against a hand-written memmap baseline that builds the same padded arrays.

    python bench/rollout_loader.py [--rollouts 20000] [--seq-len 512] [--batch 64] [--steps 100]

Prints one JSON object. Synthesises rollout JSONL (random ids, prompt 16-128 and completion
16-(seq_len-128) tokens, seeded), prepares it, then runs, in this process, the Grain loader
(`TokenBatches.iterate`, fields advantages + old_logprobs) and the baseline on the same record
ids. Tokens are row slots (rows × seq_len), as the train loop counts them.
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

from runtime.data.loader import TokenBatches  # noqa: E402
from runtime.data.manifest import load_manifest, read_offsets  # noqa: E402
from runtime.data.prepare.build import prepare_dataset  # noqa: E402

WARMUP_STEPS = 5
FIELDS = ("advantages", "old_logprobs")


def write_rollouts(path: str, n: int, seq_len: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            lp = int(rng.integers(16, 129))
            lc = int(rng.integers(16, seq_len - 128 + 1))
            row = {
                "prompt_ids": rng.integers(0, 256, lp).tolist(),
                "completion_ids": rng.integers(0, 256, lc).tolist(),
                "advantage": float(rng.normal()),
                "old_logprobs": (-rng.random(lc) * 4).tolist(),
            }
            f.write(json.dumps(row) + "\n")


def _baseline(tb: TokenBatches, steps: int) -> float:
    """Seconds to build the same padded arrays straight from np.memmap (one shard per stream)."""
    m = tb.manifest
    train = m.split("train")
    assert len(train.shards) == 1, "the baseline reads single-shard streams"
    tok = np.memmap(m.uri_of(train.shards[0].path), dtype=m.token_dtype, mode="r")
    fields = {
        f: np.memmap(m.uri_of(train.fields[f].shards[0].path), dtype=train.fields[f].dtype, mode="r")
        for f in ("loss_mask", *FIELDS)
    }  # fmt: skip
    off = read_offsets(m, "train")
    T = tb.seq_len
    ids = [tb.local_record_ids(s).ravel() for s in range(WARMUP_STEPS + steps)]

    def step(rids: np.ndarray) -> None:
        shape = (len(rids), T)
        out = {
            k: np.zeros(shape, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")
        }
        out.update({f: np.zeros(shape, np.float32) for f in fields})
        for r, d in enumerate(rids):
            lo, hi = int(off[d]), int(off[d + 1])
            n = hi - lo - 1
            out["inputs"][r, :n] = tok[lo : hi - 1]
            out["targets"][r, :n] = tok[lo + 1 : hi]
            out["segment_ids"][r, :n] = 1
            out["positions"][r, :n] = np.arange(n)
            for f, v in fields.items():
                out[f][r, :n] = v[lo + 1 : hi]

    for s in range(WARMUP_STEPS):
        step(ids[s])
    t0 = time.perf_counter()
    for s in range(WARMUP_STEPS, WARMUP_STEPS + steps):
        step(ids[s])
    return time.perf_counter() - t0


def measure(
    manifest_uri: str, seq_len: int, batch: int, steps: int, prefetch: int
) -> dict[str, Any]:
    m = load_manifest(manifest_uri)
    tb = TokenBatches(m, "train", seq_len, batch, order="shuffle", seed=0, prefetch=prefetch,
                      fields=FIELDS)  # fmt: skip
    with tb.iterate() as it:
        for _ in range(WARMUP_STEPS):
            next(it)
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        loader_s = time.perf_counter() - t0
    base_s = _baseline(tb, steps)
    sample = [tb.read_step(s) for s in range(WARMUP_STEPS)]
    tokens = steps * batch * seq_len
    return {
        "seq_len": seq_len,
        "batch": batch,
        "steps": steps,
        "prefetch": prefetch,
        "rollouts": m.split("train").documents,
        # Of the row slots: how many hold rollout tokens, and how many are trained (completions).
        "filled_share": round(
            float(np.mean([b["segment_ids"].astype(bool).mean() for b in sample])), 3
        ),
        "counted_share": round(float(np.mean([b["loss_mask"].mean() for b in sample])), 3),
        "loader_tokens_per_s": round(tokens / loader_s),
        "baseline_tokens_per_s": round(tokens / base_s),
        "loader_over_baseline": round(base_s / loader_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=20000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prefetch", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "rollouts.jsonl")
        write_rollouts(src, args.rollouts, args.seq_len)
        t0 = time.perf_counter()
        prepare_dataset([src], "byte", os.path.join(tmp, "d"), val_fraction=0.01, format="rollouts")
        prepare_s = time.perf_counter() - t0
        result = measure(os.path.join(tmp, "d", "manifest.json"), args.seq_len, args.batch,
                         args.steps, args.prefetch)  # fmt: skip
    result["prepare_s"] = round(prepare_s, 2)
    result["prepare_rollouts_per_s"] = round(args.rollouts / prepare_s)
    print(json.dumps({"bench": "rollout_loader", **result}, indent=2))


if __name__ == "__main__":
    main()
