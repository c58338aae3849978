"""`runtime inspect`: what a run directory (local or gs://) says about itself, as
runfolder.view reads it for `launch status` too, with its checkpoints. Reads only."""

from __future__ import annotations

from typing import Any

from runfolder.view import open_run, read_run, record_lines


def inspect_run(run: str) -> dict[str, Any]:
    store = open_run(run)
    view = read_run(store)
    # A damaged index reads as the committed folders say, with one warning line.
    from runtime.run.checkpoint.index import load_index

    index = load_index(store)
    return {
        "run": view.uri,
        "run_id": view.run_id,
        "status": view.status,
        # A failed or diverged attempt's sentence, and the step a diverged run stopped at.
        "failure": view.failure,
        "diverged_at_step": view.diverged_at_step,
        "steps": view.step,
        "total_steps": view.total_steps,
        "tokens": view.tokens,
        "first_loss": view.first_loss,
        "last_loss": view.last_loss,
        "latest_eval": view.latest_eval,  # as `launch status` says them
        "best_eval": view.best_eval,
        "tokens_per_s_median": view.tokens_per_s_median,
        "mfu_last": view.mfu_last,
        "checkpoints": [c["step"] for c in index.get("checkpoints", [])],
        "latest_checkpoint": index.get("latest"),
        "best_checkpoint": index.get("best"),
        # Steps a resume failed to read (runtime checkpoints verify RUN reads them all).
        "unreadable_checkpoints": [
            c["step"] for c in index.get("checkpoints", []) if c.get("unreadable")
        ],
        "last_event": view.last_event,
        "goodput": view.goodput,  # over every attempt
        "summary": view.summary,
    }


WIDTH = 13  # of the labels, `checkpoints` and a space


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
    lines += record_lines(r, ("failure", "latest_eval", "best_eval"), WIDTH)
    lines.append(
        f"throughput   {fmt(r['tokens_per_s_median'], ',.0f')} tokens/s (median)"
        + (f", MFU {100 * r['mfu_last']:.1f}%" if r["mfu_last"] is not None else "")
    )
    lines.append(
        f"checkpoints  {r['checkpoints'] or 'none'}  latest {fmt(r['latest_checkpoint'])}  "
        f"best {fmt(r['best_checkpoint'])}"
        + (f"  unreadable {r['unreadable_checkpoints']}" if r["unreadable_checkpoints"] else "")
    )
    lines += record_lines(r, ("goodput", "last_event"), WIDTH)
    return "\n".join(lines)
