"""`runtime inspect`: what a run directory (local or gs://) says about itself. Reads only."""

from __future__ import annotations

from typing import Any

from jobspec.errors import StorageError
from jobspec.evals import eval_summary, eval_text
from jobspec.goodput import account, goodput_line
from jobspec.run_dir import EVAL_METRICS, EVENTS, MANIFEST, SUMMARY, TRAIN_METRICS, EventKind
from jobspec.run_status import effective_manifest
from jobspec.run_store import ArtifactStore
from jobspec.storage import configure_gcs_env


def open_run(run: str) -> ArtifactStore:
    configure_gcs_env()
    store = ArtifactStore(run.rstrip("/"), process_index=0)
    if not store.exists(MANIFEST):
        raise StorageError(f"{run} is not a jaxjob run directory (no {MANIFEST} there)")
    return store


def inspect_run(run: str) -> dict[str, Any]:
    store = open_run(run)
    rows = store.read_jsonl(TRAIN_METRICS) if store.exists(TRAIN_METRICS) else []
    evals = store.read_jsonl(EVAL_METRICS) if store.exists(EVAL_METRICS) else []
    events = store.read_jsonl(EVENTS) if store.exists(EVENTS) else []
    # A failure recorded after a `running` manifest that a full disk kept from being replaced.
    manifest = effective_manifest(store.read_json(MANIFEST), events)
    # A damaged index reads as the committed folders say, with one warning line.
    from runtime.run.checkpoint import load_index

    index = load_index(store)
    summary = store.read_json(SUMMARY) if store.exists(SUMMARY) else None
    timed = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    last = rows[-1] if rows else None
    latest_best = eval_summary(evals)  # as `launch status` says them
    return {
        "run": store.uri(""),
        "run_id": manifest.get("run_id"),
        "status": manifest.get("status"),
        # A failed or diverged attempt's sentence, and the step a diverged run stopped at.
        "failure": manifest.get("failure"),
        "diverged_at_step": manifest.get("diverged_at_step"),
        "steps": last["step"] if last else 0,
        "total_steps": manifest.get("total_steps"),
        "tokens": last["tokens"] if last else 0,
        "first_loss": rows[0]["loss"] if rows else None,
        "last_loss": last["loss"] if last else None,
        "latest_eval": latest_best["latest"],
        "best_eval": latest_best["best"],
        "tokens_per_s_median": timed[len(timed) // 2] if timed else None,
        "mfu_last": next((r["mfu"] for r in reversed(rows) if "mfu" in r), None),
        "checkpoints": [c["step"] for c in index.get("checkpoints", [])],
        "latest_checkpoint": index.get("latest"),
        "best_checkpoint": index.get("best"),
        # Steps a resume failed to read (runtime checkpoints verify RUN reads them all).
        "unreadable_checkpoints": [
            c["step"] for c in index.get("checkpoints", []) if c.get("unreadable")
        ],
        # The newest thing that happened (time-ledger snapshots are bookkeeping, not events).
        "last_event": next(
            (e for e in reversed(events) if e.get("event") != EventKind.LEDGER), None
        ),
        # Over every attempt, from the ledger snapshots the writers recorded.
        "goodput": account(events),
        "summary": summary,
    }


def render(r: dict[str, Any]) -> str:
    def fmt(x: Any, spec: str = "") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        f"run          {r['run_id']}  ({r['run']})",
        f"status       {r['status']}"
        + (f" at step {r['diverged_at_step']}" if r.get("diverged_at_step") is not None else ""),
        f"steps        {r['steps']} / {fmt(r['total_steps'])}   tokens {r['tokens']:,}",
        f"loss         first {fmt(r['first_loss'], '.4f')}  last {fmt(r['last_loss'], '.4f')}",
    ]
    if r.get("failure") and r["status"] in ("failed", "diverged"):
        lines.append(f"failure      {r['failure']}")
    if r["latest_eval"]:
        lines.append(f"latest eval  {eval_text(r['latest_eval'])}")
    if r["best_eval"]:
        lines.append(f"best eval    {eval_text(r['best_eval'])}")
    lines.append(
        f"throughput   {fmt(r['tokens_per_s_median'], ',.0f')} tokens/s (median)"
        + (f", MFU {100 * r['mfu_last']:.1f}%" if r["mfu_last"] is not None else "")
    )
    lines.append(
        f"checkpoints  {r['checkpoints'] or 'none'}  latest {fmt(r['latest_checkpoint'])}  "
        f"best {fmt(r['best_checkpoint'])}"
        + (f"  unreadable {r['unreadable_checkpoints']}" if r["unreadable_checkpoints"] else "")
    )
    if r["goodput"]:
        lines.append(f"goodput      {goodput_line(r['goodput'])}")
    if r["last_event"]:
        e = r["last_event"]
        lines.append(f"last event   {e.get('event')} at {e.get('time')}")
    return "\n".join(lines)
