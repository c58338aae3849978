"""Train rows and the live line. Timing comes only from explicit synchronisation points.

`TrainMetrics` turns the step's device outputs into metrics/train.jsonl rows (runfolder.layout
`TrainRow`): the steps since the last sync are fetched together, timed, checked for finiteness
(training.on_nonfinite) and handed to the run's artifacts, which write them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jobspec.run_config import RunConfig
from runfolder.goodput import duration
from runfolder.layout import EventKind, TrainRow
from runtime.model.flops import flops_per_token
from runtime.run.artifacts import RunArtifacts, device_peak

# A step with any of these not finite diverged (training.on_nonfinite).
NONFINITE_KEYS = ("loss", "grad_norm", "param_norm")


@dataclass
class Throughput:
    """Tokens/s and step time over the steps between two synchronisation points."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # whole job: per-chip peak x chips; None = MFU not reported
    started: float = field(default_factory=time.perf_counter)
    _last_time: float | None = None
    _last_step: int | None = None

    def mark(self, step: int) -> None:
        """Call right after a host sync (device_get) at `step`: opens the next interval."""
        self._last_time, self._last_step = time.perf_counter(), step

    def interval(self, step: int) -> dict[str, float] | None:
        """Figures for the steps since the last mark; None before the first mark."""
        now = time.perf_counter()
        if self._last_time is None or self._last_step is None or step <= self._last_step:
            return None
        steps = step - self._last_step
        dt = now - self._last_time
        tps = steps * self.tokens_per_step / dt
        out = {"step_time": dt / steps, "tokens_per_s": tps, "elapsed": now - self.started}
        if self.peak_flops:
            out["mfu"] = tps * self.flops_per_token / self.peak_flops
        self._last_time, self._last_step = now, step
        return out


class TrainMetrics:
    """Builds the train rows of finished steps and hands them to the artifacts.

    `skipped_steps` goes on from the checkpoint's count (skip_step's limit spans attempts);
    `nonfinite` is set by the first step that ends the run ({step, loss, grad_norm,
    param_norm[, skipped_steps]}), which the loop turns into DivergedError."""

    def __init__(self, cfg: RunConfig, art: RunArtifacts, *, skipped_steps: int = 0) -> None:
        self.cfg, self.art = cfg, art
        fpt = float(flops_per_token(cfg.model, cfg.training.seq_len)["total"])
        _, chip_peak = device_peak(jax.devices())
        job_peak = chip_peak * len(jax.devices()) if chip_peak else None
        # Steady-state throughput: the loop marks the clock after compilation, evals and saves.
        self.meter = Throughput(cfg.training.tokens_per_step, fpt, job_peak)
        self._pending: list[tuple[int, Any, dict]] = []  # steps since the last host sync
        # Steps whose rows are due but are fetched at the next step_done, once the next step is
        # dispatched: the device runs it while the host waits for these (and whether timed).
        self._deferred: tuple[list[tuple[int, Any, dict]], bool] | None = None
        self.skipped_steps = skipped_steps
        self.nonfinite: dict[str, Any] | None = None

    def step_done(
        self, step: int, outputs: Any, provenance: dict, emit, *, sync: bool, timed: bool = True
    ) -> None:
        """Record a finished step (the caller has dispatched it); rows are fetched and written
        every `training.log_every` steps, and at `sync` (before an eval, a save, a profile or
        the end), so the host rarely waits. `timed=False` (profiled steps) writes the rows
        without throughput figures.

        A `log_every` step's rows are fetched one call later, after the next step has been
        dispatched: fetching them now would hold that dispatch until this step is done, and
        leave the device idle for the host's work in between. At `sync` they are fetched now.

        The fetched rows are where finiteness is read (no sync of its own): a step whose loss,
        grad_norm or param_norm is NaN/inf, or a skip past training.max_skipped_steps, sets
        `nonfinite`, which the loop turns into DivergedError before any eval or save."""
        if self._deferred is not None:
            (pending, was_timed), self._deferred = self._deferred, None
            self._flush(pending, emit, was_timed)
        self._pending.append((step, outputs, provenance))
        if sync:
            pending, self._pending = self._pending, []
            self._flush(pending, emit, timed)
        elif step % self.cfg.training.log_every == 0:
            self._deferred, self._pending = (self._pending, timed), []

    def write_unfetched(self, emit) -> None:
        """After a storage failure (the device is well): the rows of the steps done but not yet
        fetched (a deferred `log_every` fetch, steps since), so the record reaches the step the
        failure is recorded at. Finiteness is not acted on here: the failure already ends the run."""
        pending, timed = self._deferred if self._deferred is not None else ([], True)
        pending, self._deferred, self._pending = pending + self._pending, None, []
        if pending:
            self._flush(pending, emit, timed)

    def _flush(self, pending: list, emit, timed: bool) -> None:
        """Fetch the outputs of the steps since the last sync (one device_get: the sync point),
        then time the interval, write the rows and print the live line for the last one.
        Timing fields (and the ETA they give) go on the last row of the interval."""
        fetched = jax.device_get([m for _, m, _ in pending])
        last = pending[-1][0]
        timing = self.meter.interval(last) if timed else None
        if timing:
            timing["eta_s"] = (self.cfg.training.total_steps - last) * timing["step_time"]
        rows = [
            self._row(step, m, prov, timing if step == last else None)
            for (step, _, prov), m in zip(pending, fetched, strict=True)
        ]
        self.art.train_rows(rows)  # non-finite values are written null
        limit = self.cfg.training.max_skipped_steps
        for row in rows:
            if row.values.get("skipped"):
                self.art.event(EventKind.STEP_SKIPPED, **_figures(row),
                               skipped_steps=row.skipped_steps)  # fmt: skip
                emit(
                    f"warning: step {row.step} skipped ({_nonfinite_text(row)}): parameters "
                    f"and optimizer state kept; {row.skipped_steps} of "
                    f"training.max_skipped_steps = {limit} skips used"
                )
        emit(live_line(rows[-1]))

    def _row(self, step: int, outputs: dict, prov: dict, timing: dict | None) -> TrainRow:
        values: dict[str, float | bool] = {k: float(np.asarray(v)) for k, v in outputs.items()}
        skipped_steps = None
        if "skipped" in values:  # skip_step: the step itself kept its state on device
            values["skipped"] = skipped = bool(values["skipped"])
            self.skipped_steps += skipped
            skipped_steps = self.skipped_steps
        ids = self.cfg.artifacts.provenance == "ids"
        row = TrainRow(
            step=step,
            tokens=step * self.cfg.training.tokens_per_step,
            values=values,
            batch_hash=prov["batch_hash"],
            tokens_per_source=prov.get("tokens_per_source"),
            record_ids=prov["record_ids"] if ids else None,
            sources=prov.get("sources") if ids else None,
            timing=timing,
            skipped_steps=skipped_steps,
        )
        self._check_finite(row)
        return row

    def _check_finite(self, row: TrainRow) -> None:
        """Note the first step that ends the run: a non-finite one, or (skip_step) the skip
        past the limit."""
        if self.nonfinite is not None:
            return
        if row.skipped_steps is not None:
            over = row.skipped_steps > self.cfg.training.max_skipped_steps
            if row.values["skipped"] and over:
                self.nonfinite = {**_figures(row), "skipped_steps": row.skipped_steps}
        elif _nonfinite_of(row):
            self.nonfinite = _figures(row)


def _figures(row: TrainRow) -> dict[str, Any]:
    """{step, loss, grad_norm, param_norm}: what says why a step diverged."""
    return {"step": row.step, **{k: row.values.get(k) for k in NONFINITE_KEYS}}


def _nonfinite_of(row: TrainRow) -> dict[str, Any]:
    """The NONFINITE_KEYS of `row` whose value is NaN or infinite."""
    return {
        k: v
        for k in NONFINITE_KEYS
        if isinstance(v := row.values.get(k), float) and not math.isfinite(v)
    }


def _nonfinite_text(row: TrainRow) -> str:
    """`loss nan, grad_norm inf, param_norm 3.2`: the figures that say why a step diverged."""
    return ", ".join(f"{k} {row.values[k]:.4g}" for k in NONFINITE_KEYS if k in row.values)


def live_line(row: TrainRow) -> str:
    """`step: 10 | loss: 5.247 | grad_norm: 1.155 | lr: 2.9e-04 | tps: 59,660 | elapsed: 39.8s |
    eta: 4m10s`."""
    r = row.to_json()
    parts = [
        f"step: {r['step']}",
        f"loss: {r['loss']:.3f}",
        f"grad_norm: {r['grad_norm']:.3f}",
        f"lr: {r['lr']:.1e}",
    ]
    if "pg_clip_fraction" in r:
        parts.append(f"clipped: {100 * r['pg_clip_fraction']:.1f}%")
    if "tokens_per_s" in r:
        parts.append(f"tps: {r['tokens_per_s']:,.0f}")
    if "mfu" in r:
        parts.append(f"mfu: {100 * r['mfu']:.1f}%")
    if "elapsed" in r:
        parts.append(f"elapsed: {r['elapsed']:.1f}s")
    if r.get("eta_s"):
        parts.append(f"eta: {duration(r['eta_s'])}")
    return " | ".join(parts)


def eval_line(
    step: int, name: str, loss: float, tokens: float, per_source: dict | None = None
) -> str:
    """`eval validation @ step 300 | loss: 2.267 | tokens: 8,192`; over a mixture the sources'
    losses follow the mixed one: `loss: 2.267 (web 2.310, code 1.870)` (`-`: no tokens)."""
    mixed = f"{loss:.3f}"
    if per_source:
        each = ", ".join(
            f"{n} {'-' if v is None else format(v, '.3f')}" for n, v in per_source.items()
        )
        mixed += f" ({each})"
    return f"eval {name} @ step {step} | loss: {mixed} | tokens: {tokens:,.0f}"
