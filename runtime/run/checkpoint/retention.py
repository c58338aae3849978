"""Which checkpoints are kept and how the others are deleted: the newest `checkpoint.keep` steps
and the best one stay, the index forgets a step before its folder goes.

Retention is ours, not Orbax's: Orbax deletes old steps in its background thread even when the
new step failed to commit, and its choice would have to be mirrored into the index. We delete
through the manager at points every host reaches together (the service's `save`, `wait`,
`discard_after`), because `CheckpointManager.delete` is a cross-host barrier. A step folder that
is a symbolic link is never deleted through (Orbax would empty what it points to), and a step
that cannot be deleted never costs the save that follows it.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from jobspec.errors import CheckpointError, StorageError
from runfolder.layout import checkpoint_dir
from runfolder.store import ArtifactStore
from runtime.run.checkpoint.errors import (
    UndeletableCheckpointError,
    raise_if_fault,
    short_cause,
    warn,
)
from runtime.run.checkpoint.index import CheckpointIndex
from runtime.run.checkpoint.verify import StepChecks


def retired(steps: list[int], keep: int, best: int | None) -> list[int]:
    """The steps (sorted) retention deletes: all but the newest `keep` and the `best`."""
    kept = set(steps[-keep:])
    if best is not None:
        kept.add(best)
    return [s for s in steps if s not in kept]


class Retention:
    """Deletes steps of one run's checkpoints through Orbax's manager, the index first."""

    def __init__(
        self,
        store: ArtifactStore,
        mgr: ocp.CheckpointManager,
        index: CheckpointIndex,
        checks: StepChecks,
        keep: int,
    ) -> None:
        self.store, self.index, self.checks, self.keep = store, index, checks, keep
        self._mgr = mgr
        self.directory = index.directory
        self._kept_links: set[int] = set()  # linked steps retention kept (said once each)
        self.undeletable = False  # a step that had to be deleted could not be

    def retain(self) -> None:
        """Delete the steps past `keep` (never the best one)."""
        self.delete(retired(self.index.steps(), self.keep, self.index.best()), retire=True)

    def delete(self, steps: list[int], *, retire: bool = False) -> None:
        """Delete `steps`, the index first. A step folder that is a symbolic link is never
        deleted through (Orbax would empty what it points to): retention (`retire`) keeps it,
        said once; anything else is refused, one sentence, before a thing changes."""
        links = {s: t for s in steps if (t := _link_target(self.store, s)) is not None}
        if links and not retire:
            s = min(links)
            raise CheckpointError(
                f"{self.directory}/{s} is a symbolic link to {links[s]}, and checkpoints are "
                "never deleted through a link; remove the link yourself (what it points to is "
                "kept) and run again"
            )
        for s in sorted(links.keys() - self._kept_links):
            self._kept_links.add(s)
            if self.store.is_writer:
                warn(
                    f"checkpoint {s} under {self.directory} is a symbolic link to {links[s]}; "
                    f"it is kept past checkpoint.keep = {self.keep}, as checkpoints are never "
                    "deleted through a link (remove the link yourself once it is not needed)"
                )
        steps = [s for s in steps if s not in links]
        if not steps:
            return
        for s in steps:
            self.index.entries.pop(s, None)
            self.checks.forget(s)
        self.index.write()  # index first: a crash between leaves an orphan, never a dangling entry
        known = set(self._mgr.all_steps())
        for s in steps:
            try:
                if s in known:
                    self._mgr.delete(s)
                elif self.store.is_writer:
                    self.store.delete(checkpoint_dir(s), recursive=True)
            except (OSError, StorageError) as e:
                raise_if_fault(self.directory, s, e, "could not be deleted")
                self.undeletable = True
                # Still on disk, so the next start indexes it again: nothing is lost.
                raise UndeletableCheckpointError(
                    f"checkpoint {s} under {self.directory} could not be deleted "
                    f"({short_cause(e)}); every other checkpoint is kept: fix what the cause "
                    f"names under {self.directory}/{s} (or delete it yourself) and run again"
                ) from e


def _link_target(store: ArtifactStore, step: int) -> str | None:
    """Where the local step folder points when it is a symbolic link (gs:// has none). Every
    host of a job sees the same run directory, so all decide alike."""
    if store.remote:
        return None
    path = store._path(checkpoint_dir(step))
    return os.path.realpath(path) if os.path.islink(path) else None
