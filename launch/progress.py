"""Progress read from a run's artifacts (`<output_uri>/<run_id>`), local or gs://.

runtime.inspect imports jax (through runtime.artifacts), and `launch` must not, so this reads
the few files it needs through jobspec.storage's fsspec helper, which imports no jax.
"""

from __future__ import annotations

import json
from typing import Any

from jobspec.errors import JaxjobError

_TAIL_BYTES = 64 * 1024  # enough for the last few JSONL rows of any metrics file


def _last_row(fs: Any, path: str) -> dict[str, Any] | None:
    from jobspec.storage import read_parted_tail

    # A plain file, or on gs:// the parts `<name>.parts/000000.jsonl`, … the runtime appends.
    lines = read_parted_tail(fs, path, _TAIL_BYTES).decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the first line of a tail read may be cut
        if isinstance(row, dict):
            return row
    return None


def read_progress(run_uri: str) -> dict[str, Any]:
    """{"status", "step", "total_steps", "last_loss", "last_event"}; {"error": …} when unreadable."""
    from jobspec.storage import join, url_to_fs

    try:
        fs, root = url_to_fs(run_uri)
        manifest_path = join(root, "manifest.json")
        if not fs.exists(manifest_path):
            return {"status": None, "step": 0, "total_steps": None, "last_loss": None,
                    "last_event": None, "note": "no artifacts yet"}  # fmt: skip
        with fs.open(manifest_path, "rb") as f:
            manifest = json.loads(f.read())
        row = _last_row(fs, join(root, "metrics/train.jsonl"))
        event = _last_row(fs, join(root, "events.jsonl"))
    except (JaxjobError, OSError, ValueError) as e:
        return {"error": f"cannot read {run_uri}: {e}"}
    return {
        "status": manifest.get("status"),
        "step": row["step"] if row else manifest.get("steps", 0),
        "total_steps": manifest.get("total_steps"),
        "last_loss": row.get("loss") if row else None,
        "last_event": event,
    }
