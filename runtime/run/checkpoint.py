"""The checkpoint service: Orbax saves under `<run>/checkpoints`, and the index that says which exist.

`checkpoints/index.json` is the source of truth for resume, eval and sample. A step enters it
only once Orbax has committed it (locally the final `<step>/` directory exists; on gs:// the
step holds `commit_success.txt`), so a crash mid-save never becomes `latest`. Every host calls
save/restore (Orbax needs all of them); only the writer writes the index, through the store.
The committed step folders are what the index is rebuilt from when it is missing or damaged
(a damaged one is kept beside it, `index.json.corrupt-<time>`).

What changes after the commit is never passed in silence: the writer records each committed
step's content checksums (checksums.py); a listed step whose directory is gone is said once
(and dropped from the index), a step whose bytes changed is refused by `restore`, and a resume
of the latest step falls back past damaged ones to the newest intact step, saying so.

Retention is ours, not Orbax's: Orbax deletes old steps in its background thread even when the
new step failed to commit, and its choice would have to be mirrored into the index. We delete
through the manager at points every host reaches together (`save`, `wait`, `discard_after`),
because `CheckpointManager.delete` is a cross-host barrier. A step folder that is a symbolic
link is never deleted through (Orbax would empty what it points to), and a step that cannot be
deleted never costs the save that follows it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jobspec.background import in_background
from jobspec.errors import CheckpointError, ConfigError, StorageError, StorageFaultError
from jobspec.run_dir import CHECKPOINT_INDEX, CHECKPOINTS, EVENTS, Event, EventKind, checkpoint_dir
from jobspec.run_store import ArtifactStore
from jobspec.storage import RetryPolicy, configure_gcs_env, storage_fault
from runtime.run import checksums
from runtime.run.meta import CheckpointMeta


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def tensorstore_retries(policy: RetryPolicy) -> dict[str, Any]:
    """tensorstore's `gcs_request_retries` for `policy`: the same backoff, and as many tries as
    it takes for the waits (initial_s doubling up to max_s) to add up to total_s. Its default
    (32 tries up to 32 s apart) retries a failing upload for about 15 minutes, past every
    deadline of the run's own storage calls."""
    waited, tries = 0.0, 0
    while waited < policy.total_s:
        waited += policy.backoff_s(tries)
        tries += 1
    return {
        "max_retries": max(tries, 1),
        "initial_delay": f"{policy.initial_s}s",
        "max_delay": f"{policy.max_s}s",
    }


def bound_tensorstore_retries(policy: RetryPolicy) -> None:
    """Make the tensorstore contexts Orbax builds for every save and restore retry gs:// requests
    within `policy` (runtime.storage_retry_s). Orbax has no parameter for it: it copies these
    module-level defaults for each context (tests/test_checkpoint.py checks that it still
    does); a version without them keeps tensorstore's own retries."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    retries = tensorstore_retries(policy)
    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        context = getattr(ts_utils, name, None)
        if isinstance(context, dict):
            context["gcs_request_retries"] = retries


COMMIT_FILE = "commit_success.txt"  # Orbax's commit marker for object stores
_JSON_FILE = "metadata"  # what Orbax's JSON handler names an item's one file
# `entry` repeats the step's index entry inside the checkpoint, so a step that committed just
# before a crash (index not yet rewritten) can be re-indexed from disk.
ITEMS = ("params", "opt_state", "meta", "entry")
RESUME_ITEMS = ("params", "opt_state", "meta")  # what a resume reads
ARRAY_ITEMS = ("params", "opt_state")
#: Orbax compresses arrays with zstd unless told otherwise. Over float32 weights and Adam moments
#: that saved 8% of the bytes for twice the CPU of the whole write (bench/ckpt_host_cost.py), CPU
#: a background write takes from the host that feeds the steps; so arrays are written plain.
#: Either kind restores: Orbax reads the codec from each array's metadata.
COMPRESS = False


@dataclass(frozen=True)
class Resumed:
    """What `restore_resume` read: the step, its arrays and meta, and how long comparing its
    checksums beside the read took (None: compared first, or saved before checksums)."""

    step: int
    params: Any
    opt_state: Any
    meta: CheckpointMeta
    verify_s: float | None = None


@dataclass
class _Pending:
    step: int
    entry: dict[str, Any]
    started: float  # perf_counter when Orbax was handed the save
    # The writer's checksums of the committed step, computed off the training thread (reading
    # back a multi-GB state takes seconds); the step is indexed once they are written.
    summing: Future | None = None


def load_index(store: ArtifactStore, *, say: bool = True) -> dict[str, Any]:
    """index.json as written, without touching Orbax (resume's compatibility check reads this).

    A damaged one (not JSON, or not an index) reads as the index rebuilt from the committed
    checkpoint folders, as a missing one is on resume. `say`: the writer says so in one warning
    line naming the command that rebuilds it on disk (a resume runs `repair_index`)."""
    doc, fault = _written_index(store)
    if fault is None:
        return doc
    rebuilt = _rebuilt_index(store)
    if say and store.is_writer:
        _warn(
            f"{store.uri(CHECKPOINT_INDEX)} is damaged ({fault}); reading the committed "
            f"checkpoints under {store.uri(CHECKPOINTS)} instead ({_steps_text(rebuilt)}); "
            "`runtime local CONFIG --resume` rebuilds it (a completed run trains nothing more)"
        )
    return rebuilt


def repair_index(store: ArtifactStore, best_metric: str = "val_loss") -> None:
    """On the writer, before the run changes: a damaged index.json is kept beside it as
    `index.json.corrupt-<time>` and rebuilt from the committed checkpoint folders, in one
    warning line. Every other host reads the same steps from the same folders meanwhile."""
    if not store.is_writer:
        return
    _, fault = _written_index(store)
    if fault is None:
        return
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    kept = f"{CHECKPOINT_INDEX}.corrupt-{stamp}"
    store.write_bytes(kept, store.read_bytes(CHECKPOINT_INDEX))  # before it is replaced
    rebuilt = _rebuilt_index(store, best_metric)
    store.write_json(CHECKPOINT_INDEX, rebuilt)
    _warn(
        f"{store.uri(CHECKPOINT_INDEX)} was damaged ({fault}); rebuilt it from the committed "
        f"checkpoints under {store.uri(CHECKPOINTS)} ({_steps_text(rebuilt)}) and kept the "
        f"damaged file as {store.uri(kept)}"
    )


def _written_index(store: ArtifactStore) -> tuple[dict[str, Any], str | None]:
    """(index.json as written, None), or (an empty index, what is wrong with it) when it is
    damaged. Absent is not damaged: a run before its first commit has none."""
    if not store.exists(CHECKPOINT_INDEX):
        return _index_doc({}, None), None
    try:
        doc = json.loads(store.read_bytes(CHECKPOINT_INDEX))
    except ValueError as e:  # JSONDecodeError, or bytes that are not text at all
        return _index_doc({}, None), f"not valid JSON: {e}"
    fault = _index_fault(doc)
    return (doc, None) if fault is None else (_index_doc({}, None), fault)


def _index_fault(doc: Any) -> str | None:
    """What makes `doc` no checkpoint index (every reader indexes entries by their step)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("checkpoints"), list):
        return "not a checkpoint index"
    for i, entry in enumerate(doc["checkpoints"]):
        step = entry.get("step") if isinstance(entry, dict) else None
        if not _is_step(step):
            return f"checkpoints[{i}] is {entry!r:.80}, not an entry with an integer step"
    for key in ("latest", "best"):
        if doc.get(key) is not None and not _is_step(doc[key]):
            return f"{key} is {doc[key]!r:.80}, not a step or null"
    return None


def _rebuilt_index(store: ArtifactStore, best_metric: str = "val_loss") -> dict[str, Any]:
    """The index the committed step folders give, each entry as its checkpoint recorded it (an
    eval's loss added after the save is not there, so `best` may differ from the lost one)."""
    entries = reconciled_entries(store, _index_doc({}, None))
    return _index_doc(entries, _best_step(entries, best_metric))


def _steps_text(index: dict[str, Any]) -> str:
    steps = [str(e["step"]) for e in index["checkpoints"]]
    return f"steps {', '.join(steps)}" if steps else "none is committed"


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _finite_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The metrics an index entry records: finite numbers only (a NaN eval loss is left out, so
    it can never make a step `best`)."""
    out = {}
    for k, v in (metrics or {}).items():
        try:
            value = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[k] = value
    return out


def _best_step(entries: dict[int, dict[str, Any]], metric: str) -> int | None:
    """Lowest `metric`; a run that records it nowhere (no evals) has latest as best, as Orbax's
    own best_step does. A non-finite or missing value (written null) never wins."""
    scored = [
        (float(e["metrics"][metric]), s)
        for s, e in entries.items()
        if isinstance(e.get("metrics"), dict) and _finite_number(e["metrics"].get(metric))
    ]
    if scored:
        return min(scored)[1]
    return max(entries) if entries else None


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _committed(store: ArtifactStore, step: int) -> bool:
    rel = checkpoint_dir(step)
    if store.remote:
        return store.exists(f"{rel}/{COMMIT_FILE}")
    return store.isdir(rel)  # the atomic rename from the tmp dir is the commit


def _read_entry(store: ArtifactStore, step: int) -> dict[str, Any] | None:
    rel = f"{checkpoint_dir(step)}/entry/metadata"  # JsonSave's file inside the `entry` item
    try:
        entry = store.read_json(rel)
    except StorageError:
        _warn(f"checkpoint {store.uri(rel)} has no readable entry; leaving it unindexed")
        return None
    return entry if isinstance(entry, dict) and entry.get("step") == step else None


def reconciled_entries(
    store: ArtifactStore, written: dict[str, Any] | None = None
) -> dict[int, dict[str, Any]]:
    """The index entries that agree with disk, without touching Orbax: drop steps that are gone,
    adopt committed steps a crash kept out of the index. Every host computes the same answer
    from the same files; this is what "has the run a checkpoint" means everywhere."""
    written = load_index(store, say=False) if written is None else written
    listed = {int(e["step"]): e for e in written["checkpoints"]}
    on_disk = {
        int(n) for n in store.listdir(CHECKPOINTS) if n.isdigit() and _committed(store, int(n))
    }
    entries = {s: e for s, e in listed.items() if s in on_disk}
    for step in sorted(on_disk - listed.keys()):
        entry = _read_entry(store, step)
        if entry is not None:
            entries[step] = entry
    return entries


def check_step(store: ArtifactStore, step: int, items: tuple[str, ...] | None) -> checksums.Finding:
    """`step`'s files (of `items`) against their checksums: gs:// objects by the MD5 GCS keeps
    (nothing downloaded), local files by content."""
    return checksums.check(store, checkpoint_dir(step), content=not store.remote, items=items)


def step_damage(store: ArtifactStore, step: int) -> str | None:
    """What `CheckpointService.damage` says of the files a resume reads, without Orbax."""
    return check_step(store, step, RESUME_ITEMS).damage


class CheckpointService:
    """Save, index, retain and restore train-state checkpoints of one run."""

    def __init__(
        self,
        store: ArtifactStore,
        *,
        keep: int,
        async_save: bool = True,
        best_metric: str = "val_loss",
        read_only: bool = False,
        every: int = 0,
        last_step: int | None = None,
        warn_gone: bool = True,
        early_finding: Callable[[str, int, tuple[str, ...] | None], Any] | None = None,
    ) -> None:
        """`every`/`last_step` are the run's cadence (`checkpoint.every`, the final step):
        `due` says which steps before the last are periodic saves (every `every`-th).
        `warn_gone=False` leaves saying that listed steps are gone to the caller (verify).
        `early_finding(root_uri, step, items)`: a checksum comparison made before this service
        existed (run/early_check.py `take`), or None; compared here when it gives none."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        configure_gcs_env()
        if store.remote:
            bound_tensorstore_retries(store.retry)
        self.store = store
        self.keep = keep
        self.every, self.last_step = every, last_step
        self.best_metric = best_metric
        self._early_finding = early_finding
        self.read_only = read_only
        self.directory = store.uri(CHECKPOINTS)
        if store.remote:
            _invalidate_epath_cache(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # retention is ours (see module docstring)
            enable_async_checkpointing=async_save,
            # Removes what a crash left: local `<step>.orbax-checkpoint-tmp` dirs, gs:// steps
            # without a commit file. Never in read-only use: it would delete a live run's save.
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
            # The writer creates and commits step directories; the others write their shards.
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=store.writer_index
            ),
        )
        try:
            self._mgr = ocp.CheckpointManager(
                epath.Path(self.directory),
                item_names=ITEMS,
                item_handlers=_array_handlers(store.writer_index),
                options=options,
            )
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot open checkpoints under {self.directory}: {e}") from e
        self._pending: _Pending | None = None
        self.waited_s = 0.0  # how long the latest `save` waited for the one before it
        # Told (step, seconds from the save's start) when a save is indexed: the train loop's
        # record of how long the storage took to write it.
        self.on_written: Callable[[int, float], None] | None = None
        self._async = async_save
        # Reading back and hashing a multi-GB step takes a core for seconds: at low priority,
        # so the threads that feed the steps come first.
        self._summer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckpt-checksums", initializer=_lower_priority
        )
        self._failed_step: int | None = None  # the step whose save failed, if one did
        self._undeletable = False  # a step that had to be deleted could not be
        # A damaged index: rebuilt on disk by a service that may write, in memory (and said,
        # naming the command that rebuilds it) by a read-only one.
        if not read_only:
            repair_index(store, best_metric)
        written = load_index(store, say=read_only)
        self._kept_links: set[int] = set()  # linked steps retention kept (said once each)
        self._entries = reconciled_entries(store, written)
        # Listed steps whose committed directory is gone (deleted, lost with a disk).
        self._gone = sorted({int(e["step"]) for e in written["checkpoints"]} - self._entries.keys())
        # Each step's bytes are compared once per set of items read.
        self._checked: dict[tuple[int, tuple[str, ...] | None], checksums.Finding] = {}
        if self._gone and warn_gone:
            self._say_gone()
        if self.read_index() != written:
            self._write_index()

    def _say_gone(self) -> None:
        """One line (and, on a run this service may write, an event per step) for listed steps
        whose directory is gone: the index forgets them, never in silence."""
        if not self.store.is_writer:
            return
        d = self.directory
        what = (
            f"checkpoint {self._gone[0]} is listed in {self.store.uri(CHECKPOINT_INDEX)} but {d}/"
            f"{self._gone[0]} is gone"
            if len(self._gone) == 1
            else f"checkpoints {', '.join(map(str, self._gone))} are listed in "
            f"{self.store.uri(CHECKPOINT_INDEX)} but their directories under {d} are gone"
        )
        latest = self.latest()
        left = (
            "no checkpoint is left"
            if latest is None
            else f"the newest intact checkpoint is {latest}"
        )
        print(f"warning: {what}; {left}", file=sys.stderr, flush=True)
        if not self.read_only:
            self._events([Event(EventKind.CHECKPOINT_MISSING, {"step": s, "directory": f"{d}/{s}"})
                          for s in self._gone])  # fmt: skip

    def _events(self, events: list[Event]) -> None:
        if self.store.is_writer and not self.read_only:
            self.store.append_jsonl(EVENTS, [e.to_json() for e in events])

    def gone(self) -> list[int]:
        """Steps the index listed whose committed directory is gone."""
        return list(self._gone)

    # ---- index -------------------------------------------------------------------------------

    def _committed(self, step: int) -> bool:
        return _committed(self.store, step)

    def _best(self) -> int | None:
        return _best_step(self._entries, self.best_metric)

    def read_index(self) -> dict[str, Any]:
        return _index_doc(self._entries, self._best())

    def _write_index(self) -> None:
        if self.store.is_writer and not self.read_only:
            self.store.write_json(CHECKPOINT_INDEX, self.read_index())

    def steps(self) -> list[int]:
        return sorted(self._entries)

    def latest(self) -> int | None:
        return max(self._entries) if self._entries else None

    def best(self) -> int | None:
        return self._best()

    def fingerprint(self, step: int) -> dict[str, Any]:
        return dict(self._entry(step).get("fingerprint") or {})

    def _entry(self, step: int) -> dict[str, Any]:
        if step not in self._entries:
            raise CheckpointError(
                f"step {step} is not a committed checkpoint under {self.directory}; "
                f"available steps: {self._available()}"
            )
        return self._entries[step]

    def _available(self) -> str:
        return ", ".join(map(str, self.steps())) or "none"

    def resolve(self, selector: str | int) -> int:
        """'latest', 'best' or a step number -> a committed step, or CheckpointError."""
        if not self._entries:
            raise CheckpointError(
                f"no checkpoint under {self.directory}; run without --resume first"
            )
        if selector == "latest":
            return max(self._entries)
        if selector == "best":
            best = self._best()
            assert best is not None  # there are entries, so there is a best
            return best
        if isinstance(selector, int) or (isinstance(selector, str) and selector.isdigit()):
            step = int(selector)
            self._entry(step)
            return step
        raise CheckpointError(
            f"checkpoint selector {selector!r} is not 'latest', 'best' or a step number"
        )

    # ---- save --------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether `step` is a periodic save (the final step's save is the caller's `final`)."""
        before_last = self.last_step is None or step < self.last_step
        return self.every > 0 and step % self.every == 0 and before_last

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any,
        meta: CheckpointMeta,
        metrics: dict[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Start saving `step` (in the background if async); every host must call it.

        Returns False when `step` is already saved (e.g. a final save right after a periodic
        one); force=True replaces that checkpoint instead. A step older than the latest one is
        refused: a run resumed from an older step must call discard_after() first.
        """
        if self.read_only:
            raise RuntimeError(f"checkpoint service on {self.directory} is read-only")
        t0 = time.perf_counter()
        self._wait_orbax()
        self.poll(block=True)
        # Retention makes room first, but a step it cannot delete never costs this save: that
        # error is raised once the save has started (the failure path then commits it).
        refused: UndeletableCheckpointError | None = None
        try:
            self._retain()
        except UndeletableCheckpointError as e:
            refused = e
        # The part of this call spent on the previous save (its write, checksums and retention).
        self.waited_s = time.perf_counter() - t0
        if step in self._entries:
            if not force:
                return False
            self._delete([step])
        latest = self.latest()
        if latest is not None and step < latest:
            raise CheckpointError(
                f"cannot save step {step} under {self.directory}: checkpoint {latest} is newer; "
                f"a run resumed from an older step must discard the later ones first"
            )
        entry = {
            "step": step,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "metrics": _finite_metrics(metrics),
            "fingerprint": meta.fingerprint,
        }
        args = ocp.args.Composite(
            params=ocp.args.PyTreeSave(params),
            opt_state=ocp.args.PyTreeSave(opt_state),
            meta=ocp.args.JsonSave(meta.to_json()),
            entry=ocp.args.JsonSave(entry),
        )
        started = time.perf_counter()
        try:
            # force: the train loop decides when to save; Orbax's own interval policy must not.
            self._mgr.save(step, args=args, force=True)
        except Exception as e:
            self._raise_save_error(step, e, "cannot save")
        self._pending = _Pending(step, entry, started)
        # A synchronous save is committed already, and is indexed (checksums and all) before
        # this returns; an async one is indexed by a later poll.
        self.poll(block=not self._async)
        if refused is not None:
            raise refused
        return True

    def newest(self) -> int | None:
        """The newest step saved or being saved (a background save not yet indexed counts)."""
        steps = [*self._entries, *([self._pending.step] if self._pending else [])]
        return max(steps) if steps else None

    def writing(self, grace_s: float = 0.0) -> int | None:
        """The step whose started save this host is still writing (Orbax's write, or the
        writer's checksums) after up to `grace_s` seconds' wait for it, a save that finished
        being indexed; None when none is."""
        deadline = time.monotonic() + grace_s
        while True:
            self.poll()
            if self._pending is None:
                return None
            if time.monotonic() >= deadline:
                return self._pending.step
            time.sleep(0.01)

    def writing_anywhere(self, grace_s: float = 0.0) -> int | None:
        """`writing` as every host agrees on it (the newest step any host still writes), so a
        periodic save is skipped on all hosts or on none; every host must call it."""
        mine = self.writing(grace_s)
        import jax

        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        flag = np.asarray(-1 if mine is None else mine, np.int32)
        busy = [int(s) for s in np.ravel(multihost_utils.process_allgather(flag)) if s >= 0]
        return max(busy) if busy else None

    def set_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Add metrics (an eval's `val_loss`, which picks `best`) to a step saved before its eval
        ran: committed (the index is rewritten) or still saving (indexed with them). The copy
        of the entry inside the checkpoint keeps the metrics it was saved with."""
        found = self._pending.entry if self._pending and self._pending.step == step else None
        if found is None and step in self._entries:
            found = self._entries[step] = dict(self._entries[step])
        if found is None or self.read_only:
            return
        found["metrics"] = {**(found.get("metrics") or {}), **_finite_metrics(metrics)}
        if step in self._entries:
            self._write_index()

    def poll(self, *, block: bool = False) -> int | None:
        """Index a save that has finished in the background; returns its step, else None.

        Cheap enough for every train step: nothing is read until Orbax says the save is done,
        and the writer's checksums of the committed step are then computed in a background
        thread; the step is indexed by the first poll after they are done (`block`: wait)."""
        if self._pending is None:
            return None
        step = self._pending.step
        if self._pending.summing is None:
            if self._mgr.is_saving_in_progress():
                return None
            if not self._committed(step):
                # The background save ended without a commit: its own error (ENOSPC, a 503) is
                # what the user must see, so fetch it before saying "did not commit".
                self._wait_orbax()
                if not self._committed(step):
                    self._pending, self._failed_step = None, step
                    raise CheckpointError(
                        f"checkpoint {step} under {self.directory} did not commit (the Orbax "
                        "log above has the cause); check the storage and restart from the "
                        "latest checkpoint"
                    )
            if self.store.is_writer:
                self._pending.summing = self._summer.submit(
                    checksums.record, self.store, checkpoint_dir(step)
                )
        summing = self._pending.summing
        if summing is not None:
            if not block and not summing.done():
                return None
            try:
                record = summing.result()
            except BaseException:
                self._pending, self._failed_step = None, step
                raise
            # Before the index: a crash between leaves a step adopted from disk with its record.
            checksums.write(self.store, checkpoint_dir(step), record)
        pending, self._pending = self._pending, None
        self._entries[pending.step] = pending.entry
        self._forget_checks(pending.step)
        self._write_index()
        if self.on_written is not None:
            self.on_written(pending.step, time.perf_counter() - pending.started)
        return pending.step

    def _wait_orbax(self) -> None:
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # whatever the background save raised, re-raised here
            step = self._pending.step if self._pending else self._failed_step
            self._pending = None
            self._raise_save_error(step, e, "failed to save")

    def _raise_if_fault(self, name: int | str, e: BaseException, what: str) -> None:
        """Raise StorageFaultError when a failed save or read was the storage's fault (ENOSPC,
        EIO, gs:// 5xx or timeouts: the job ends restartable); return when it was not (the
        checkpoint's own problem)."""
        if isinstance(e, StorageFaultError):
            raise e
        fault = storage_fault(e)
        if fault is None:
            return
        hint = (
            "free space (or fix the disk) and restart: the run resumes from the latest "
            "committed checkpoint"
            if fault.disk
            else "restart once the storage answers again: the run resumes from the latest "
            "committed checkpoint"
        )
        raise StorageFaultError(
            f"checkpoint {name} under {self.directory} {what}: {fault.reason}; {hint}"
        ) from e

    def _raise_save_error(self, step: int | None, e: Exception, what: str) -> None:
        """Say why a save failed in one sentence: a storage fault (ENOSPC, EIO, gs:// 5xx or
        timeouts) ends the job restartable; anything else is a checkpoint error. The step is
        remembered: Orbax re-raises the same background error on every later wait."""
        self._failed_step = step
        name = "?" if step is None else step
        self._raise_if_fault(name, e, what)
        if isinstance(e, OSError | ValueError | StorageError):
            raise CheckpointError(
                f"checkpoint {name} under {self.directory} {what} ({e}); check the "
                "storage and restart from the latest checkpoint"
            ) from e
        raise e

    def _settle(self) -> None:
        # Every host reaches this together, so the deletes' barriers line up.
        self._wait_orbax()
        self.poll(block=True)
        self._retain()

    def _retain(self) -> None:
        steps = self.steps()
        keep = set(steps[-self.keep :])
        best = self._best()
        if best is not None:
            keep.add(best)
        self._delete([s for s in steps if s not in keep], retire=True)

    def _delete(self, steps: list[int], *, retire: bool = False) -> None:
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
                _warn(
                    f"checkpoint {s} under {self.directory} is a symbolic link to {links[s]}; "
                    f"it is kept past checkpoint.keep = {self.keep}, as checkpoints are never "
                    "deleted through a link (remove the link yourself once it is not needed)"
                )
        steps = [s for s in steps if s not in links]
        if not steps:
            return
        for s in steps:
            self._entries.pop(s, None)
            self._forget_checks(s)
        self._write_index()  # index first: a crash between leaves an orphan, never a dangling entry
        known = set(self._mgr.all_steps())
        for s in steps:
            try:
                if s in known:
                    self._mgr.delete(s)
                elif self.store.is_writer:
                    self.store.delete(checkpoint_dir(s), recursive=True)
            except (OSError, StorageError) as e:
                self._raise_if_fault(s, e, "could not be deleted")
                self._undeletable = True
                # Still on disk, so the next start indexes it again: nothing is lost.
                raise UndeletableCheckpointError(
                    f"checkpoint {s} under {self.directory} could not be deleted "
                    f"({short_cause(e)}); every other checkpoint is kept: fix what the cause "
                    f"names under {self.directory}/{s} (or delete it yourself) and run again"
                ) from e

    def discard_after(self, step: int) -> list[int]:
        """Delete checkpoints newer than `step` (a run resumed from an older step branches off
        there); every host must call it. Returns the deleted steps."""
        self._wait_orbax()
        self.poll(block=True)
        newer = [s for s in self.steps() if s > step]
        self._delete(newer)
        return newer

    def wait(self) -> None:
        """Block until every started save is committed, indexed and retention applied."""
        if not self.read_only:
            self._settle()

    def close(self, *, after_failure: bool = False) -> None:
        """Finish started saves and release Orbax. After a failure (the caller's, or a save
        that already failed) nothing here may hide the first error: it is logged instead; after
        a step that could not be deleted, the saves are finished without trying again."""
        try:
            if self._undeletable:
                self._wait_orbax()
                self.poll(block=True)
            else:
                self.wait()
        except Exception as e:
            if not (after_failure or self._failed_step is not None):
                with contextlib.suppress(Exception):
                    self._mgr.close()  # released either way; the save's error is the one raised
                raise
            _warn(f"closing checkpoints under {self.directory} after a failure: {e}")
        self._summer.shutdown(wait=False, cancel_futures=True)
        try:
            self._mgr.close()
        except Exception as e:
            if not (after_failure or self._failed_step is not None):
                raise
            _warn(f"closing checkpoints under {self.directory} after a failure: {e}")

    # ---- restore -----------------------------------------------------------------------------

    def restore(
        self,
        step: int,
        *,
        params_target: Any,
        opt_state_target: Any = None,
        fallback: str = "resume",
        check_first: bool = True,
    ) -> tuple[Any, Any | None, CheckpointMeta]:
        """(params, opt_state or None, meta) of a committed step; every host must call it.

        Targets are abstract pytrees (jax.ShapeDtypeStruct with .sharding) so arrays come back
        sharded as the run needs. Without opt_state_target the optimizer state is not read.
        A step that cannot be read raises UnreadableCheckpointError; `fallback` ("resume",
        "rollback" for a launched job, "select" for eval/sample) picks which way to an older
        step its sentence suggests. `check_first=False`: the caller compares the checksums
        itself (`restore_resume`, beside the read).
        """
        self._entry(step)
        read = RESUME_ITEMS if opt_state_target is not None else ("params", "meta")
        if check_first and (damage := self.damage(step, read)) is not None:
            raise self.unreadable(step, damage, fallback=fallback)
        _quiet_abandoned_reads()  # before: a failed read's siblings may complete at any time
        items: dict[str, Any] = {
            "params": _array_restore(params_target),
            "meta": ocp.args.JsonRestore(),
        }
        if opt_state_target is not None:
            items["opt_state"] = _array_restore(opt_state_target)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
            meta = CheckpointMeta.from_json(dict(out["meta"]), where=f"{self.directory}/{step}")
        except Exception as e:  # noqa: BLE001 - Orbax/tensorstore/jax/json raise anything here
            # The storage failing under the read (a 503, a timeout, EIO) is no verdict on the
            # checkpoint: restartable, and the step is not marked unreadable.
            self._raise_if_fault(step, e, "could not be read")
            _quiet_abandoned_futures()
            raise self.unreadable(step, e, fallback=fallback) from e
        opt_state = out["opt_state"] if opt_state_target is not None else None
        return out["params"], opt_state, meta

    def restore_resume(
        self,
        from_step: int | None,
        *,
        params_target: Any,
        opt_state_target: Any,
        before_read: Callable[[int], None],
        fallback: str = "resume",
    ) -> Resumed:
        """What a resume starts from: `from_step`, else the newest intact step; every host
        must call it. `before_read(step)` runs before Orbax reads a step (the caller's checks;
        it raises to refuse one).

        The step's checksums are compared while Orbax reads it rather than before, so a
        multi-GB state is read once from disk in the time of the slower of the two. A damaged
        step is then set aside and the rest goes as `resume_step` says: the newest intact one
        is read (the damaged ones said and discarded), or a damaged `from_step` is refused. A
        step the caller refuses (past the end, another config) is decided that way first."""
        step = self.resolve(from_step if from_step is not None else "latest")
        try:
            before_read(step)
        except (CheckpointError, ConfigError):  # decided on an intact step, as resume_step does
            return self._restore_intact(from_step, params_target, opt_state_target,
                                        before_read, fallback)  # fmt: skip
        checking = in_background(lambda: self._timed_damage(step), "ckpt-resume-check")
        read: tuple[Any, Any, CheckpointMeta] | None = None
        failure: BaseException | None = None
        try:
            read = self.restore(step, params_target=params_target, opt_state_target=opt_state_target,
                                fallback=fallback, check_first=False)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the checksums' verdict comes first
            failure = e
        damage, verify_s = checking.result()
        if damage is None:
            if failure is not None:
                raise failure
            assert read is not None
            return Resumed(step, *read, verify_s=verify_s)
        del read  # a damaged step's arrays are not the state saved
        if from_step is not None:
            raise self.unreadable(step, damage, fallback=fallback)
        return self._restore_intact(None, params_target, opt_state_target, before_read, fallback)

    def _timed_damage(self, step: int) -> tuple[str | None, float | None]:
        """`damage` of what a resume reads, and the seconds it took (None: nothing to compare)."""
        t0 = time.perf_counter()
        damage = self.damage(step, RESUME_ITEMS)
        found = self._checked.get((step, RESUME_ITEMS))
        return damage, (time.perf_counter() - t0 if found and found.verified else None)

    def _restore_intact(
        self, from_step: int | None, params_target: Any, opt_state_target: Any,
        before_read: Callable[[int], None], fallback: str,
    ) -> Resumed:  # fmt: skip
        """The checked-first way: the step `resume_step` picks, its checksums, then its read."""
        step = self.resume_step(from_step)
        before_read(step)
        read = self.restore(
            step, params_target=params_target, opt_state_target=opt_state_target, fallback=fallback
        )
        return Resumed(step, *read, verify_s=None)

    def read_meta(self, step: int) -> CheckpointMeta | None:
        """The meta item of committed `step`, read alone from its small JSON file, or None when
        it cannot be read: for what a start needs before the restore (which reads it again)."""
        try:
            raw = self.store.read_json(f"{checkpoint_dir(step)}/meta/{_JSON_FILE}")
            return CheckpointMeta.from_json(dict(raw), where=f"{self.directory}/{step}")
        except Exception:  # noqa: BLE001 - a guess only: the restore says what is wrong
            return None

    def damage(self, step: int, items: tuple[str, ...] | None = None) -> str | None:
        """Why the bytes of `step` (of its `items`, default all) are not the ones saved: its
        directory is gone, or a file differs from its checksums. None: intact, or saved before
        checksums (unverified). Every host gets the same answer from the same files."""
        if step in self._gone:
            return f"{self.directory}/{step} is gone"
        if (step, items) not in self._checked:
            # A resume's comparison may have started with the process (run/early_check.py).
            found = None
            if self._early_finding is not None:
                found = self._early_finding(self.store.root_uri, step, items)
            if found is None:
                found = check_step(self.store, step, items)
            self._checked[step, items] = found
        return self._checked[step, items].damage

    def _forget_checks(self, step: int) -> None:
        for key in [k for k in self._checked if k[0] == step]:
            del self._checked[key]

    def resume_step(self, from_step: int | None = None) -> int:
        """The step a resume restores: `from_step` as given (restore refuses it if damaged), else
        the newest intact one. Newer damaged steps are said (one warning line, an event each)
        and discarded, so the run saves those steps anew; every host must call it."""
        if from_step is not None:
            return self.resolve(from_step)
        step = self.resolve("latest")
        damaged: list[tuple[int, str]] = []
        while (cause := self.damage(step, RESUME_ITEMS)) is not None:
            damaged.append((step, cause))
            older = [s for s in self.steps() if s < step]
            if not older:
                raise UnreadableCheckpointError(
                    f"checkpoint {damaged[0][0]} under {self.directory} is damaged "
                    f"({damaged[0][1]}) and no older checkpoint is intact; start over with a "
                    f"new run.id, or run `runtime checkpoints verify {self.store.uri('')}`",
                    step=damaged[0][0],
                    cause=damaged[0][1],
                )
            step = older[-1]
        if damaged:
            newest, cause = damaged[0]
            others = f" (and {', '.join(str(s) for s, _ in damaged[1:])})" if damaged[1:] else ""
            if self.store.is_writer:
                print(
                    f"warning: checkpoint {newest}{others} under {self.directory} is damaged "
                    f"({cause}); resuming from checkpoint {step}, the newest intact one, and "
                    f"discarding {', '.join(str(s) for s, _ in reversed(damaged))}",
                    file=sys.stderr,
                    flush=True,
                )
            self._events([Event(EventKind.CHECKPOINT_DAMAGED,
                                {"step": s, "cause": c, "resume_from": step})
                          for s, c in damaged])  # fmt: skip
            self.discard_after(step)
        return step

    def unreadable(
        self, step: int, cause: BaseException | str, *, fallback: str = "resume"
    ) -> UnreadableCheckpointError:
        """The one sentence for a step that cannot be read: its step, why, and the way back."""
        reason = short_cause(cause)
        older = [s for s in self.steps() if s < step]
        run = self.store.uri("")
        if not older:
            way = (
                "there is no older checkpoint to fall back to, so start over with a new run.id"
                if fallback == "resume"
                else "there is no older checkpoint to read instead"
            )
        elif fallback == "resume":
            way = (
                f"resume from an older one with `runtime local --resume --from-step {older[-1]}` "
                f"(available: {self._available()})"
            )
        elif fallback == "rollback":  # a launched job: the next attempt must start elsewhere
            way = (
                f"roll back to an older one with `runtime checkpoints rollback {run} --to-step "
                f"{older[-1]}` and submit the job again (available: {self._available()})"
            )
        else:
            way = (
                f"read an older one with --checkpoint {older[-1]} (available: {self._available()})"
            )
        return UnreadableCheckpointError(
            f"checkpoint {step} under {self.directory} cannot be read ({reason}); {way}, or run "
            f"`runtime checkpoints verify {run}`",
            step=step,
            cause=reason,
        )

    def mark_unreadable(self, step: int, cause: str) -> None:
        """Record in the index that `step` failed to restore, so `inspect` and `checkpoints
        list` say so instead of calling it a good checkpoint; a later good read clears it."""
        if step in self._entries and self._entries[step].get("unreadable") != cause:
            self._entries[step] = {**self._entries[step], "unreadable": cause}
            self._write_index()

    def mark_readable(self, step: int) -> None:
        if "unreadable" in self._entries.get(step, {}):
            self._entries[step] = {
                k: v for k, v in self._entries[step].items() if k != "unreadable"
            }
            self._write_index()

    def verify(self, step: int) -> dict[str, Any]:
        """Read all of `step` (params, opt_state, meta) into host memory, with targets built from
        the checkpoint's own array metadata, so no config or mesh is needed. Returns
        {"step", "ok", "state" (ok, missing, damaged, unreadable), "verified" (checksums
        matched), "bytes", "cause"}; never raises for a damaged step. Every byte is compared with
        the step's checksums first (read on gs:// too); a step saved before checksums is read
        only (unverified)."""
        if step in self._gone:
            return {"step": step, "ok": False, "state": "missing", "verified": False,
                    "bytes": None, "cause": f"{self.directory}/{step} is gone"}  # fmt: skip
        size = _disk_bytes(self.store, checkpoint_dir(step))
        found = checksums.check(self.store, checkpoint_dir(step), content=True)
        self._checked[step, None] = found
        if found.damage is not None:
            return {"step": step, "ok": False, "state": "damaged", "verified": True,
                    "bytes": size, "cause": found.damage}  # fmt: skip
        verified = {"verified": found.verified}
        _quiet_abandoned_reads()
        try:
            self._entry(step)
            for item in ("params", "opt_state"):
                # One item at a time, dropped at once: the host holds one copy of one item.
                target = _host_target(f"{self.directory}/{step}/{item}")
                if target is None:  # Orbax reads an item's tree from its _METADATA
                    raise _ItemError(f"{item}: its tree metadata ({item}/_METADATA) cannot be read")
                try:
                    got = self._mgr.restore(
                        step, args=ocp.args.Composite(**{item: _array_restore(target)})
                    )
                    bad = _nonfinite_leaf(got[item])  # saves are finite: NaN/inf is damage
                    del got
                except Exception as e:
                    raise _ItemError(f"{item}: {short_cause(e)}") from e
                if bad is not None:
                    raise _ItemError(f"{item}: {bad} holds NaN or infinite values")
            try:
                raw = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
                meta = CheckpointMeta.from_json(dict(raw["meta"]), where=f"{self.directory}/{step}")
            except Exception as e:
                raise _ItemError(f"meta: {short_cause(e)}") from e
            if meta.step != step:
                raise _ItemError(f"meta: it says step {meta.step}")
        except _ItemError as e:
            self._raise_if_fault(step, e.__cause__ or e, "could not be read")
            return {"step": step, "ok": False, "state": "unreadable", **verified, "bytes": size,
                    "cause": str(e)}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any failure to read is the finding
            self._raise_if_fault(step, e, "could not be read")
            return {"step": step, "ok": False, "state": "unreadable", **verified, "bytes": size,
                    "cause": short_cause(e)}  # fmt: skip
        return {"step": step, "ok": True, "state": "ok", **verified, "bytes": size, "cause": None}


def _array_handlers(primary_host: int) -> dict[str, ocp.PyTreeCheckpointHandler]:
    """Orbax's handlers of the array items: `COMPRESS`, and the writer as the primary host."""
    mp = ocp.options.MultiprocessingOptions(primary_host=primary_host)
    return {
        item: ocp.PyTreeCheckpointHandler(use_compression=COMPRESS, multiprocessing_options=mp)
        for item in ARRAY_ITEMS
    }


def _array_restore(target: Any) -> ocp.args.PyTreeRestore:
    """Restore args that read an array item into `target`'s shapes, dtypes and shardings."""
    return ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
    )


def _lower_priority() -> None:
    """Nice this thread (Linux nices threads one by one); elsewhere it keeps its priority."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _nonfinite_leaf(tree: Any) -> str | None:
    """The path of the first floating array of `tree` holding NaN or inf, else None."""
    import jax
    import numpy as np

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.asarray(leaf)
        if jax.numpy.issubdtype(arr.dtype, jax.numpy.floating) and not np.isfinite(arr).all():
            return jax.tree_util.keystr(path)
    return None


class _ItemError(Exception):
    """verify's finding for one item of a step, already one line."""


class UndeletableCheckpointError(CheckpointError):
    """A step that retention (checkpoint.keep) or a discard had to delete could not be deleted
    (no permission): exit 2, the sentence names the step and the cause; every step stays."""


def _link_target(store: ArtifactStore, step: int) -> str | None:
    """Where the local step folder points when it is a symbolic link (gs:// has none). Every
    host of a job sees the same run directory, so all decide alike."""
    if store.remote:
        return None
    path = store._path(checkpoint_dir(step))
    return os.path.realpath(path) if os.path.islink(path) else None


class UnreadableCheckpointError(CheckpointError):
    """A committed checkpoint whose files cannot be restored (truncated, deleted, garbled).

    Exit 2: restarting the same job would read the same bytes again, so a launched job ends
    instead of looping; the sentence names the step and the way back to an older one.
    """

    def __init__(self, message: str, *, step: int, cause: str) -> None:
        super().__init__(message)
        self.step, self.cause = step, cause


def _quiet_abandoned_reads() -> None:
    """When one array fails, Orbax's restore returns and closes its asyncio loop while the
    other tensorstore reads are in flight; each then completes into the closed loop and Python
    prints a RuntimeError traceback as "unraisable", after our one sentence. That noise is not
    the cause: drop exactly it, pass every other unraisable exception on."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxjob_quiet", False):
        return

    def hook(u: Any) -> None:
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        previous(u)

    hook._jaxjob_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _quiet_abandoned_futures() -> None:
    """After a failed restore, the reads Orbax abandoned are garbage-collected later (at exit,
    after our one sentence), and Python warns that their coroutines were never awaited: that
    repeats the cause, so it is dropped once a restore has failed (asyncio's own report of them
    is _QuietOrbaxLeftovers')."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                            category=RuntimeWarning)  # fmt: skip


def short_cause(e: BaseException | str, limit: int = 200) -> str:
    """One line of an Orbax/tensorstore error: its first line, less the tensorstore spec dump."""
    text = e if isinstance(e, str) else (str(e).strip() or type(e).__name__)
    if isinstance(e, KeyError):
        text = f"missing key {text}"
    elif isinstance(e, json.JSONDecodeError):
        text = f"garbled JSON: {text}"
    line = text.splitlines()[0] if text else "unknown error"
    line = line.split(" [tensorstore_spec=")[0].split(" [source locations=")[0]
    line = re.sub(r'Error opening "\w+" driver: ', "", line).strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


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


def _index_doc(entries: dict[int, dict[str, Any]], best: int | None) -> dict[str, Any]:
    return {
        "checkpoints": [entries[s] for s in sorted(entries)],
        "latest": max(entries) if entries else None,
        "best": best,
    }


def _invalidate_epath_cache(uri: str) -> None:
    # etils.epath keeps one gcsfs instance per process whose listings go stale when anything
    # else (our store, another process) changed the bucket; Orbax lists steps through it.
    fs = getattr(epath.Path(uri), "_backend", None)
    if fs is not None and hasattr(fs, "fs"):
        fs.fs(uri).invalidate_cache()


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax logs each failed background save from every thread it ran on, each with a full
    traceback (hundreds of lines for one full disk); the save's error reaches the user once,
    in one sentence, from `_raise_save_error`. Keep Orbax's lines, one line each."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Orbax's own lines start "[process=N]" (its caller frame is not always reported).
        orbax = "orbax" in (record.pathname or "") or str(record.msg).startswith("[process=")
        if record.exc_info and orbax:
            record.msg = " ".join(record.getMessage().split())[:300]
            record.args = None
            record.exc_info = record.exc_text = None
        return True


class _QuietOrbaxLeftovers(logging.Filter):
    """After a failed save or restore, asyncio reports each of Orbax's sibling reads and writes
    that failed too but were never awaited as "exception was never retrieved", with a traceback,
    whenever the garbage collector reaches them (often after our sentence). The failure itself is
    reported once, by us (`_raise_save_error`, `unreadable`, a storage fault): drop these."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in str(record.msg):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and storage_fault(exc) is not None:
            return False
        # A task's repr names its coroutine and where it is defined (one of Orbax's); a plain
        # future's names its exception, a tensorstore error with its spec.
        text = record.getMessage()
        return "/orbax/checkpoint/" not in text and "tensorstore_spec" not in text


logging.getLogger("absl").addFilter(_OneLineOrbaxErrors())
logging.getLogger("asyncio").addFilter(_QuietOrbaxLeftovers())
# A failed save leaves the same abandoned tensorstore callbacks as a failed restore.
_quiet_abandoned_reads()
