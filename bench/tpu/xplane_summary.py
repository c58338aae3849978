"""Device time per XLA op of a JAX profiler trace (*.xplane.pb): one JSON summary per trace.

    python3 bench/tpu/xplane_summary.py TRACE_FOLDER --out summary.json [--top 40]

Reads every *.xplane.pb under TRACE_FOLDER (jaxjob's traces and MaxText's `profiler=xplane`
alike), takes the device plane's lines and, on its "XLA Ops" line, each op's self time (an op's
time minus the ops nested inside it, so a `while` loop counts only its own overhead, not its
body). Steps are the executions of the busiest program on the "XLA Modules" line, and every
figure is per step. The JSON holds, per op: self and inclusive ms per step, executions per step,
and the stats of its first event (its HLO text, category, source, where the trace has them);
the module totals; and each device line's event count and time. Prints the top ops as a table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict
from typing import Any

STAT_CHARS = 1500  # an op's HLO text can be long; keep enough to read its shapes and kernel


def _events(line: Any) -> list[tuple[str, float, float, dict[str, Any]]]:
    out = []
    for e in line.events:
        stats = {k: (v[:STAT_CHARS] if isinstance(v, str) else v) for k, v in e.stats}
        out.append((e.name, float(e.start_ns), float(e.duration_ns), stats))
    return out


def self_times(events: list[tuple[str, float, float, dict]]) -> list[float]:
    """Each event's duration less the time of the events nested inside it (same line)."""
    order = sorted(range(len(events)), key=lambda i: (events[i][1], -events[i][2]))
    own = [e[2] for e in events]
    stack: list[int] = []  # indices of the open (enclosing) events
    for i in order:
        start, dur = events[i][1], events[i][2]
        while stack and events[stack[-1]][1] + events[stack[-1]][2] <= start:
            stack.pop()
        if stack:
            own[stack[-1]] -= dur
        stack.append(i)
    return own


def short(name: str) -> str:
    """'%fusion.12 = bf16[...] fusion(...)' -> 'fusion.12'; a plain name stays."""
    head = name.split(" = ", 1)[0] if " = " in name else name
    return head.lstrip("%").strip()


def summarise(folder: str) -> dict[str, Any]:
    from jax._src.lib import _profile_data

    lines: dict[str, list] = defaultdict(list)
    planes = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)):
        data = _profile_data.ProfileData.from_file(path)
        for plane in data.planes:
            planes.append(plane.name)
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                lines[line.name].extend(_events(line))
    modules: dict[str, list[float]] = defaultdict(list)
    for name, _, dur, _ in lines.get("XLA Modules", []):
        modules[name].append(dur)
    main = max(modules.items(), key=lambda kv: sum(kv[1]), default=(None, []))
    steps = max(1, len(main[1]))
    ops = lines.get("XLA Ops", [])
    own = self_times(ops)
    agg: dict[str, dict[str, Any]] = {}
    for (name, _, dur, stats), mine in zip(ops, own, strict=True):
        a = agg.setdefault(short(name), {"self_ns": 0.0, "incl_ns": 0.0, "n": 0, "stats": stats})
        a["self_ns"] += mine
        a["incl_ns"] += dur
        a["n"] += 1
        if "long_name" not in a["stats"] and len(name) > len(short(name)):
            a["stats"]["long_name"] = name[:STAT_CHARS]
    busy = sum(a["self_ns"] for a in agg.values()) or 1.0
    rows = sorted(agg.items(), key=lambda kv: -kv[1]["self_ns"])
    return {
        "folder": folder,
        "planes": sorted(set(planes)),
        "steps": steps,
        "main_module": main[0],
        "main_module_ms_per_step": round(sum(main[1]) / steps / 1e6, 3),
        "modules": {
            k: {"n": len(v), "ms_total": round(sum(v) / 1e6, 3)} for k, v in modules.items()
        },
        "device_lines": {
            k: {"events": len(v), "ms_total": round(sum(e[2] for e in v) / 1e6, 3)}
            for k, v in lines.items()
        },
        "ops_busy_ms_per_step": round(busy / steps / 1e6, 3),
        "ops": [
            {
                "op": name,
                "self_ms": round(a["self_ns"] / steps / 1e6, 4),
                "incl_ms": round(a["incl_ns"] / steps / 1e6, 4),
                "per_step": round(a["n"] / steps, 2),
                "share": round(a["self_ns"] / busy, 5),
                "stats": a["stats"],
            }
            for name, a in rows
        ],
    }


def table(summary: dict[str, Any], top: int) -> str:
    out = [
        f"steps {summary['steps']}  main module {summary['main_module']} "
        f"{summary['main_module_ms_per_step']} ms/step  ops busy "
        f"{summary['ops_busy_ms_per_step']} ms/step"
    ]
    for r in summary["ops"][:top]:
        cat = r["stats"].get("hlo_category", "")
        out.append(
            f"{r['self_ms']:9.3f} ms {r['share']:6.1%} x{r['per_step']:<5} {cat:14} {r['op']}"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    summary = summarise(args.folder)
    with open(args.out, "w") as f:
        json.dump(summary, f)
    print(table(summary, args.top), flush=True)


if __name__ == "__main__":
    main()
