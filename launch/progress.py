"""Progress read from a run's artifacts (`<output_uri>/<run_id>`), local or gs://.

runtime.inspect imports jax (through runtime.artifacts), and `launch` must not, so this reads
the few files it needs through jobspec.storage's fsspec helper, which imports no jax.
"""

from __future__ import annotations

import json
from typing import Any

from jobspec.errors import JaxjobError
from jobspec.run_dir import EVAL_METRICS, EVENTS, MANIFEST, TRAIN_METRICS

_TAIL_BYTES = 64 * 1024  # enough for the last few JSONL rows of any metrics file


def _rows(data: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in data.decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the first line of a tail read may be cut, the last one torn
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _tail_rows(fs: Any, path: str) -> list[dict[str, Any]]:
    from jobspec.storage import read_parted_tail

    # A plain file, or on gs:// the parts `<name>.parts/000000.jsonl`, … the runtime appends.
    return _rows(read_parted_tail(fs, path, _TAIL_BYTES))


def _all_rows(fs: Any, path: str) -> list[dict[str, Any]]:
    from jobspec.storage import parted_exists, read_parted

    return _rows(read_parted(fs, path)) if parted_exists(fs, path) else []


def eta_seconds(rows: list[dict[str, Any]], total_steps: int | None) -> float | None:
    """Steps left x the median step time of the newest timed rows; None when unknown."""
    times = sorted(
        r["step_time"] for r in rows[-50:] if isinstance(r.get("step_time"), int | float)
    )
    if not rows or not times or not total_steps:
        return None
    return max(0, total_steps - rows[-1].get("step", 0)) * times[len(times) // 2]


def prepare_note(m: dict[str, Any]) -> str:
    """A prepare job's state in one line, from the manifest.json its host 0 keeps."""
    status, hosts = m.get("status"), m.get("hosts")
    if status == "completed":
        return (
            f"prepared {m.get('dataset_manifest')} (fingerprint {m.get('fingerprint')}, "
            f"{m.get('total_tokens')} tokens in {m.get('total_documents')} documents; "
            f"{m.get('parts')} parts: {m.get('written')} written by this attempt, "
            f"{m.get('skipped')} already committed)"
        )
    if status == "running":
        return f"preparing {m.get('out')} on {hosts} host(s), attempt {m.get('attempt')}"
    return f"prepare {status}: {m.get('error') or 'see launch logs'}"


def read_progress(run_uri: str) -> dict[str, Any]:
    """{"status", "step", "total_steps", "last_loss", "last_event", "goodput", "eta_s",
    "latest_eval", "best_eval", "diverged_at_step", "failure"} ({name, step, loss} of
    metrics/eval.jsonl's newest and lowest rows, with a mixture's loss_per_source;
    jobspec.evals); {"error": …} when unreadable. The ETA is given while the run says it is
    running."""
    from jobspec.evals import eval_summary
    from jobspec.goodput import account
    from jobspec.run_status import effective_manifest
    from jobspec.storage import join, url_to_fs

    try:
        fs, root = url_to_fs(run_uri)
        manifest_path = join(root, MANIFEST)
        if not fs.exists(manifest_path):
            return {"status": None, "step": 0, "total_steps": None, "last_loss": None,
                    "last_event": None, "goodput": None, "eta_s": None, "latest_eval": None,
                    "best_eval": None, "note": "no artifacts yet"}  # fmt: skip
        with fs.open(manifest_path, "rb") as f:
            manifest = json.loads(f.read())
        if manifest.get("kind") == "prepare":  # a prepare job has no steps: say where it stands
            return {"status": manifest.get("status"), "step": 0, "total_steps": None,
                    "last_loss": None, "last_event": None, "goodput": None, "eta_s": None,
                    "latest_eval": None, "best_eval": None,
                    "note": prepare_note(manifest)}  # fmt: skip
        rows = _tail_rows(fs, join(root, TRAIN_METRICS))
        events = _all_rows(fs, join(root, EVENTS))
        evals = eval_summary(_all_rows(fs, join(root, EVAL_METRICS)))
    except (JaxjobError, OSError, ValueError) as e:
        return {"error": f"cannot read {run_uri}: {e}"}
    # A failure recorded after a `running` manifest that a full disk kept from being replaced.
    manifest = effective_manifest(manifest, events)
    row = rows[-1] if rows else None
    running = manifest.get("status") == "running"
    return {
        "status": manifest.get("status"),
        "step": row["step"] if row else manifest.get("steps", 0),
        "total_steps": manifest.get("total_steps"),
        "last_loss": row.get("loss") if row else None,
        "last_event": next((e for e in reversed(events) if e.get("event") != "ledger"), None),
        "goodput": account(events),
        "eta_s": eta_seconds(rows, manifest.get("total_steps")) if running else None,
        "latest_eval": evals["latest"],
        "best_eval": evals["best"],
        # A diverged run (training.on_nonfinite) says where; a failed one, why.
        "diverged_at_step": manifest.get("diverged_at_step"),
        "failure": manifest.get("failure"),
    }
