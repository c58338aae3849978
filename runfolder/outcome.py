"""How a run ended, as its readers say it: manifest.json, unless the events recorded later.

Pure (no jax, no I/O), so `runtime inspect` and `launch status` (which never imports jax) say the
same. A run records a failure as a `failure` event and then the manifest's status `failed`
(`diverged`). On a full disk the manifest, which is replaced by a new file, may not fit where the
event, appended to a file with room left in its last block, did: the manifest then still says
`running`. A `failure` event that is the attempt's last word and newer than the manifest decides.
"""

from __future__ import annotations

from typing import Any

from runfolder.layout import EventKind

# The events that open or close an attempt; the newest of them says where the run stands.
_ATTEMPT_EVENTS = (
    EventKind.START,
    EventKind.RESUME,
    EventKind.FAILURE,
    EventKind.FINISH,
    EventKind.INTERRUPTED,
)


def effective_manifest(manifest: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """`manifest`, or, when it says running but the run's newest attempt event is a failure
    recorded after the manifest was last written, a copy that says failed (or diverged) with
    that failure's sentence. A new attempt writes its manifest before its start event, so a
    manifest newer than the failure is that attempt's, running."""
    if manifest.get("status") != "running":
        return manifest
    last = next((e for e in reversed(events) if e.get("event") in _ATTEMPT_EVENTS), None)
    if last is None or last.get("event") != EventKind.FAILURE:
        return manifest
    # Both times are now() of the writer host: ISO 8601 in UTC, so they sort as strings.
    if str(last.get("time", "")) <= str(manifest.get("updated", "")):
        return manifest
    out = {**manifest, "status": "failed", "failure": last.get("error")}
    if last.get("type") == "DivergedError":
        out.update(status="diverged", diverged_at_step=last.get("diverged_at_step"))
    return out


def closing_line(
    run_id: str,
    state: str,
    run_dir: str,
    *,
    step: int | None,
    total_steps: int | None = None,
    loss: float | None = None,
    best_eval: dict[str, Any] | None = None,
    detail: str = "",
) -> str:
    """The last line of `runtime local` and of `launch submit --wait`, one form for both:
    `run ID STATE: [DETAIL, ]step S of N, final loss L, best eval NAME L @ step S; RUN_DIR`."""
    parts = [detail] if detail else []
    if step is not None:
        parts.append(f"step {step:,}" + (f" of {total_steps:,}" if total_steps else ""))
    if loss is not None:
        parts.append(f"final loss {loss:.4g}")
    if best_eval:
        parts.append(
            f"best eval {best_eval['name']} {best_eval['loss']:.4g} @ step {best_eval['step']:,}"
        )
    return f"run {run_id} {state}: {', '.join(parts) or 'nothing recorded'}; {run_dir}"
