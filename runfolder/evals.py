"""A run's latest and best eval, from its metrics/eval.jsonl rows.

Pure (no jax, no I/O), so `runtime inspect`, the final summary and `launch status` (which never
imports jax) say the same. The latest eval is the newest row; the best is the row of lowest loss
over every eval (the earliest of equal ones). A mixture eval's row also carries its sources'
losses (`loss_per_source`), kept in both.
"""

from __future__ import annotations

from typing import Any


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    out = {"step": row.get("step"), "name": row.get("name"), "loss": row["loss"]}
    if isinstance(row.get("loss_per_source"), dict):
        out["loss_per_source"] = row["loss_per_source"]
    return out


def eval_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """{"latest": {name, step, loss[, loss_per_source]} | None, "best": the same | None}; rows
    without a numeric loss are left out."""
    good = [
        r
        for r in rows
        if isinstance(r.get("loss"), int | float) and not isinstance(r["loss"], bool)
    ]
    if not good:
        return {"latest": None, "best": None}
    return {"latest": _brief(good[-1]), "best": _brief(min(good, key=lambda r: r["loss"]))}


def eval_text(e: dict[str, Any]) -> str:
    """`val 2.2670 at step 300`; a mixture eval adds its sources: `(web 2.3100, code 1.8700)`."""
    out = f"{e.get('name')} {e['loss']:.4f} at step {e.get('step')}"
    per = e.get("loss_per_source")
    if per:
        each = [f"{n} {'-' if v is None else format(v, '.4f')}" for n, v in per.items()]
        out += f" ({', '.join(each)})"
    return out
