"""Whether a committed step's bytes are the ones saved: its files compared with the checksums
recorded at its save (checksums.py), once per step and set of items read, and `runtime
checkpoints verify`'s full read of a step into host memory.

What changes after the commit is never passed in silence: a step whose bytes changed is refused
by a restore, and a resume of the latest step falls back past damaged ones to the newest intact
step (service.py), saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp

from runfolder.layout import checkpoint_dir
from runfolder.store import ArtifactStore
from runtime.run import checksums
from runtime.run.checkpoint.errors import raise_if_fault, short_cause
from runtime.run.checkpoint.index import CheckpointIndex
from runtime.run.checkpoint.log_filters import quiet_abandoned_reads
from runtime.run.checkpoint.orbax_manager import RESUME_ITEMS, array_restore
from runtime.run.meta import CheckpointMeta

#: A checksum comparison made before the service existed (run/early_check.py `take`):
#: (root_uri, step, items) -> its Finding, or None.
EarlyFinding = Callable[[str, int, tuple[str, ...] | None], Any]


def check_step(store: ArtifactStore, step: int, items: tuple[str, ...] | None) -> checksums.Finding:
    """`step`'s files (of `items`) against their checksums: gs:// objects by the MD5 GCS keeps
    (nothing downloaded), local files by content."""
    return checksums.check(store, checkpoint_dir(step), content=not store.remote, items=items)


def step_damage(store: ArtifactStore, step: int) -> str | None:
    """What `CheckpointService.damage` says of the files a resume reads, without Orbax."""
    return check_step(store, step, RESUME_ITEMS).damage


class StepChecks:
    """Each step's checksum findings, compared once per set of items read."""

    def __init__(
        self, store: ArtifactStore, index: CheckpointIndex, early_finding: EarlyFinding | None
    ) -> None:
        self.store, self.index = store, index
        self._early_finding = early_finding
        self.found: dict[tuple[int, tuple[str, ...] | None], checksums.Finding] = {}

    def damage(self, step: int, items: tuple[str, ...] | None = None) -> str | None:
        """Why the bytes of `step` (of its `items`, default all) are not the ones saved: its
        directory is gone, or a file differs from its checksums. None: intact, or saved before
        checksums (unverified). Every host gets the same answer from the same files."""
        if step in self.index.gone:
            return f"{self.index.directory}/{step} is gone"
        if (step, items) not in self.found:
            # A resume's comparison may have started with the process (run/early_check.py).
            found = None
            if self._early_finding is not None:
                found = self._early_finding(self.store.root_uri, step, items)
            if found is None:
                found = check_step(self.store, step, items)
            self.found[step, items] = found
        return self.found[step, items].damage

    def forget(self, step: int) -> None:
        """Drop `step`'s findings (it was saved anew, or deleted)."""
        for key in [k for k in self.found if k[0] == step]:
            del self.found[key]


def verify_step(
    mgr: ocp.CheckpointManager, index: CheckpointIndex, checks: StepChecks, step: int
) -> dict[str, Any]:
    """Read all of `step` (params, opt_state, meta) into host memory, with targets built from
    the checkpoint's own array metadata, so no config or mesh is needed. Returns
    {"step", "ok", "state" (ok, missing, damaged, unreadable), "verified" (checksums
    matched), "bytes", "cause"}; never raises for a damaged step. Every byte is compared with
    the step's checksums first (read on gs:// too); a step saved before checksums is read
    only (unverified)."""
    store, directory = index.store, index.directory
    if step in index.gone:
        return {"step": step, "ok": False, "state": "missing", "verified": False,
                "bytes": None, "cause": f"{directory}/{step} is gone"}  # fmt: skip
    size = _disk_bytes(store, checkpoint_dir(step))
    found = checksums.check(store, checkpoint_dir(step), content=True)
    checks.found[step, None] = found
    if found.damage is not None:
        return {"step": step, "ok": False, "state": "damaged", "verified": True,
                "bytes": size, "cause": found.damage}  # fmt: skip
    verified = {"verified": found.verified}
    quiet_abandoned_reads()
    try:
        index.entry(step)
        for item in ("params", "opt_state"):
            # One item at a time, dropped at once: the host holds one copy of one item.
            target = _host_target(f"{directory}/{step}/{item}")
            if target is None:  # Orbax reads an item's tree from its _METADATA
                raise _ItemError(f"{item}: its tree metadata ({item}/_METADATA) cannot be read")
            try:
                got = mgr.restore(step, args=ocp.args.Composite(**{item: array_restore(target)}))
                bad = _nonfinite_leaf(got[item])  # saves are finite: NaN/inf is damage
                del got
            except Exception as e:
                raise _ItemError(f"{item}: {short_cause(e)}") from e
            if bad is not None:
                raise _ItemError(f"{item}: {bad} holds NaN or infinite values")
        try:
            raw = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = CheckpointMeta.from_json(dict(raw["meta"]), where=f"{directory}/{step}")
        except Exception as e:
            raise _ItemError(f"meta: {short_cause(e)}") from e
        if meta.step != step:
            raise _ItemError(f"meta: it says step {meta.step}")
    except _ItemError as e:
        raise_if_fault(directory, step, e.__cause__ or e, "could not be read")
        return {"step": step, "ok": False, "state": "unreadable", **verified, "bytes": size,
                "cause": str(e)}  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any failure to read is the finding
        raise_if_fault(directory, step, e, "could not be read")
        return {"step": step, "ok": False, "state": "unreadable", **verified, "bytes": size,
                "cause": short_cause(e)}  # fmt: skip
    return {"step": step, "ok": True, "state": "ok", **verified, "bytes": size, "cause": None}


class _ItemError(Exception):
    """verify's finding for one item of a step, already one line."""


def _nonfinite_leaf(tree: Any) -> str | None:
    """The path of the first floating array of `tree` holding NaN or inf, else None."""
    import jax
    import numpy as np

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.asarray(leaf)
        if jax.numpy.issubdtype(arr.dtype, jax.numpy.floating) and not np.isfinite(arr).all():
            return jax.tree_util.keystr(path)
    return None


def _host_target(item_dir: str) -> Any:
    """An abstract restore target for a saved StandardSave item: its saved shapes and dtypes,
    in host memory (verification needs the bytes, not the run's layout, and must not fill an
    accelerator with a model it does not train)."""
    import jax

    with ocp.StandardCheckpointer() as reader:  # closed: it runs background threads
        md = reader.metadata(item_dir)
    tree = getattr(md, "item_metadata", md)
    tree = getattr(tree, "tree", tree)
    if tree is None:
        return None  # Orbax hides why; a restore without a target raises the real error
    device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def leaf(m: Any) -> Any:
        if m is None:
            return None
        return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device)

    return jax.tree.map(leaf, tree, is_leaf=lambda m: m is None or hasattr(m, "shape"))


def _disk_bytes(store: ArtifactStore, rel: str) -> int | None:
    try:
        return int(store.fs.du(store._path(rel), total=True))
    except (OSError, ValueError):
        return None
