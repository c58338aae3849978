"""`runtime plan`'s deviceless figures beside the chip's: memory and verdict per compiled case,
predicted against measured step time per timed case.

    python bench/tpu/plan_vs_chip.py [bench/tpu/results/2026-12-06.jsonl] [--target tpu-v5e-1]

Reads the rows a chip session wrote (`chip_compile` rows from bench/tpu/chip_peaks.py, with
the case's model/shape/settings; `jaxjob_step` rows from bench/accel_step.py), compiles each
case here for the target's compile-only devices (runtime/plan/compile.py `plan`, what
`runtime plan` reports) and prints one JSON row per case: chip and plan peaks and their
difference, both verdicts, and for timed shapes the predicted and measured seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("results", nargs="?", default=os.path.join(HERE, "results", "2026-12-06.jsonl"))
ap.add_argument("--target", default="tpu-v5e-1")
args = ap.parse_args()

from runtime.plan.environment import prepare_environment  # noqa: E402

prepare_environment(args.target)

from accel_step import run_config  # noqa: E402

from runtime.plan.compile import plan  # noqa: E402
from runtime.plan.targets import resolve_target  # noqa: E402

GIB = 2**30


def main() -> None:
    rows = [json.loads(line) for line in open(args.results)]
    # The default-settings step times of the session, by shape (variants that set nothing).
    measured = {
        (r["seq_len"], r["batch"]): r["step_s"]
        for r in rows
        if r["kind"] == "jaxjob_step"
        and r.get("step_s")
        and r.get("variant") in (None, "sb1024")
        and not r.get("sets")
    }
    target = resolve_target(args.target)
    for r in rows:
        if r["kind"] != "chip_compile":
            continue
        cfg = run_config(r["model"], r["seq_len"], r["batch"], r.get("sets") or {})
        rep = plan(cfg, target)
        mem = rep["memory"]
        plan_peak = (mem.get("peak_bytes") or 0) / GIB or None
        chip_peak = (r.get("compiled") or {}).get("peak_gib")
        out = {
            "case": r["case"], "model": os.path.basename(r["model"]), "seq_len": r["seq_len"],
            "batch": r["batch"], "sets": r.get("sets"),
            "chip_fits": r["fits"], "plan_fits": mem.get("fits"),
            "chip_peak_gib": chip_peak,
            "plan_peak_gib": round(plan_peak, 3) if plan_peak else None,
        }  # fmt: skip
        if chip_peak and plan_peak:
            out["peak_diff"] = round(plan_peak / chip_peak - 1, 4)
        step = (rep.get("step_time") or {}).get("step_seconds")
        if step and (r["seq_len"], r["batch"]) in measured and not r.get("sets"):
            m = measured[(r["seq_len"], r["batch"])]
            out.update(predicted_step_s=round(step, 4), measured_step_s=m,
                       step_diff=round(step / m - 1, 4))  # fmt: skip
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
