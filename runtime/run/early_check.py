"""A resume's checksum comparison, started when `runtime local --resume` or `runtime worker`
(which resumes a run that has a checkpoint) starts.

A resume compares the step's files with the checksums recorded at its save (a local file by
its content: every byte read and hashed). Started here, beside the import of the training code
and the accelerator runtime's start, rather than beside Orbax's read once the devices are up,
it is done or nearly so by the time the restore begins, and the files it read are in the page
cache for Orbax. `CheckpointService.damage` takes its verdict (`take`) for the step it was made
for; anything else (another step, an error here) and the comparison runs as it would have.
"""

from __future__ import annotations

from concurrent.futures import Future

from runfolder.background import in_background
from runfolder.store import ArtifactStore

_early: dict[str, Future] = {}  # run root -> Future[(step, items, Finding) | None]


def start(root_uri: str, from_step: int | None) -> None:
    """Compare the checksums of the step a resume of the run at `root_uri` will read (`from_step`,
    else its newest committed step) on a background thread. Only for local storage: on gs://
    the comparison reads no bytes (GCS lists each object's MD5)."""

    store = ArtifactStore(root_uri, process_index=0)
    if store.remote:
        return

    def compare():
        from runtime.run.checkpoint.index import reconciled_entries
        from runtime.run.checkpoint.orbax_manager import RESUME_ITEMS
        from runtime.run.checkpoint.verify import check_step

        steps = reconciled_entries(store)
        step = from_step if from_step is not None else max(steps, default=None)
        if step is None or step not in steps:
            return None
        return step, RESUME_ITEMS, check_step(store, step, RESUME_ITEMS)

    _early[store.root_uri] = in_background(compare, "ckpt-early-check")


def take(root_uri: str, step: int, items: tuple[str, ...] | None):
    """The early comparison's Finding for `step`'s `items` of the run whose store root is
    `root_uri` (`ArtifactStore.root_uri`; waiting for it to finish), or None when there is none
    for exactly those (then compare as usual)."""
    future = _early.pop(root_uri, None)
    if future is None:
        return None
    try:
        found = future.result()
    except Exception:  # noqa: BLE001 - the comparison runs again where it always ran
        return None
    if found is None or found[:2] != (step, items):
        return None
    return found[2]
