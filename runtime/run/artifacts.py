"""What a run writes besides checkpoints: manifest, config copies, diagnostics, metrics, events,
summaries. The manifest, events and summaries are built here; train and eval rows come built
(runtime/train); everything goes to the ArtifactStore, the only writer of files, at the paths
runfolder.layout names.

Host-global files are written by the writer host only; the others build nothing to write.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import traceback
from typing import Any, Protocol

import jax
import numpy as np

from jobspec.errors import DivergedError
from jobspec.files.run_toml import resolved_dict
from jobspec.hardware.peaks import peak_bf16_flops
from jobspec.run_config import RunConfig
from runfolder import goodput
from runfolder.evals import eval_summary
from runfolder.layout import (
    DIAGNOSTICS,
    EVAL_METRICS,
    EVENTS,
    HOST_DIAGNOSTICS,
    MANIFEST,
    RESOLVED_CONFIG,
    SOURCE_CONFIG,
    SUMMARY,
    TRAIN_METRICS,
    EvalRow,
    Event,
    EventKind,
    TrainRow,
    now,
)
from runfolder.store import ArtifactStore
from runtime.host import boot
from runtime.model.flops import flops_per_token, parameter_counts
from runtime.model.moe import dispatch as moe_dispatch
from runtime.run import disk_reserve
from runtime.run.meta import run_manifest

PACKAGES = (
    "jaxjob",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "numpy",
    "fsspec",
    "gcsfs",
)
# The events that record a step an attempt reached (a resumed attempt recomputes up to it).
_REACHED = (EventKind.LEDGER, EventKind.INTERRUPTED, EventKind.FAILURE, EventKind.FINISH)


class Ledger(Protocol):
    """The attempt's time ledger (runtime/observe/ledger.py, above this package): its snapshots
    become `ledger` events."""

    redo_until: int  # steps up to here were reached by an earlier attempt

    def record_due(self) -> bool: ...

    def snapshot(self) -> dict[str, Any]: ...


class RowSinks(Protocol):
    """Where rows go once written (runtime/observe/sinks.py, above this package)."""

    def train_rows(self, rows: list[dict[str, Any]]) -> None: ...

    def eval_row(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_peak(devices: list) -> tuple[str | None, float | None]:
    """Per-chip peak for the job's device kind, or (None, None): no MFU rather than a guess."""
    kinds = {d.device_kind for d in devices}
    if len(kinds) != 1 or devices[0].platform == "cpu":
        return None, None
    found = peak_bf16_flops(kinds.pop())
    return (found[0], found[1]) if found else (None, None)


def sharding_summary(param_shardings) -> dict[str, Any]:
    """Each parameter's mesh PartitionSpec, by its path (a compact string per parameter)."""
    flat = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    return {jax.tree_util.keystr(path): str(sh.spec) for path, sh in flat}


def runtime_diagnostics(cfg: RunConfig, mesh, manifest, batches, param_shardings) -> dict[str, Any]:
    devices = jax.devices()
    name, peak = device_peak(devices)
    info = boot.current()
    return {
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "boot": info.as_dict() if info else {"mode": "single-process"},
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "global_device_count": len(devices),
        "device_kind": devices[0].device_kind,
        "accelerator": name,
        "peak_bf16_flops_per_chip": peak,
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        # Which MoE dispatch the step runs (dense, or sparse with its exchange and matmul).
        "moe_dispatch": moe_dispatch.describe(cfg.model, mesh),
        "param_shardings": sharding_summary(param_shardings),
        "model": {
            "parameters": parameter_counts(cfg.model),
            "flops_per_token": flops_per_token(cfg.model, cfg.training.seq_len),
        },
        "data": {
            "manifest": cfg.data.manifest,
            "tokenizer": manifest.tokenizer.id,
            "train_tokens": manifest.split("train").tokens,
            "validation_tokens": manifest.split("validation").tokens,
            "pipeline": batches.describe(),
        },
        "python": platform.python_version(),
        "packages": package_versions(),
    }


class RunArtifacts:
    """A training run's records: builds the manifest, events and summaries, takes the rows
    `runtime/train` builds, and writes them through the store on the writer host only."""

    def __init__(
        self,
        store: ArtifactStore,
        cfg: RunConfig,
        source_toml: str,
        ledger: Ledger,
        sinks: RowSinks,
    ):
        self.store, self.cfg, self.source_toml = store, cfg, source_toml
        self.ledger, self.sinks = ledger, sinks
        self._manifest: dict[str, Any] = {}
        self.last_row: TrainRow | None = None  # the newest train row (on every host)

    @property
    def writer(self) -> bool:
        return self.store.is_writer

    def event(self, kind: EventKind, **fields: Any) -> None:
        if self.writer:
            self.store.append_jsonl(EVENTS, [Event(kind, fields).to_json()])

    def _write_manifest(self, **update: Any) -> None:
        self._manifest.update(update, updated=now())
        self.store.write_json(MANIFEST, self._manifest)

    def start(self, *, resume: bool, start_step: int, total_steps: int, diagnostics: dict) -> None:
        # Every host records how it booted and what it sees; host-global files are the writer's.
        self.store.write_host_json(HOST_DIAGNOSTICS, {"time": now(), **diagnostics})
        if not self.writer:
            return
        disk_reserve.keep(self.store)  # room for the record of how this attempt ends
        # Steps an earlier attempt reached past this start are recomputed, not progress: the
        # furthest row it logged (read before the cut below) or step it recorded in an event.
        logged = self._last_logged_step()
        # Rows past the starting step are recomputed by this attempt (all of them for a fresh
        # start over a failed attempt that left no checkpoint); drop the stale copies.
        for rel in (TRAIN_METRICS, EVAL_METRICS):
            if self.store.exists(rel):
                self.store.truncate_jsonl_after(rel, "step", start_step)
        if resume and self.store.exists(MANIFEST):
            self._manifest = self.store.read_json(MANIFEST)
            for stale in ("failure", "diverged_at_step"):  # an earlier attempt's end
                self._manifest.pop(stale, None)
        self.store.write_text(SOURCE_CONFIG, self.source_toml)
        self.store.write_json(RESOLVED_CONFIG, resolved_dict(self.cfg))
        self.store.write_json(DIAGNOSTICS, diagnostics)
        self._manifest.setdefault("created", now())
        version = package_versions()["jaxjob"]
        self._write_manifest(
            **run_manifest(self.cfg, self.store.uri(""), status="running", version=version)
        )
        kind = EventKind.RESUME if resume else EventKind.START
        self.event(kind, step=start_step, total_steps=total_steps)
        # After that append, which repairs a torn last line (and says so once).
        self.ledger.redo_until = max(start_step, logged, self._recorded_step())

    def _last_logged_step(self) -> int:
        """The last step in train.jsonl (rows are appended in step order; read from the end)."""
        last = (
            self.store.last_jsonl_row(TRAIN_METRICS) if self.store.exists(TRAIN_METRICS) else None
        )
        return int(last.get("step", 0)) if last else 0

    def _recorded_step(self) -> int:
        """The furthest step earlier attempts' events recorded (0 for a fresh run)."""
        reached = 0
        for e in self.store.read_jsonl(EVENTS):
            if e.get("event") in _REACHED:
                for key in ("step", "last_step"):
                    if isinstance(e.get(key), int):
                        reached = max(reached, e[key])
        return reached

    def record_time(self, *, force: bool = False) -> None:
        """A snapshot of the time ledger as a `ledger` event (goodput is computed from them);
        unless forced, at most every RECORD_EVERY_S."""
        if self.writer and (force or self.ledger.record_due()):
            self.event(EventKind.LEDGER, **self.ledger.snapshot())

    def train_rows(self, rows: list[TrainRow]) -> None:
        """Write train rows (the writer, also to the sinks); every host keeps the last."""
        if self.writer:
            written = [r.to_json() for r in rows]
            self.store.append_jsonl(TRAIN_METRICS, written)  # non-finite values are written null
            self.sinks.train_rows(written)
        self.last_row = rows[-1]

    def eval_row(self, row: EvalRow) -> None:
        if self.writer:
            written = row.to_json()
            self.store.append_jsonl(EVAL_METRICS, [written])
            self.sinks.eval_row(written)

    def _final_loss(self) -> float | None:
        return float(self.last_row.values["loss"]) if self.last_row else None

    def finish(self, status: str, step: int, index: dict, wall_s: float, **extra) -> dict:
        summary = {
            "run_id": self.cfg.run.id,
            "status": status,
            "steps": step,
            "tokens": step * self.cfg.training.tokens_per_step,
            "final_loss": self._final_loss(),
            "wall_time_s": wall_s,
            "checkpoints": {"latest": index.get("latest"), "best": index.get("best")},
            **extra,
        }
        if self.writer:
            disk_reserve.release(self.store)  # the last records fit on a disk that filled up
            evals = self.store.read_jsonl(EVAL_METRICS) if self.store.exists(EVAL_METRICS) else []
            if best := eval_summary(evals)["best"]:  # as inspect and `launch status` say it
                summary["best_eval"] = best
            rows = self.store.read_jsonl(TRAIN_METRICS) if self.store.exists(TRAIN_METRICS) else []
            timed = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
            if timed:
                summary["tokens_per_s_median"] = float(np.median(timed))
            self.sinks.close()  # W&B's own finish is part of this attempt's time
            # The time first, so the run's last event stays the one that says how it ended.
            self.record_time(force=True)
            kind = EventKind.INTERRUPTED if status == "interrupted" else EventKind.FINISH
            self.event(kind, step=step, **extra)
            summary["goodput"] = goodput.account(self.store.read_jsonl(EVENTS))
            self.store.write_json(SUMMARY, summary)
            self._write_manifest(status=status, steps=step, tokens=summary["tokens"])
        return summary

    def fail(self, step: int, err: BaseException, index: dict | None = None) -> None:
        """Record how the attempt ended: a `failure` event, and the manifest's status `failed`
        with the sentence, or `diverged` (DivergedError) with the step, which also writes
        summaries/final.json so no earlier attempt's summary still says how the run ended.

        Each record is tried on its own (the original error matters more than a failed report
        of it), on the room the disk reserve leaves: on a full disk the manifest still gets
        written, and where even it does not fit, the failure event newer than the `running`
        manifest is what readers go by (runfolder.outcome)."""
        if not self.writer:
            return
        disk_reserve.release(self.store)
        msg = str(err) or type(err).__name__
        diverged_at = err.step if isinstance(err, DivergedError) else None
        with contextlib.suppress(Exception):
            self.record_time(force=True)
        with contextlib.suppress(Exception):
            self.event(
                EventKind.FAILURE,
                step=step,
                error=msg,
                type=type(err).__name__,
                exit_code=getattr(err, "exit_code", None),
                traceback=traceback.format_exception(err)[-3:],
                **({"diverged_at_step": diverged_at} if diverged_at is not None else {}),
            )
        update: dict[str, Any] = {"status": "failed", "steps": step, "failure": msg}
        if diverged_at is not None:
            update.update(status="diverged", diverged_at_step=diverged_at)
            index = index or {}
            with contextlib.suppress(Exception):
                self.store.write_json(SUMMARY, {
                    "run_id": self.cfg.run.id,
                    "status": "diverged",
                    "steps": step,
                    "tokens": step * self.cfg.training.tokens_per_step,
                    "diverged_at_step": diverged_at,
                    "final_loss": self._final_loss(),
                    "failure": msg,
                    "checkpoints": {"latest": index.get("latest"), "best": index.get("best")},
                    "goodput": goodput.account(self.store.read_jsonl(EVENTS)),
                })  # fmt: skip
        with contextlib.suppress(Exception):
            self._write_manifest(**update)
        with contextlib.suppress(Exception):
            self.sinks.close()


def record_unreadable_checkpoint(store: ArtifactStore, step: int, cause: str, failure: str) -> None:
    """A resume that cannot read `step` ends the attempt before the artifacts are opened: the
    events say why, and the manifest no longer says completed or running (the writer only)."""
    if not store.is_writer:
        return
    event = Event(EventKind.CHECKPOINT_UNREADABLE, {"step": step, "error": cause})
    store.append_jsonl(EVENTS, [event.to_json()])
    if store.exists(MANIFEST):
        manifest = store.read_json(MANIFEST)
        manifest.update(status="failed", failure=failure, updated=now())
        store.write_json(MANIFEST, manifest)


def record_discarded_checkpoints(store: ArtifactStore, steps: list[int], resume_from: int) -> None:
    """--from-step (or a rollback) discarded `steps`: an event says so (the writer only)."""
    if steps and store.is_writer:
        event = Event(EventKind.CHECKPOINTS_DISCARDED, {"steps": steps, "resume_from": resume_from})
        store.append_jsonl(EVENTS, [event.to_json()])
