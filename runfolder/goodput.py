"""Goodput: how much of a run's wall time trained, from the `ledger` events its attempts wrote.

Pure (no jax, no I/O), so `runtime inspect`, the final summary and `launch status` (which never
imports jax) give the same figures. Each attempt's writer records snapshots of a time ledger
(runtime/observe/ledger.py): seconds per bucket since its process started, summing to the
attempt's wall time. An attempt's last snapshot counts; the time from one attempt's last snapshot
to the next attempt's process start is lost between attempts (a crashed attempt's unrecorded end,
the scheduler's restart, a person resubmitting).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from runfolder.layout import EventKind

# Buckets in the order they are reported, with what they mean.
BUCKETS = {
    "productive": "training steps that moved the run forward",
    "compile": "each attempt's first step (tracing, compilation, the step itself)",
    "startup": "process start to the first step, less the parts below: interpreter, imports, "
    "JAX and cluster start, the run's records",
    "data_open": "opening the data (preparing it first where it was missing)",
    "model_init": "building the model's parameters and optimizer state on the mesh",
    "restore": "reading the checkpoint a resumed attempt starts from",
    "data_wait": "waiting on the input pipeline between steps",
    "eval": "evaluations, their compilation included",
    "checkpoint": "saving checkpoints (the blocking part) and waiting for the last save",
    "profile": "starting, stopping and writing profiler traces",
    "recomputed": "steps an earlier attempt had already reached before it ended",
    "finish": "final summary and shutdown work after the last step",
    "lost": "between attempts: a crashed attempt's unrecorded end and the time until a restart",
}


def _attempts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last snapshot of each attempt (keyed by its process start and pid), oldest first."""
    last: dict[tuple[float, Any], dict[str, Any]] = {}
    for e in events:
        if e.get("event") == EventKind.LEDGER and isinstance(e.get("seconds"), dict):
            last[(float(e["process_start"]), e.get("pid"))] = e
    return sorted(last.values(), key=lambda e: float(e["process_start"]))


def account(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Wall time over every attempt, split into BUCKETS, and goodput = productive / wall.

    None when no attempt has recorded a ledger yet. Wall time runs from the first attempt's
    process start to the newest snapshot, so the buckets always sum to it exactly.
    """
    attempts = _attempts(events)
    if not attempts:
        return None
    totals = dict.fromkeys(BUCKETS, 0.0)
    rows = []
    prev_end: float | None = None
    for a in attempts:
        start, end = float(a["process_start"]), float(a["recorded_at"])
        if prev_end is not None:
            # Overlap (a second owner, clock skew between machines) is not time lost.
            totals["lost"] += max(0.0, start - prev_end)
        for k, v in a["seconds"].items():
            totals[k] = totals.get(k, 0.0) + float(v)
        rows.append({
            "started": _iso(start),
            "wall_s": end - start,
            "first_step": a.get("first_step"),
            "last_step": a.get("last_step"),
            "seconds": {k: float(v) for k, v in a["seconds"].items()},
        })  # fmt: skip
        prev_end = end if prev_end is None else max(prev_end, end)
    first = float(attempts[0]["process_start"])
    wall = sum(totals.values())
    return {
        "wall_s": wall,
        "productive_s": totals["productive"],
        "goodput": totals["productive"] / wall if wall > 0 else None,
        "seconds": totals,
        "attempts": rows,
        "span": {"from": _iso(first), "to": _iso(prev_end or first)},
    }


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


def duration(s: float) -> str:
    """`42.0s`, `3m07s`, `1h02m`, `3d04h` from two days, `12 years` from 1,000 days (an ETA
    that long says the run is mis-sized, not when it ends); `unknown` for NaN or infinity."""
    if s != s or s in (float("inf"), float("-inf")):
        return "unknown"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(round(s), 60)
    h, m = divmod(m, 60)
    if h >= 48:
        d, h = divmod(h, 24)
        return f"{d}d{h:02d}h" if d < 1000 else f"{s / 31_557_600:,.0f} years"
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def goodput_line(g: dict[str, Any]) -> str:
    """`62.1% of 1h02m trained (3 attempts); compile 2m10s, checkpoint 1m05s, lost 4m00s, ...`."""
    share = "-" if g["goodput"] is None else f"{100 * g['goodput']:.1f}%"
    n = len(g["attempts"])
    head = f"{share} of {duration(g['wall_s'])} trained ({n} attempt{'s' if n != 1 else ''})"
    rest = sorted(
        ((k, v) for k, v in g["seconds"].items() if k != "productive" and v >= 0.05),
        key=lambda kv: -kv[1],
    )
    return head + ("; " + ", ".join(f"{k} {duration(v)}" for k, v in rest) if rest else "")
