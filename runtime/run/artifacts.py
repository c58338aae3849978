"""What a run writes besides checkpoints: manifest, config copies, diagnostics, metrics, events,
summaries. Records are built here and handed to the ArtifactStore, the only writer of files.

Host-global files are written by the writer host only; the others build nothing to write.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import math
import platform
import traceback
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jobspec import goodput
from jobspec.accelerators import peak_bf16_flops
from jobspec.errors import DivergedError
from jobspec.evals import eval_summary
from jobspec.load import resolved_dict
from jobspec.run_config import RunConfig
from jobspec.run_store import ArtifactStore
from runtime.host import boot
from runtime.model import moe_dispatch
from runtime.model.flops import flops_per_token, parameter_counts
from runtime.run import disk_reserve
from runtime.run.meta import run_manifest
from runtime.train.metrics import Throughput, live_line

if TYPE_CHECKING:  # the loop hands them in: runtime/observe sits above runtime/run
    from runtime.observe.ledger import TimeLedger
    from runtime.observe.sinks import MetricSinks

TRAIN_METRICS = "metrics/train.jsonl"
EVAL_METRICS = "metrics/eval.jsonl"
EVENTS = "events.jsonl"
# A step with any of these not finite diverged (training.on_nonfinite).
NONFINITE_KEYS = ("loss", "grad_norm", "param_norm")
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


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


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


def _scalar(x: Any) -> float:
    return float(np.asarray(x))


class RunArtifacts:
    """Builds the run's records; writes them through the store on the writer host only."""

    def __init__(
        self,
        store: ArtifactStore,
        cfg: RunConfig,
        source_toml: str,
        ledger: TimeLedger,
        sinks: MetricSinks,
    ):
        self.store, self.cfg, self.source_toml = store, cfg, source_toml
        self.ledger, self.sinks = ledger, sinks
        fpt = flops_per_token(cfg.model, cfg.training.seq_len)
        self.flops_per_token = float(fpt["total"])
        self.accelerator, chip_peak = device_peak(jax.devices())
        self.job_peak_flops = chip_peak * len(jax.devices()) if chip_peak else None
        self._manifest: dict[str, Any] = {}
        t = cfg.training
        # Steady-state throughput: the loop marks the clock after compilation, evals and saves.
        self.meter = Throughput(t.tokens_per_step, self.flops_per_token, self.job_peak_flops)
        self._pending: list[tuple[int, Any, dict]] = []  # steps since the last host sync
        self.last_row: dict | None = None  # the newest row written
        # training.on_nonfinite: steps skipped so far (the checkpoint carries the count across
        # attempts), and the first step that ends the run ({step, loss, grad_norm, param_norm}).
        self.skipped_steps = 0
        self.nonfinite: dict[str, Any] | None = None

    @property
    def writer(self) -> bool:
        return self.store.is_writer

    def event(self, kind: str, **fields: Any) -> None:
        if self.writer:
            self.store.append_jsonl(EVENTS, [{"time": now(), "event": kind, **fields}])

    def _write_manifest(self, **update: Any) -> None:
        self._manifest.update(update, updated=now())
        self.store.write_json("manifest.json", self._manifest)

    def start(self, *, resume: bool, start_step: int, total_steps: int, diagnostics: dict) -> None:
        # Every host records how it booted and what it sees; host-global files are the writer's.
        self.store.write_host_json("runtime.json", {"time": now(), **diagnostics})
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
        if resume and self.store.exists("manifest.json"):
            self._manifest = self.store.read_json("manifest.json")
            for stale in ("failure", "diverged_at_step"):  # an earlier attempt's end
                self._manifest.pop(stale, None)
        self.store.write_text("config/source.toml", self.source_toml)
        self.store.write_json("config/resolved.json", resolved_dict(self.cfg))
        self.store.write_json("diagnostics/runtime.json", diagnostics)
        self._manifest.setdefault("created", now())
        version = package_versions()["jaxjob"]
        self._write_manifest(
            **run_manifest(self.cfg, self.store.uri(""), status="running", version=version)
        )
        self.event("resume" if resume else "start", step=start_step, total_steps=total_steps)
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
            if e.get("event") in ("ledger", "interrupted", "failure", "finish"):
                for key in ("step", "last_step"):
                    if isinstance(e.get(key), int):
                        reached = max(reached, e[key])
        return reached

    def record_time(self, *, force: bool = False) -> None:
        """A snapshot of the time ledger as a `ledger` event (goodput is computed from them);
        unless forced, at most every RECORD_EVERY_S."""
        if self.writer and (force or self.ledger.record_due()):
            self.event("ledger", **self.ledger.snapshot())

    def step_done(
        self, step: int, metrics: Any, provenance: dict, emit, *, sync: bool, timed: bool = True
    ) -> None:
        """Record a finished step; rows are fetched and written every `training.log_every`
        steps, and at `sync` (before an eval, a save, a profile or the end), so the host rarely
        waits. `timed=False` (profiled steps) writes the rows without throughput figures.

        The fetched rows are where finiteness is read (no sync of its own): a step whose loss,
        grad_norm or param_norm is NaN/inf, or a skip past training.max_skipped_steps, sets
        `nonfinite`, which the loop turns into DivergedError before any eval or save."""
        self._pending.append((step, metrics, provenance))
        if step % self.cfg.training.log_every == 0 or sync:
            pending, self._pending = self._pending, []
            self.last_row = self._flush(pending, emit, timed) or self.last_row

    def _flush(self, pending: list, emit, timed: bool = True) -> dict | None:
        """Fetch the metrics of the steps since the last sync (one device_get: the sync point),
        then time the interval, write the rows and print the live line for the last one.
        Timing fields (and the ETA they give) go on the last row of the interval."""
        if not pending:
            return None
        fetched = jax.device_get([m for _, m, _ in pending])
        timing = self.meter.interval(pending[-1][0]) if timed else None
        if timing:
            remaining = self.cfg.training.total_steps - pending[-1][0]
            timing["eta_s"] = remaining * timing["step_time"]
        rows = []
        tps = self.cfg.training.tokens_per_step
        mode = self.cfg.artifacts.provenance
        for (step, _, prov), m in zip(pending, fetched, strict=True):
            row = {"step": step, "tokens": step * tps}
            row.update({k: _scalar(v) for k, v in m.items()})
            row["batch_hash"] = prov["batch_hash"]
            if "tokens_per_source" in prov:  # a mixture: what each source fed this step
                row["tokens_per_source"] = prov["tokens_per_source"]
            if mode == "ids":
                row["record_ids"] = prov["record_ids"]
                if "sources" in prov:  # a mixture's record ids are each source's own
                    row["sources"] = prov["sources"]
            rows.append(row)
        if timing:
            rows[-1].update(timing)
        skipped = [row for row in rows if self._check_finite(row)]
        if self.writer:
            self.store.append_jsonl(TRAIN_METRICS, rows)  # non-finite values are written null
            self.sinks.train_rows(rows)
        limit = self.cfg.training.max_skipped_steps
        for row in skipped:
            self.event("step_skipped", **{k: row.get(k) for k in ("step", *NONFINITE_KEYS)},
                       skipped_steps=row["skipped_steps"])  # fmt: skip
            emit(
                f"warning: step {row['step']} skipped ({_nonfinite_text(row)}): parameters and "
                f"optimizer state kept; {row['skipped_steps']} of "
                f"training.max_skipped_steps = {limit} skips used"
            )
        emit(live_line(rows[-1]))
        return rows[-1]

    def _check_finite(self, row: dict) -> bool:
        """Note whether the step `row` diverged; True when it was skipped (skip_step)."""
        if "skipped" in row:  # skip_step: the step itself kept its state on device
            row["skipped"] = skipped = bool(row["skipped"])
            self.skipped_steps += skipped
            row["skipped_steps"] = self.skipped_steps
            limit = self.cfg.training.max_skipped_steps
            if skipped and self.skipped_steps > limit and self.nonfinite is None:
                self.nonfinite = {"step": row["step"], **{k: row.get(k) for k in NONFINITE_KEYS},
                                  "skipped_steps": self.skipped_steps}  # fmt: skip
            return skipped
        if self.nonfinite is None and _nonfinite_of(row):
            self.nonfinite = {"step": row["step"], **{k: row.get(k) for k in NONFINITE_KEYS}}
        return False

    def eval_row(self, row: dict) -> None:
        if self.writer:
            self.store.append_jsonl(EVAL_METRICS, [row])
            self.sinks.eval_row(row)

    def finish(self, status: str, step: int, index: dict, wall_s: float, **extra) -> dict:
        last_row = self.last_row
        summary = {
            "run_id": self.cfg.run.id,
            "status": status,
            "steps": step,
            "tokens": step * self.cfg.training.tokens_per_step,
            "final_loss": last_row["loss"] if last_row else None,
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
            self.event("interrupted" if status == "interrupted" else "finish", step=step, **extra)
            summary["goodput"] = goodput.account(self.store.read_jsonl(EVENTS))
            self.store.write_json("summaries/final.json", summary)
            self._write_manifest(status=status, steps=step, tokens=summary["tokens"])
        return summary

    def fail(self, step: int, err: BaseException, index: dict | None = None) -> None:
        """Record how the attempt ended: a `failure` event, and the manifest's status `failed`
        with the sentence, or `diverged` (DivergedError) with the step, which also writes
        summaries/final.json so no earlier attempt's summary still says how the run ended.

        Each record is tried on its own (the original error matters more than a failed report
        of it), on the room the disk reserve leaves: on a full disk the manifest still gets
        written, and where even it does not fit, the failure event newer than the `running`
        manifest is what readers go by (jobspec.run_status)."""
        if not self.writer:
            return
        disk_reserve.release(self.store)
        msg = str(err) or type(err).__name__
        diverged_at = err.step if isinstance(err, DivergedError) else None
        with contextlib.suppress(Exception):
            self.record_time(force=True)
        with contextlib.suppress(Exception):
            self.event(
                "failure",
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
                self.store.write_json("summaries/final.json", {
                    "run_id": self.cfg.run.id,
                    "status": "diverged",
                    "steps": step,
                    "tokens": step * self.cfg.training.tokens_per_step,
                    "diverged_at_step": diverged_at,
                    "final_loss": self.last_row["loss"] if self.last_row else None,
                    "failure": msg,
                    "checkpoints": {"latest": index.get("latest"), "best": index.get("best")},
                    "goodput": goodput.account(self.store.read_jsonl(EVENTS)),
                })  # fmt: skip
        with contextlib.suppress(Exception):
            self._write_manifest(**update)
        with contextlib.suppress(Exception):
            self.sinks.close()


def _nonfinite_of(row: dict) -> dict[str, Any]:
    """The NONFINITE_KEYS of `row` whose value is NaN or infinite."""
    return {
        k: row[k]
        for k in NONFINITE_KEYS
        if isinstance(row.get(k), float) and not math.isfinite(row[k])
    }


def _nonfinite_text(row: dict) -> str:
    """`loss nan, grad_norm inf, param_norm 3.2`: the figures that say why a step diverged."""
    return ", ".join(f"{k} {row[k]:.4g}" for k in NONFINITE_KEYS if k in row)
