"""Multi-host overhead: 1, 2 and 4 local host processes training the same global batch.

Each layout runs `runtime worker` as N processes (one CPU device each, mesh data=N) on the
smoke model for a fixed number of steps, and reports steady-state tokens/s and step time (the
runtime's own figures from metrics/train.jsonl, first step excluded) and the time from process
start to the first step (the `first_step` event). On a 2-core machine 4 processes share 2
cores, so this measures per-process overhead, not scaling. Prints JSON.

    python bench/scaling.py [--steps 30] [--processes 1,2,4]

tokens_per_s_vs_1 is each layout's tokens/s over the 1-process layout's, which runs whether or
not --processes names it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the multi-process harness the tests use

from multihost import run_hosts  # noqa: E402

from jobspec.files.run_toml import merge, read_toml  # noqa: E402


def layout(tmp: Path, procs: int, steps: int, base: dict) -> dict:
    t = base["training"]
    cfg = merge(base, {
        "run": {"id": f"scale-{procs}", "output_uri": str(tmp / "runs")},
        "mesh": {"data": procs},
        "training": {"target_tokens": steps * t["global_batch_size"] * t["seq_len"], "log_every": 5,
                     "eval_every": 0},
        "checkpoint": {"every": 0},
    })  # fmt: skip
    cfg.pop("evals", None)
    path = tmp / f"scale-{procs}.toml"
    path.write_text(tomli_w.dumps(cfg))
    t0 = time.time()
    results = run_hosts(
        ["worker", str(path)], procs, 1, env={"JAXJOB_RUN_ID": f"scale-{procs}"}, timeout=900
    )
    wall = time.time() - t0
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise SystemExit(
            f"{procs} processes: host {bad[0].process_id} failed\n{bad[0].output[-3000:]}"
        )
    run = tmp / "runs" / f"scale-{procs}"
    rows = [json.loads(x) for x in (run / "metrics/train.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    first = next(e for e in events if e["event"] == "first_step")
    timed = [r for r in rows if "tokens_per_s" in r]
    return {
        "processes": procs,
        "devices": procs,
        "tokens_per_step": cfg["training"]["global_batch_size"] * cfg["training"]["seq_len"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time"] for r in timed),
        "start_to_first_step_s": first["seconds_since_start"],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--processes", default="1,2,4", help="layouts to run; 1 is always run, as the baseline"
    )
    ap.add_argument("--config", default=str(ROOT / "configs/smoke.toml"))
    args = ap.parse_args()
    base = read_toml(args.config)
    os.chdir(ROOT)  # the smoke config's data path is relative to the checkout
    # The 1-process layout is the baseline of tokens_per_s_vs_1, so it always runs, first.
    procs = sorted({1, *(int(p) for p in args.processes.split(",") if p.strip())})
    with tempfile.TemporaryDirectory() as tmp:
        out = [layout(Path(tmp), p, args.steps, base) for p in procs]
    one = next(r for r in out if r["processes"] == 1)["tokens_per_s"]
    for r in out:
        r["tokens_per_s_vs_1"] = r["tokens_per_s"] / one
    print(
        json.dumps(
            {"benchmark": "scaling", "config": args.config, "steps": args.steps, "layouts": out},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
