"""What the [metrics] sinks add to writing a train row: host seconds per row with TensorBoard on
(and the time ledger's bookkeeping) versus the JSONL write alone, in the same process.

Rows are shaped like a real run's (loss, loss_sum, token_count, lr, grad_norm, param_norm,
step_time, tokens_per_s, elapsed, eta_s, mfu, batch_hash); each round writes `--rows` rows one
append at a time (log_every = 1, the worst case) to a fresh local run directory, alternating the
two variants so drift hits both. W&B is left out: it runs on its own thread and never blocks the
loop. Prints JSON.

    python bench/metric_sinks.py [--rows 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from jobspec.run_config import MetricsConfig
from runfolder.store import ArtifactStore
from runtime.observe.ledger import TimeLedger
from runtime.observe.sinks import MetricSinks


def _row(step: int) -> dict:
    return {
        "step": step, "tokens": 4096 * step, "loss": 3.0 + 1 / step, "loss_sum": 12000.0,
        "token_count": 4096.0, "lr": 3e-4, "grad_norm": 0.7, "param_norm": 120.0,
        "step_time": 0.25, "tokens_per_s": 16384.0, "elapsed": 0.25 * step, "eta_s": 100.0,
        "mfu": 0.41, "batch_hash": "0123456789abcdef",
    }  # fmt: skip


def _round(rows: int, tensorboard: bool) -> float:
    with tempfile.TemporaryDirectory() as d:
        store = ArtifactStore(d)
        ledger = TimeLedger()
        sinks = MetricSinks.open(
            MetricsConfig(tensorboard=tensorboard), store, run_id="b", start_step=0, config={}
        )
        t0 = time.perf_counter()
        for s in range(1, rows + 1):
            ledger.switch("data_wait")
            ledger.switch("productive")
            row = [_row(s)]
            store.append_jsonl("metrics/train.jsonl", row)
            sinks.train_rows(row)
            ledger.record_due()
        sinks.close()
        return (time.perf_counter() - t0) / rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    _round(100, True)  # warm imports and caches
    base, tb = [], []
    for _ in range(args.rounds):
        base.append(_round(args.rows, False))
        tb.append(_round(args.rows, True))
    b, t = statistics.median(base), statistics.median(tb)
    print(json.dumps({
        "rows": args.rows, "rounds": args.rounds,
        "jsonl_only_us_per_row": round(b * 1e6, 1),
        "jsonl_plus_tensorboard_us_per_row": round(t * 1e6, 1),
        "tensorboard_added_us_per_row": round((t - b) * 1e6, 1),
        "ratio": round(t / b, 3),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
