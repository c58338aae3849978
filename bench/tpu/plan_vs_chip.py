"""`runtime plan`'s deviceless figures beside the chip's: memory and verdict per compiled case,
predicted against measured step time per timed case.

    python bench/tpu/plan_vs_chip.py [bench/tpu/results/2026-12-06.jsonl] [--target tpu-v5e-1]
    python bench/tpu/plan_vs_chip.py --predict --model M --shapes 2048x8,4096x4 [--set K=V ...]
    python bench/tpu/plan_vs_chip.py --join PREDICTED.jsonl MEASURED.jsonl

Without --predict or --join it reads the rows a chip session wrote (`chip_compile` rows from
bench/tpu/chip_peaks.py, with the case's model/shape/settings; `jaxjob_step` rows from
bench/accel_step.py), compiles each case here for the target's compile-only devices
(runtime/plan/compile.py `plan`, what `runtime plan` reports) and prints one JSON row per case:
chip and plan peaks and their difference, both verdicts, and for timed shapes the predicted and
measured seconds per step.

--predict compiles the run config bench/accel_step.py builds for each shape (the same model,
shape and settings) deviceless for the target, and prints one `plan_step` row per shape: the
predicted step, what bounds it, the kernels' part. It takes no chip, so it may run beside
accel_step on the chip's machine (bench/tpu/plan_vs_chip.sh).

--join pairs `plan_step` rows with accel_step rows of the same model, shape and settings and
prints {shape, model, predicted_s, measured_s, ratio} per pair (ratio = predicted / measured).
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
ap.add_argument("--predict", action="store_true", help="plan_step rows for --model/--shapes")
ap.add_argument("--model", default="configs/models/qwen3-0.6b.toml")
ap.add_argument("--shapes", default="2048x8", help="seq_len x global batch, comma-separated")
ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
ap.add_argument("--join", nargs=2, metavar=("PREDICTED", "MEASURED"))
args = ap.parse_args()

GIB = 2**30


def _key(model: str, seq_len: int, batch: int, sets: dict | None) -> str:
    return json.dumps([os.path.basename(model), seq_len, batch, sets or {}], sort_keys=True)


def join(predicted_path: str, measured_path: str) -> None:
    """One row per measured step that has a prediction of the same config."""
    predicted = {}
    for line in open(predicted_path):
        r = json.loads(line)
        if r.get("kind") == "plan_step":
            predicted[_key(r["model"], r["seq_len"], r["batch"], r["sets"])] = r
    for line in open(measured_path):
        m = json.loads(line)
        if not m.get("step_s"):
            continue  # a shape that did not fit or run
        p = predicted.get(_key(m["model"], m["seq_len"], m["batch"], m.get("sets")))
        if p is None or not p.get("predicted_s"):
            continue
        row = {
            "shape": f"{m['seq_len']}x{m['batch']}", "model": os.path.basename(m["model"]),
            "sets": m.get("sets") or {}, "predicted_s": p["predicted_s"],
            "measured_s": m["step_s"], "ratio": round(p["predicted_s"] / m["step_s"], 4),
            "bound": p.get("bound"), "kernels_s": p.get("kernels_s"),
        }  # fmt: skip
        print(json.dumps(row), flush=True)


def predict(target_name: str) -> None:
    """A plan_step row per shape of --shapes: accel_step's run config, planned deviceless."""
    from runtime.plan.environment import prepare_environment

    prepare_environment(target_name)
    from accel_step import parse_sets, run_config

    from runtime.plan.compile import plan
    from runtime.plan.targets import resolve_target

    target = resolve_target(target_name)
    sets = parse_sets(args.sets)
    for shape in args.shapes.split(","):
        seq_len, batch = (int(x) for x in shape.lower().split("x"))
        rep = plan(run_config(args.model, seq_len, batch, sets), target)
        st = rep.get("step_time") or {}
        row = {
            "kind": "plan_step", "model": args.model, "seq_len": seq_len, "batch": batch,
            "sets": sets, "target": target_name, "compiled": rep["compiled"],
            "compile_s": rep.get("compile_seconds"), "predicted_s": st.get("step_seconds"),
            "bound": st.get("bound"), "seconds": st.get("seconds"),
            "kernels_s": {k: v["seconds"] for k, v in (st.get("kernels") or {}).items()},
        }  # fmt: skip
        print(json.dumps(row), flush=True)


def compare(results: str, target_name: str) -> None:
    """Memory and step time per chip_compile case of a chip session's rows."""
    from runtime.plan.environment import prepare_environment

    prepare_environment(target_name)
    from accel_step import run_config

    from runtime.plan.compile import plan
    from runtime.plan.targets import resolve_target

    rows = [json.loads(line) for line in open(results)]
    # The default-settings step times of the session, by shape (variants that set nothing).
    measured = {
        (r["seq_len"], r["batch"]): r["step_s"]
        for r in rows
        if r["kind"] == "jaxjob_step"
        and r.get("step_s")
        and r.get("variant") in (None, "sb1024")
        and not r.get("sets")
    }
    target = resolve_target(target_name)
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


def main() -> None:
    if args.join:
        join(*args.join)
    elif args.predict:
        predict(args.target)
    else:
        compare(args.results, args.target)


if __name__ == "__main__":
    main()
