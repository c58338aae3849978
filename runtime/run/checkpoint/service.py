"""The checkpoint service: a run's train state saved with Orbax under `<run>/checkpoints` and
restored from it.

Every host calls save/restore (Orbax needs all of them); only the writer writes the index
(index.py), through the store. A save is started in the background and indexed by a later
`poll` once Orbax has committed it and the writer has recorded its checksums; retention
(retention.py) runs at points every host reaches together. A restore refuses a step whose
bytes changed since the save (verify.py), and a resume of the latest step falls back past
damaged ones to the newest intact step, saying so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from jobspec.errors import CheckpointError, ConfigError, StorageError
from runfolder.background import in_background
from runfolder.layout import CHECKPOINTS, EVENTS, Event, EventKind, checkpoint_dir
from runfolder.store import ArtifactStore
from runtime.run import checksums
from runtime.run.checkpoint.errors import (
    UndeletableCheckpointError,
    UnreadableCheckpointError,
    raise_if_fault,
    short_cause,
    warn,
)
from runtime.run.checkpoint.gcs_setup import prepare_storage
from runtime.run.checkpoint.index import CheckpointIndex, committed, finite_metrics
from runtime.run.checkpoint.log_filters import quiet_abandoned_futures, quiet_abandoned_reads
from runtime.run.checkpoint.orbax_manager import (
    JSON_FILE,
    RESUME_ITEMS,
    array_restore,
    open_manager,
)
from runtime.run.checkpoint.retention import Retention
from runtime.run.checkpoint.verify import EarlyFinding, StepChecks, verify_step
from runtime.run.meta import CheckpointMeta


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
        warn_gone: bool = True,
        early_finding: EarlyFinding | None = None,
    ) -> None:
        """`warn_gone=False` leaves saying that listed steps are gone to the caller (verify).
        `early_finding(root_uri, step, items)`: a checksum comparison made before this service
        existed (run/early_check.py `take`), or None; compared here when it gives none."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        prepare_storage(store)
        self.store, self.keep, self.read_only = store, keep, read_only
        self.best_metric = best_metric
        self.directory = store.uri(CHECKPOINTS)
        self._mgr = open_manager(store, async_save=async_save, read_only=read_only)
        self._async = async_save
        self._pending: _Pending | None = None
        self.waited_s = 0.0  # how long the latest `save` waited for the one before it
        # Told (step, seconds from the save's start) when a save is indexed: the train loop's
        # record of how long the storage took to write it.
        self.on_written: Callable[[int, float], None] | None = None
        # Reading back and hashing a multi-GB step takes a core for seconds: at low priority,
        # so the threads that feed the steps come first.
        self._summer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckpt-checksums", initializer=_lower_priority
        )
        self._failed_step: int | None = None  # the step whose save failed, if one did
        self.index = CheckpointIndex(
            store, best_metric=best_metric, read_only=read_only, say_gone=warn_gone
        )
        self._checks = StepChecks(store, self.index, early_finding)
        self._retention = Retention(store, self._mgr, self.index, self._checks, keep)

    def _events(self, events: list[Event]) -> None:
        if self.store.is_writer and not self.read_only:
            self.store.append_jsonl(EVENTS, [e.to_json() for e in events])

    def gone(self) -> list[int]:
        """Steps the index listed whose committed directory is gone."""
        return list(self.index.gone)

    # ---- index (index.py) --------------------------------------------------------------------

    def _committed(self, step: int) -> bool:
        return committed(self.store, step)

    def read_index(self) -> dict[str, Any]:
        return self.index.doc()

    def steps(self) -> list[int]:
        return self.index.steps()

    def latest(self) -> int | None:
        return self.index.latest()

    def best(self) -> int | None:
        return self.index.best()

    def fingerprint(self, step: int) -> dict[str, Any]:
        return dict(self.index.entry(step).get("fingerprint") or {})

    def resolve(self, selector: str | int) -> int:
        """'latest', 'best' or a step number -> a committed step, or CheckpointError."""
        return self.index.resolve(selector)

    # ---- save --------------------------------------------------------------------------------

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
        """Start saving `step` (in the background if async); every host must call it. Which
        steps are saved is the caller's (runtime/train/cadence.py).

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
            self._retention.retain()
        except UndeletableCheckpointError as e:
            refused = e
        # The part of this call spent on the previous save (its write, checksums and retention).
        self.waited_s = time.perf_counter() - t0
        if step in self.index.entries:
            if not force:
                return False
            self._retention.delete([step])
        latest = self.latest()
        if latest is not None and step < latest:
            raise CheckpointError(
                f"cannot save step {step} under {self.directory}: checkpoint {latest} is newer; "
                f"a run resumed from an older step must discard the later ones first"
            )
        entry = {
            "step": step,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "metrics": finite_metrics(metrics),
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
        steps = [*self.index.entries, *([self._pending.step] if self._pending else [])]
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
        entries = self.index.entries
        found = self._pending.entry if self._pending and self._pending.step == step else None
        if found is None and step in entries:
            found = entries[step] = dict(entries[step])
        if found is None or self.read_only:
            return
        found["metrics"] = {**(found.get("metrics") or {}), **finite_metrics(metrics)}
        if step in entries:
            self.index.write()

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
        self.index.entries[pending.step] = pending.entry
        self._checks.forget(pending.step)
        self.index.write()
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

    def _raise_save_error(self, step: int | None, e: Exception, what: str) -> None:
        """Say why a save failed in one sentence: a storage fault (ENOSPC, EIO, gs:// 5xx or
        timeouts) ends the job restartable; anything else is a checkpoint error. The step is
        remembered: Orbax re-raises the same background error on every later wait."""
        self._failed_step = step
        name = "?" if step is None else step
        raise_if_fault(self.directory, name, e, what)
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
        self._retention.retain()

    def discard_after(self, step: int) -> list[int]:
        """Delete checkpoints newer than `step` (a run resumed from an older step branches off
        there); every host must call it. Returns the deleted steps."""
        self._wait_orbax()
        self.poll(block=True)
        newer = [s for s in self.steps() if s > step]
        self._retention.delete(newer)
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
            if self._retention.undeletable:
                self._wait_orbax()
                self.poll(block=True)
            else:
                self.wait()
        except Exception as e:
            if not (after_failure or self._failed_step is not None):
                with contextlib.suppress(Exception):
                    self._mgr.close()  # released either way; the save's error is the one raised
                raise
            warn(f"closing checkpoints under {self.directory} after a failure: {e}")
        self._summer.shutdown(wait=False, cancel_futures=True)
        try:
            self._mgr.close()
        except Exception as e:
            if not (after_failure or self._failed_step is not None):
                raise
            warn(f"closing checkpoints under {self.directory} after a failure: {e}")

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
        self.index.entry(step)
        read = RESUME_ITEMS if opt_state_target is not None else ("params", "meta")
        if check_first and (damage := self.damage(step, read)) is not None:
            raise self.unreadable(step, damage, fallback=fallback)
        quiet_abandoned_reads()  # before: a failed read's siblings may complete at any time
        items: dict[str, Any] = {
            "params": array_restore(params_target),
            "meta": ocp.args.JsonRestore(),
        }
        if opt_state_target is not None:
            items["opt_state"] = array_restore(opt_state_target)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
            meta = CheckpointMeta.from_json(dict(out["meta"]), where=f"{self.directory}/{step}")
        except Exception as e:  # noqa: BLE001 - Orbax/tensorstore/jax/json raise anything here
            # The storage failing under the read (a 503, a timeout, EIO) is no verdict on the
            # checkpoint: restartable, and the step is not marked unreadable.
            raise_if_fault(self.directory, step, e, "could not be read")
            quiet_abandoned_futures()
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
        found = self._checks.found.get((step, RESUME_ITEMS))
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
            raw = self.store.read_json(f"{checkpoint_dir(step)}/meta/{JSON_FILE}")
            return CheckpointMeta.from_json(dict(raw), where=f"{self.directory}/{step}")
        except Exception:  # noqa: BLE001 - a guess only: the restore says what is wrong
            return None

    def damage(self, step: int, items: tuple[str, ...] | None = None) -> str | None:
        """Why the bytes of `step` (of its `items`, default all) are not the ones saved
        (verify.py `StepChecks.damage`); None: intact, or saved before checksums."""
        return self._checks.damage(step, items)

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
                warn(
                    f"checkpoint {newest}{others} under {self.directory} is damaged "
                    f"({cause}); resuming from checkpoint {step}, the newest intact one, and "
                    f"discarding {', '.join(str(s) for s, _ in reversed(damaged))}"
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
        available = self.index.available()
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
                f"(available: {available})"
            )
        elif fallback == "rollback":  # a launched job: the next attempt must start elsewhere
            way = (
                f"roll back to an older one with `runtime checkpoints rollback {run} --to-step "
                f"{older[-1]}` and submit the job again (available: {available})"
            )
        else:
            way = f"read an older one with --checkpoint {older[-1]} (available: {available})"
        return UnreadableCheckpointError(
            f"checkpoint {step} under {self.directory} cannot be read ({reason}); {way}, or run "
            f"`runtime checkpoints verify {run}`",
            step=step,
            cause=reason,
        )

    def mark_unreadable(self, step: int, cause: str) -> None:
        """Record in the index that `step` failed to restore, so `inspect` and `checkpoints
        list` say so instead of calling it a good checkpoint; a later good read clears it."""
        self.index.mark_unreadable(step, cause)

    def mark_readable(self, step: int) -> None:
        self.index.mark_readable(step)

    def verify(self, step: int) -> dict[str, Any]:
        """`runtime checkpoints verify` of one step: its checksums, then a full read into host
        memory (verify.py `verify_step`); never raises for a damaged step."""
        return verify_step(self._mgr, self.index, self._checks, step)


def _lower_priority() -> None:
    """Nice this thread (Linux nices threads one by one); elsewhere it keeps its priority."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
