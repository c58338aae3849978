"""`runtime checkpoints list|verify|rollback RUN`: what a run's checkpoints are, whether each
can be read back, and how to branch a run off an older one before it is launched again."""

from __future__ import annotations

import sys
from typing import Any

from jobspec.errors import CheckpointError
from runfolder.layout import CHECKPOINTS as CKPT_DIR
from runfolder.layout import MANIFEST
from runfolder.store import ArtifactStore
from runfolder.view import open_run
from runtime.run.checkpoint.service import CheckpointService

MIB = 1024 * 1024


def _service(
    run: str, *, read_only: bool = True, store: ArtifactStore | None = None, warn_gone: bool = True
):
    store = store or open_run(run)
    if not store.isdir(CKPT_DIR):
        raise CheckpointError(f"{store.uri(CKPT_DIR)} does not exist: the run has no checkpoints")
    # No retention of ours: a writable service applies `keep` when it closes, and rollback
    # must delete only what it says it deletes.
    return CheckpointService(
        store, keep=sys.maxsize, async_save=False, read_only=read_only, warn_gone=warn_gone
    )


def list_checkpoints(run: str) -> dict[str, Any]:
    """The index as disk has it: each committed step, its time and metrics, any unreadable mark
    a failed restore left, plus latest and best."""
    ckpt = _service(run)
    try:
        index = ckpt.read_index()
    finally:
        ckpt.close()
    return {"run": ckpt.store.uri(""), **index}


def verify_checkpoints(run: str) -> dict[str, Any]:
    """Check every indexed step against its checksums and read it in full, and name the listed
    steps that are gone; {"run", "ok", "steps": [{step, ok, state, verified, bytes, cause}]}."""
    ckpt = _service(run, warn_gone=False)  # said as `step N: missing` lines instead
    try:
        steps = [ckpt.verify(s) for s in sorted([*ckpt.steps(), *ckpt.gone()])]
    finally:
        ckpt.close()
    return {"run": ckpt.store.uri(""), "ok": all(s["ok"] for s in steps), "steps": steps}


def rollback(run: str, step: int) -> dict[str, Any]:
    """Discard the checkpoints after `step` so that the next resume (`runtime local --resume`,
    or a launched job's auto-resume) continues from it; `step` itself is read first."""
    from runtime.run import owner
    from runtime.run.artifacts import record_discarded_checkpoints

    store = open_run(run)  # a run directory, before anything (even a claim) is written there
    run_id = store.read_json(MANIFEST).get("run_id") or store.root_uri.rsplit("/", 1)[-1]
    # Deleting checkpoints under a live run would pull its resume point away: claim the run
    # first, exactly as training does (a live owner refuses this with one sentence).
    owner.acquire(store.root_uri, run_id=run_id, submission_id=None, attempt=0, lease_s=60)
    try:
        ckpt = _service(run, read_only=False, store=store)
        try:
            step = ckpt.resolve(step)
            found = ckpt.verify(step)
            if not found["ok"]:
                raise ckpt.unreadable(step, found["cause"])
            discarded = ckpt.discard_after(step)
            record_discarded_checkpoints(store, discarded, step)
        finally:
            ckpt.close()
    finally:
        owner.release(store.root_uri)
    return {"run": ckpt.store.uri(""), "step": step, "discarded": discarded}


def describe(report: dict[str, Any]) -> list[str]:
    """verify's lines: `step N: ok (X MiB)` (`, unverified: ...` for a step saved before
    checksums), or `step N: missing|damaged|unreadable: cause`."""
    lines = []
    for s in report["steps"]:
        size = f"{s['bytes'] / MIB:.1f} MiB" if s["bytes"] is not None else "size unknown"
        if not s["ok"]:
            lines.append(f"step {s['step']}: {s.get('state', 'unreadable')}: {s['cause']}")
        elif s.get("verified", True):
            lines.append(f"step {s['step']}: ok ({size})")
        else:
            lines.append(f"step {s['step']}: ok ({size}, unverified: saved without checksums)")
    if not report["steps"]:
        lines.append(f"{report['run']}: no committed checkpoint")
    return lines
