"""Progress read from a run's artifacts (`<output_uri>/<run_id>`), local or gs://.

runtime.inspect imports jax (through runtime.artifacts), and `launch` must not, so this reads
the few files it needs through jobspec.storage's fsspec helper, which imports no jax.
"""

from __future__ import annotations

import datetime as dt
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


def when(stamp: Any) -> dt.datetime | None:
    """An ISO 8601 time of a record (`updated`, a record's `submitted`, a k8s creationTimestamp)
    as an aware datetime; None when it is not one."""
    try:
        t = dt.datetime.fromisoformat(str(stamp))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def earlier_submission(manifest: dict[str, Any], since: str | None) -> bool:
    """Whether `manifest` was last written before `since` (when a submission was made), so it
    is an earlier submission's record, not this one's: a resubmitted run keeps its folder, and
    this submission's hosts rewrite the manifest when they start. Times of other machines (a
    cluster's nodes) are compared as they are: their clocks are taken to agree within a host's
    boot time."""
    written, made = when(manifest.get("updated")), when(since) if since else None
    return written is not None and made is not None and written < made


class ManifestError(JaxjobError):
    """A manifest.json that cannot be read or is not a JSON object."""


def read_manifest(fs: Any, path: str, shown: str) -> dict[str, Any] | None:
    """The manifest at `path` (`shown`: its name for the user); None when there is none."""
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ManifestError(f"cannot read {shown}: {e.strerror or e}") from None
    try:
        manifest = json.loads(data)
    except ValueError as e:  # the hosts replace it whole: torn only by hand or a broken disk
        raise ManifestError(f"cannot read {shown}: it is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(
            f"cannot read {shown}: it holds a JSON {type(manifest).__name__}, not an object"
        )
    return manifest


def _nothing(note: str) -> dict[str, Any]:
    return {"status": None, "step": 0, "total_steps": None, "last_loss": None,
            "last_event": None, "goodput": None, "eta_s": None, "latest_eval": None,
            "best_eval": None, "note": note}  # fmt: skip


def _earlier_note(manifest: dict[str, Any]) -> str:
    total = manifest.get("total_steps")
    return (
        f"no progress from this submission yet ({MANIFEST} is an earlier submission's, written "
        f"{str(manifest.get('updated'))[:19].replace('T', ' ')} UTC: {manifest.get('status')} "
        f"at step {manifest.get('steps', 0)} / {total if total is not None else '?'})"
    )


def read_progress(run_uri: str, since: str | None = None) -> dict[str, Any]:
    """{"status", "step", "total_steps", "last_loss", "last_event", "goodput", "eta_s",
    "latest_eval", "best_eval", "diverged_at_step", "failure"} ({name, step, loss} of
    metrics/eval.jsonl's newest and lowest rows, with a mixture's loss_per_source;
    jobspec.evals); {"error": …} naming the file when unreadable. The ETA is given while the run
    says it is running. `since`: when the submission being followed was made; a manifest older
    than that is an earlier submission's and gives no progress (only a note)."""
    from jobspec.evals import eval_summary
    from jobspec.goodput import account
    from jobspec.run_status import effective_manifest
    from jobspec.storage import join, url_to_fs

    shown = join(run_uri, MANIFEST)
    try:
        fs, root = url_to_fs(run_uri)
        manifest = read_manifest(fs, join(root, MANIFEST), shown)
        if manifest is None:
            return _nothing("no artifacts yet")
        if earlier_submission(manifest, since):
            return _nothing(_earlier_note(manifest))
        if manifest.get("kind") == "prepare":  # a prepare job has no steps: say where it stands
            return {**_nothing(prepare_note(manifest)), "status": manifest.get("status")}
        rows = _tail_rows(fs, join(root, TRAIN_METRICS))
        events = _all_rows(fs, join(root, EVENTS))
        evals = eval_summary(_all_rows(fs, join(root, EVAL_METRICS)))
    except ManifestError as e:
        return {"error": str(e)}
    except (JaxjobError, OSError, ValueError) as e:
        return {"error": f"cannot read the records under {run_uri}: {e}"}
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
