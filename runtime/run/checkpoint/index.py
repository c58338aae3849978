"""`checkpoints/index.json`, the index of a run's saved steps: which are committed, latest and
best, each entry's metrics and fingerprint.

It is the source of truth for resume, eval and sample. A step enters it only once Orbax has
committed it (locally the final `<step>/` directory exists; on gs:// the step holds
`commit_success.txt`), so a crash mid-save never becomes `latest`; only the writer writes it,
through the store. The committed step folders are what the index is rebuilt from when it is
missing or damaged (a damaged one is kept beside it, `index.json.corrupt-<time>`), and a listed
step whose directory is gone is said once and dropped. Nothing here touches Orbax.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from typing import Any

from jobspec.errors import CheckpointError, StorageError
from runfolder.layout import CHECKPOINT_INDEX, CHECKPOINTS, EVENTS, Event, EventKind, checkpoint_dir
from runfolder.store import ArtifactStore
from runtime.run.checkpoint.errors import warn

COMMIT_FILE = "commit_success.txt"  # Orbax's commit marker for object stores


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
        warn(
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
    warn(
        f"{store.uri(CHECKPOINT_INDEX)} was damaged ({fault}); rebuilt it from the committed "
        f"checkpoints under {store.uri(CHECKPOINTS)} ({_steps_text(rebuilt)}) and kept the "
        f"damaged file as {store.uri(kept)}"
    )


def _written_index(store: ArtifactStore) -> tuple[dict[str, Any], str | None]:
    """(index.json as written, None), or (an empty index, what is wrong with it) when it is
    damaged. Absent is not damaged: a run before its first commit has none."""
    if not store.exists(CHECKPOINT_INDEX):
        return index_doc({}, None), None
    try:
        doc = json.loads(store.read_bytes(CHECKPOINT_INDEX))
    except ValueError as e:  # JSONDecodeError, or bytes that are not text at all
        return index_doc({}, None), f"not valid JSON: {e}"
    fault = _index_fault(doc)
    return (doc, None) if fault is None else (index_doc({}, None), fault)


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
    entries = reconciled_entries(store, index_doc({}, None))
    return index_doc(entries, best_step(entries, best_metric))


def _steps_text(index: dict[str, Any]) -> str:
    steps = [str(e["step"]) for e in index["checkpoints"]]
    return f"steps {', '.join(steps)}" if steps else "none is committed"


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def finite_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
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


def best_step(entries: dict[int, dict[str, Any]], metric: str) -> int | None:
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


def committed(store: ArtifactStore, step: int) -> bool:
    """Whether Orbax has committed `step` (its commit file on gs://, its final folder locally)."""
    rel = checkpoint_dir(step)
    if store.remote:
        return store.exists(f"{rel}/{COMMIT_FILE}")
    return store.isdir(rel)  # the atomic rename from the tmp dir is the commit


def _read_entry(store: ArtifactStore, step: int) -> dict[str, Any] | None:
    rel = f"{checkpoint_dir(step)}/entry/metadata"  # JsonSave's file inside the `entry` item
    try:
        entry = store.read_json(rel)
    except StorageError:
        warn(f"checkpoint {store.uri(rel)} has no readable entry; leaving it unindexed")
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
        int(n) for n in store.listdir(CHECKPOINTS) if n.isdigit() and committed(store, int(n))
    }
    entries = {s: e for s, e in listed.items() if s in on_disk}
    for step in sorted(on_disk - listed.keys()):
        entry = _read_entry(store, step)
        if entry is not None:
            entries[step] = entry
    return entries


def index_doc(entries: dict[int, dict[str, Any]], best: int | None) -> dict[str, Any]:
    """index.json's document of `entries` (by step) with `best`."""
    return {
        "checkpoints": [entries[s] for s in sorted(entries)],
        "latest": max(entries) if entries else None,
        "best": best,
    }


class CheckpointIndex:
    """The committed steps of one run's checkpoints as this process knows them (`entries`, by
    step), and the index.json the writer keeps of them (unless `read_only`)."""

    def __init__(
        self, store: ArtifactStore, *, best_metric: str, read_only: bool, say_gone: bool
    ) -> None:
        """Read the index as disk has it. A damaged index is rebuilt on disk by a service that
        may write, in memory (and said, naming the command that rebuilds it) by a read-only
        one; listed steps that are gone are said (`say_gone`) and the index rewritten."""
        self.store, self.best_metric, self.read_only = store, best_metric, read_only
        self.directory = store.uri(CHECKPOINTS)
        if not read_only:
            repair_index(store, best_metric)
        written = load_index(store, say=read_only)
        self.entries = reconciled_entries(store, written)
        # Listed steps whose committed directory is gone (deleted, lost with a disk).
        self.gone = sorted({int(e["step"]) for e in written["checkpoints"]} - self.entries.keys())
        if self.gone and say_gone:
            self._say_gone()
        if self.doc() != written:
            self.write()

    def _say_gone(self) -> None:
        """One line (and, on a run this index may write, an event per step) for listed steps
        whose directory is gone: the index forgets them, never in silence."""
        if not self.store.is_writer:
            return
        d = self.directory
        what = (
            f"checkpoint {self.gone[0]} is listed in {self.store.uri(CHECKPOINT_INDEX)} but {d}/"
            f"{self.gone[0]} is gone"
            if len(self.gone) == 1
            else f"checkpoints {', '.join(map(str, self.gone))} are listed in "
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
            events = [Event(EventKind.CHECKPOINT_MISSING, {"step": s, "directory": f"{d}/{s}"})
                      for s in self.gone]  # fmt: skip
            self.store.append_jsonl(EVENTS, [e.to_json() for e in events])

    def doc(self) -> dict[str, Any]:
        """The index document of the committed steps."""
        return index_doc(self.entries, self.best())

    def write(self) -> None:
        """index.json rewritten from `entries` (the writer's job; never when read-only)."""
        if self.store.is_writer and not self.read_only:
            self.store.write_json(CHECKPOINT_INDEX, self.doc())

    def steps(self) -> list[int]:
        return sorted(self.entries)

    def latest(self) -> int | None:
        return max(self.entries) if self.entries else None

    def best(self) -> int | None:
        return best_step(self.entries, self.best_metric)

    def entry(self, step: int) -> dict[str, Any]:
        """`step`'s entry, or CheckpointError naming the committed steps."""
        if step not in self.entries:
            raise CheckpointError(
                f"step {step} is not a committed checkpoint under {self.directory}; "
                f"available steps: {self.available()}"
            )
        return self.entries[step]

    def available(self) -> str:
        """The committed steps, in words."""
        return ", ".join(map(str, self.steps())) or "none"

    def resolve(self, selector: str | int) -> int:
        """'latest', 'best' or a step number -> a committed step, or CheckpointError."""
        if not self.entries:
            raise CheckpointError(
                f"no checkpoint under {self.directory}; run without --resume first"
            )
        if selector == "latest":
            return max(self.entries)
        if selector == "best":
            best = self.best()
            assert best is not None  # there are entries, so there is a best
            return best
        if isinstance(selector, int) or (isinstance(selector, str) and selector.isdigit()):
            step = int(selector)
            self.entry(step)
            return step
        raise CheckpointError(
            f"checkpoint selector {selector!r} is not 'latest', 'best' or a step number"
        )

    def mark_unreadable(self, step: int, cause: str) -> None:
        """Record that `step` failed to restore (a later good read clears it)."""
        if step in self.entries and self.entries[step].get("unreadable") != cause:
            self.entries[step] = {**self.entries[step], "unreadable": cause}
            self.write()

    def mark_readable(self, step: int) -> None:
        """Clear `step`'s unreadable mark, if it has one."""
        if "unreadable" in self.entries.get(step, {}):
            self.entries[step] = {k: v for k, v in self.entries[step].items() if k != "unreadable"}
            self.write()
