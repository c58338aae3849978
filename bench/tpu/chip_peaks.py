"""The train step's memory as compiled for this process's devices, without running it: one JSON
row per case, to set beside `runtime plan`'s deviceless figures for the same cases.

    python3 bench/tpu/chip_peaks.py 'NAME|MODEL_TOML|SEQxBATCH|key=value;key=value' ...

Each case is lowered from abstract state (no parameter is materialised, so no init program is
compiled) and compiled for the attached chip; a case that does not fit is a row whose `error`
is the compiler's RESOURCE_EXHAUSTED and `fits` false.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

from runtime.host import platform  # noqa: E402

platform.choose()

import jax  # noqa: E402
from accel_step import compiled_memory, parse_sets, run_config  # noqa: E402

from runtime.plan.compile import compile_program  # noqa: E402


def case(spec: str) -> dict:
    name, model, shape, pairs = (spec.split("|") + [""])[:4]
    seq, _, batch = shape.partition("x")
    sets = parse_sets([p for p in pairs.split(";") if p.strip()])
    cfg = run_config(model, int(seq), int(batch), sets)
    row: dict = {
        "case": name,
        "model": model,
        "seq_len": int(seq),
        "batch": int(batch),
        "sets": sets,
    }
    _, _, compiled, seconds = compile_program(cfg, jax.devices())
    row["compile_s"] = round(seconds, 2)
    if isinstance(compiled, Exception):
        row.update(fits=False, error=str(compiled).splitlines()[0][:300])
    else:
        row.update(fits=True, compiled=compiled_memory(compiled))
    return row


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    for spec in sys.argv[1:]:
        print(json.dumps({"device_kind": jax.devices()[0].device_kind, **case(spec)}), flush=True)


if __name__ == "__main__":
    main()
