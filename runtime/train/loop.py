"""The host loop around the pure train step: data in, metrics and checkpoints out, signals.

It owns I/O, timing and signals; all math lives in step.py. Every host runs this same
loop; host-global files go through the ArtifactStore, which only the writer may use for them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from jobspec.errors import CheckpointError, DivergedError, StorageError
from jobspec.exit_codes import EXIT_RESTARTABLE
from jobspec.files.run_toml import resolved_dict
from jobspec.run_config import RunConfig
from runfolder.layout import SUMMARY, EventKind
from runfolder.storage import configure_gcs_env, join
from runfolder.store import ArtifactStore
from runtime.data.eval_rows import check_evals
from runtime.data.loader import TokenBatches, check_for_run, train_batches
from runtime.data.mixture import load_data
from runtime.host import boot, compile_cache, host_memory, startup
from runtime.host.coordination import HostWatchdog, StopAgreement
from runtime.host.stop_guard import StopGuard
from runtime.model.build import build_model
from runtime.model.sharding import batch_sharding, build_mesh, host_rows
from runtime.observe import ledger as buckets
from runtime.observe.ledger import TimeLedger
from runtime.observe.profile import ProfileWindow
from runtime.observe.sinks import MetricSinks
from runtime.observe.startup_log import StartupLog
from runtime.run import artifacts, early_check, owner
from runtime.run.checkpoint.service import CheckpointService
from runtime.run.compat import run_fingerprint
from runtime.run.meta import CheckpointMeta
from runtime.train.cadence import Cadence, Due, final_save
from runtime.train.evaluate import Evaluator
from runtime.train.metrics import NONFINITE_KEYS, TrainMetrics
from runtime.train.optim import build_optimizer
from runtime.train.program import AheadStep, compile_ahead, train_program
from runtime.train.start import (
    RestoreTimes,
    initial_state,
    nothing_to_train,
    open_run,
    resume_decay_steps,
)
from runtime.train.state import TrainState, model_state_record


@dataclass
class TrainResult:
    status: str  # completed | interrupted | stopped (a diverged run raises DivergedError)
    exit_code: int
    summary: dict


@dataclass
class Run:
    """What the loop needs, built once per attempt by `_prepare`."""

    cfg: RunConfig
    store: ArtifactStore
    ckpt: CheckpointService
    art: artifacts.RunArtifacts
    metrics: TrainMetrics
    batches: TokenBatches
    evaluator: Evaluator
    step_fn: AheadStep
    state: TrainState
    start_step: int
    data_state: dict | None
    decay_steps: int
    fingerprint: dict
    batch_sharding: Any
    global_shape: tuple[int, int, int]
    seq_part: slice  # this process's part of each sequence (all of it unless context spans hosts)
    ledger: TimeLedger
    profile: ProfileWindow
    say: StartupLog
    step: int = 0  # the last step completed in this attempt (what a failure is recorded at)
    host_copy_bytes: int = 0  # a save's copy off the accelerator, faulted in before step 1
    restore: RestoreTimes | None = None  # a resume's restore, for the first step's event
    skipped_saves: int = 0  # periodic saves skipped while the one before was still written


def _emit(line: str) -> None:
    print(line, flush=True)


def _prepare(
    cfg: RunConfig,
    source_toml: str,
    resume: bool,
    reshard: bool,
    store,
    ckpt,
    manifest,
    mesh,
    ledger: TimeLedger,
    say: StartupLog,
    from_step: int | None = None,
) -> Run:
    fp = run_fingerprint(cfg, manifest)
    # A resume compiles the schedule its checkpoint recorded (a raised target_tokens keeps it).
    decay = resume_decay_steps(ckpt, from_step) if resume else None
    say(
        "lowering the train step; XLA compiles it while the "
        + ("checkpoint is read" if resume else "model is built")
    )
    ahead = compile_ahead(cfg, mesh, decay)  # on a thread: its time shows at step 1
    say(f"building the model on a {_mesh_text(mesh)} mesh")
    with ledger.timing(buckets.MODEL_INIT):  # a restore inside it is timed as restore
        # A resume builds shapes and shardings only: the checkpoint is read straight into them.
        parts = build_model(
            cfg.model, cfg.run.seed, mesh, materialise=not resume, abstract_others=resume
        )
        say("creating the optimizer state" if not resume else "reading the checkpoint index")
        init = initial_state(cfg, resume, reshard, ckpt, fp, parts, mesh, ledger, from_step, say)
    # The restored model state (router biases) is what evals route with, as a fresh run's is.
    parts = replace(parts, others=init.state.model_state)
    with ledger.timing(buckets.COMPILE):  # a step that cannot be traced ends before any record
        ahead.wait_lowered()
    tx, schedule = build_optimizer(cfg.optimizer, init.decay_steps)
    t = cfg.training
    say("opening the data loader")
    b_sh = batch_sharding(mesh, 3, leading=1)
    global_shape = (t.gradient_accumulation_steps, t.global_batch_size, t.seq_len)
    row_block, row_blocks, seq_part = host_rows(b_sh, global_shape)
    batches = train_batches(manifest, cfg.data, t, cfg.run.seed, row_block, row_blocks)
    step_fn = ahead.bind(
        train_program(cfg, parts, tx, schedule, init.shardings, mesh), init.decay_steps
    )
    say("opening the run's records")
    sinks = MetricSinks.open(
        cfg.metrics, store, run_id=cfg.run.id, start_step=init.step, config=resolved_dict(cfg)
    )
    art = artifacts.RunArtifacts(store, cfg, source_toml, ledger, sinks)
    # skip_step's count goes on from the checkpoint's.
    metrics = TrainMetrics(cfg, art, skipped_steps=init.skipped_steps)
    art.start(
        resume=resume,
        start_step=init.step,
        total_steps=t.total_steps,
        diagnostics=artifacts.runtime_diagnostics(
            cfg, mesh, manifest, batches, parts.param_shardings
        ),
    )
    return Run(
        cfg=cfg, store=store, ckpt=ckpt, art=art, metrics=metrics, batches=batches,
        evaluator=Evaluator(cfg, manifest, parts, mesh), step_fn=step_fn, state=init.state,
        start_step=init.step, data_state=init.data_state, decay_steps=init.decay_steps,
        fingerprint=fp, batch_sharding=b_sh, global_shape=global_shape, seq_part=seq_part,
        ledger=ledger, profile=ProfileWindow(cfg.profile, store, init.step), say=say,
        step=init.step, host_copy_bytes=_host_copy_bytes(init.state), restore=init.restore,
    )  # fmt: skip


def _host_copy_bytes(state: TrainState) -> int:
    """On an accelerator, what a save copies to host memory, with that memory kept from one save
    to the next (runtime/host/host_memory.py); 0 on CPU, where the arrays are in host memory."""
    if jax.default_backend() == "cpu":
        return 0
    nbytes = host_memory.copy_bytes(jax.tree.leaves((state.params, state.opt_state)))
    if not host_memory.worth_keeping(nbytes) or not host_memory.keep_freed_memory():
        return 0
    return nbytes


def _mesh_text(mesh) -> str:
    sizes = [f"{name} {size}" for name, size in mesh.shape.items() if size > 1]
    return " x ".join(sizes) or f"{mesh.devices.size}-device"


def train(
    cfg: RunConfig,
    source_toml: str,
    *,
    resume: bool | str,
    max_steps: int | None = None,
    writer_index: int = 0,
    reshard: bool = False,
    emit: Callable[[str], None] = _emit,
    from_step: int | None = None,
) -> TrainResult:
    """Train to target_tokens (or `max_steps` more steps, then checkpoint and stop).

    Every host of a job calls this with the same arguments after `boot.boot()`; `writer_index`
    is the host that writes host-global files (agreed by `writer.elect_writer`). `resume="auto"`
    continues from the latest committed checkpoint if there is one, else starts. `from_step`
    (with resume) continues from that committed step and discards the later checkpoints. The
    writer owns the run directory from `start.open_run` until this returns or raises.
    """
    try:
        return _train(cfg, source_toml, resume, max_steps, writer_index, reshard, emit, from_step)
    finally:
        owner.release(join(cfg.run.output_uri, cfg.run.id))


def _train(
    cfg, source_toml, resume, max_steps, writer_index, reshard, emit, from_step
) -> TrainResult:
    # Every second of this attempt from its process start goes to one bucket (goodput).
    ledger = TimeLedger()
    say = StartupLog(None if jax.process_index() == 0 else False)
    configure_gcs_env()
    t_start = time.perf_counter()
    say(f"opening run {cfg.run.id} in {cfg.run.output_uri}")
    store, resume = open_run(cfg, resume, writer_index)
    # Before the first compile: a job of many hosts keeps its programs in the run's directory.
    compile_cache.for_run(store.root_uri, jax.process_count())
    manifest, small_evals = _open_data(cfg, store, ledger, say)
    if resume:  # a config that resume would refuse is refused even with nothing to train
        done = nothing_to_train(cfg, store, from_step, run_fingerprint(cfg, manifest), reshard)
        if done is not None:
            emit(done)  # before the model or Orbax: nothing of the run changes
            return _as_recorded(cfg, store)
    mesh = build_mesh(cfg.mesh)
    ckpt = CheckpointService(
        store,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_,
        early_finding=early_check.take,  # compared from the process start (run/early_check.py)
    )
    info = boot.current()
    attempt = info.attempt if info else 0
    stop = StopAgreement(run_id=cfg.run.id, attempt=attempt)
    try:
        run = _prepare(
            cfg, source_toml, resume, reshard, store, ckpt, manifest, mesh, ledger, say, from_step
        )
        # The agreement takes SIGTERM/SIGINT over before start-up lets go, so no signal finds
        # the default handler in between; a stop asked for during start-up (also one whose
        # exception some library swallowed) is raised by end(), before any step.
        stop.install()
        startup.end()
    except BaseException:
        stop.restore()
        ckpt.close(after_failure=True)  # logs what it cannot finish: the first error wins
        raise
    for small in small_evals:  # rows reused within an eval: said once, and recorded
        if store.is_writer:
            print(f"warning: {small['message']}", file=sys.stderr, flush=True)
        run.art.event(EventKind.EVAL_ROWS_REUSED, **small)
    if resume:
        emit(
            f"resumed {cfg.run.id} from checkpoint {run.start_step}; training to step {cfg.training.total_steps}"
        )
    watchdog = HostWatchdog(
        timeout_s=cfg.runtime.host_loss_timeout_s, run_id=cfg.run.id, attempt=attempt
    )
    watchdog.start()
    return _run_to_end(run, stop, watchdog, max_steps, emit, t_start)


def _as_recorded(cfg: RunConfig, store: ArtifactStore) -> TrainResult:
    """A completed run resumed with nothing to train: its own final summary, exit 0."""
    summary = store.read_json(SUMMARY) if store.exists(SUMMARY) else {}
    summary = {"run_id": cfg.run.id, "status": "completed", **summary}
    summary.setdefault("steps", cfg.training.total_steps)
    return TrainResult("completed", 0, summary)


def _open_data(cfg: RunConfig, store: ArtifactStore, ledger: TimeLedger, say: StartupLog):
    """The data manifest (prepared first where it is missing) and the evals whose rows are
    reused, once both are known to fit the run."""
    say(
        "reading the data"
        if cfg.data.prepare is None
        else "reading the data (preparing it first where it is missing)"
    )
    with ledger.timing(buckets.DATA_OPEN):
        manifest = load_data(cfg.data, is_writer=store.is_writer)  # or [[data.sources]]
    check_for_run(manifest, cfg.data, cfg.model.vocab_size, cfg.training)
    # An eval whose split gives no row ends the run here, before any step (not at its end).
    return manifest, check_evals(manifest, cfg)


def _run_to_end(
    run: Run, stop: StopAgreement, watchdog: HostWatchdog, max_steps, emit, t_start: float
) -> TrainResult:
    """The steps, then the one way a run ends; a failure is recorded at the step reached."""
    # A stop on a storage that stopped answering must still end the run (stop_guard.py).
    guard = StopGuard(run.store.probe, run.store.root_uri).install()
    failed = False
    run.ckpt.on_written = lambda step, took: run.art.event(
        EventKind.CHECKPOINT_WRITTEN, step=step, at_step=run.step, write_s=round(took, 3)
    )  # how long the storage took, and the steps that ran meanwhile
    try:
        status = _loop(run, stop, watchdog, max_steps, emit, t_start)
        result = _finish(run, status, stop, watchdog, emit, t_start)
        watchdog.mark_done()
        return result
    except BaseException as e:
        failed = True
        # A collective that failed because a peer died: let the watchdog name the lost host.
        watchdog.explain_failure(e)
        if isinstance(e, (StorageError, CheckpointError)):
            _write_unfetched_rows(run, emit)
        # What was committed stays; the failure is recorded at the step reached (run.step is
        # moved on as each step completes); a half-save never becomes latest.
        run.art.fail(
            run.step, e, _settled_index(run.ckpt) if isinstance(e, DivergedError) else None
        )
        raise
    finally:
        guard.end()
        run.ckpt.on_written = None  # the attempt's record is closed
        run.profile.abandon()
        stop.restore()
        # After a failure, close() only logs what it cannot finish: the first error is the
        # one the user sees and the one the exit code comes from.
        run.ckpt.close(after_failure=failed)


def _write_unfetched_rows(run: Run, emit) -> None:
    """The rows of steps done before a storage failure and not yet fetched (metrics are read a
    step late); a write that fails too is dropped: the first error is the one reported."""
    try:
        run.metrics.write_unfetched(emit)
    except Exception:  # noqa: BLE001
        pass


def _loop(
    run: Run,
    stop: StopAgreement,
    watchdog: HostWatchdog,
    max_steps: int | None,
    emit,
    t_start: float,
) -> str:
    """Steps until the end, `max_steps` or an agreed stop; returns how it ended.

    The loop says "a step is done" and asks once what it owes (`Cadence.after`): rows, a save,
    an eval, a profile's end, a stop. It tells the watchdog where it is at points every host
    passes in the same order (the same answers on every host), so a host stuck between two of
    them is seen by its peers (coordination.HostWatchdog).
    """
    total_steps = run.cfg.training.total_steps
    end_step = total_steps if max_steps is None else min(total_steps, run.start_step + max_steps)
    every = run.cfg.checkpoint.every
    cadence = Cadence(
        run.evaluator, stop, run.profile, end_step, save_every=every, last_step=total_steps
    )
    with run.batches.iterate(run.start_step) as it:
        if run.data_state is not None:
            it.set_state(run.data_state)
        while run.step < end_step:
            outputs, provenance = _step(run, it, emit, t_start)
            # Stepping from here on: compile is over, a stall is judged.
            watchdog.progress(run.step, outputs=outputs)
            run.ckpt.poll()
            due = cadence.after(run.step)
            _record(run, due, outputs, provenance, emit)
            _pause(run, due, watchdog, emit)
            if due.stop:
                return "interrupted"
    return "completed" if run.step == total_steps else "stopped"


def _step(run: Run, it: Iterator, emit, t_start: float) -> tuple[Any, dict]:
    """The next batch through the train step; (the step's outputs, its batch's provenance)."""
    ledger = run.ledger
    ledger.switch(buckets.DATA_WAIT)
    item = next(it)
    batch = {
        k: jax.make_array_from_process_local_data(
            run.batch_sharding, v[..., run.seq_part], run.global_shape
        )
        for k, v in item.batch.items()
    }
    step = run.step + 1
    with ledger.timing(buckets.PROFILE):
        run.profile.start(step, emit)
    first = step == run.start_step + 1
    if first:
        run.say(
            f"finishing the train step's compile, then step {step}"
            if run.step_fn.pending
            else f"compiling the train step, then step {step}"
        )
    ledger.switch(ledger.step_bucket(step, first_of_attempt=first))
    if first:
        # While XLA finishes the step's compile: the first save then finds its pages resident.
        host_memory.fault_in(run.host_copy_bytes)
    run.state, outputs = run.step_fn(run.state, batch)
    run.step = step
    ledger.stepped(step)
    if first:
        # The first step of an attempt includes compilation: time it alone, then start the
        # throughput clock, so tokens/s measures steady-state steps only.
        jax.block_until_ready(outputs)
        run.art.event(
            EventKind.FIRST_STEP,
            step=step,
            seconds_since_start=time.perf_counter() - t_start,
            compiled_ahead=run.step_fn.used,  # its compile ran beside the model's build
            **_start_figures(run),
        )
        run.metrics.meter.mark(step)
    return outputs, item.provenance


def _start_figures(run: Run) -> dict[str, Any]:
    """What the first step waited on, in seconds: the step's tracing and compile on their
    thread (`compile_s`, loaded from the persistent cache or not), the part of it step 1 still
    waited for, and on a resume the restore (`restore_s`, checksums compared beside it in
    `verify_s`) and how much of it ran while the step compiled (`restore_overlap_s`)."""
    times = run.step_fn.times
    out: dict[str, Any] = {}
    if run.step_fn.used and times.started is not None and times.done is not None:
        out["lower_s"] = round((times.lowered or times.done) - times.started, 3)
        out["compile_s"] = round(times.done - times.started, 3)
        out["compile_from_cache"] = times.from_cache
        out["compile_wait_s"] = round(run.step_fn.waited_s, 3)
        out["remat"] = times.remat  # the policy compiled (remat "auto" resolved)
    r = run.restore
    if r is not None:
        out["restore_s"] = round(r.done - r.started, 3)
        out["verify_s"] = None if r.verify_s is None else round(r.verify_s, 3)
        if times.started is not None:
            end = times.done if times.done is not None else r.done
            out["restore_overlap_s"] = round(
                max(0.0, min(end, r.done) - max(times.started, r.started)), 3
            )
    return out


def _record(run: Run, due: Due, outputs: Any, provenance: dict, emit) -> None:
    """The step's rows (fetched when `due.sync`), its finiteness, and a profile's end."""
    # Profiled steps are synced at both ends and kept out of tokens/s.
    run.metrics.step_done(due.step, outputs, provenance, emit, sync=due.sync, timed=not due.traced)
    # Read from the rows just fetched (no sync of its own); every step before an eval, a save
    # or the end is fetched, so nothing non-finite is evaluated or saved.
    if run.metrics.nonfinite is not None:
        raise _diverged(run)
    if due.traced:
        with run.ledger.timing(buckets.PROFILE):
            if (captured := run.profile.stop(due.step, outputs, emit)) is not None:
                run.art.event(EventKind.PROFILE, **captured)
                run.metrics.meter.mark(due.step)


def _pause(run: Run, due: Due, watchdog: HostWatchdog, emit) -> None:
    """A periodic save and eval, when due; then the time ledger, at most every minute unless
    they ran."""
    step = due.step
    # The save first: an eval that fails (or never ends) cannot cost the checkpoint; the eval's
    # loss reaches the index afterwards (it picks `best`).
    if due.save:
        watchdog.progress(step, "checkpoint")
    with run.ledger.timing(buckets.CHECKPOINT):
        saved = due.save and _save_unless_writing(run, emit)
    if due.eval:
        watchdog.progress(step, "eval")  # may be long: its own compile, many batches
    with run.ledger.timing(buckets.EVAL):
        losses = run.evaluator.at(step, run.state, run.art, emit) if due.eval else None
    if saved:
        _save_metrics(run, losses)
    if due.pause:
        watchdog.progress(step)  # back to stepping
        run.metrics.meter.mark(step)  # eval and save time is not training throughput
    run.art.record_time(force=due.pause)


def _finish(
    run: Run, status: str, stop: StopAgreement, watchdog: HostWatchdog, emit, t_start: float
) -> TrainResult:
    """The one way a run ends: final evals, final save, wait for it, summary, exit code."""
    cfg, step = run.cfg, run.step
    watchdog.progress(step, "finish")  # final evals and saves may be long: not judged
    run.profile.abandon()  # an attempt that stopped inside the window: no partial trace
    run.ledger.switch(buckets.FINISH)
    extra: dict[str, Any] = {}
    save = final_save(status, on_signal=cfg.checkpoint.on_signal)
    # The final save starts before the final evals: one that raises still leaves it committed
    # (the failure path waits for started saves), and their loss is added to its entry.
    if save:
        with run.ledger.timing(buckets.CHECKPOINT):
            _save(run)
    with run.ledger.timing(buckets.EVAL):
        # Completed, or stopped by --max-steps: the configured evals at this step (once).
        evaluate = status != "interrupted" and cfg.evals
        losses = run.evaluator.at(step, run.state, run.art, emit) if evaluate else None
    if save:
        with run.ledger.timing(buckets.CHECKPOINT):
            _save_metrics(run, losses)
            run.ckpt.wait()
    if status == "interrupted":
        extra["signal"] = name = stop.reason or "signal"
        emit(f"{name} received: stopped at step {step}" + (", checkpoint saved" if save else ""))
    elif status == "stopped":
        emit(
            f"stopped after {step - run.start_step} steps (--max-steps) at step {step}, checkpoint saved"
        )
    summary = run.art.finish(
        status, step, run.ckpt.read_index(), time.perf_counter() - t_start, **extra
    )
    return TrainResult(status, EXIT_RESTARTABLE if status == "interrupted" else 0, summary)


def _diverged(run: Run) -> DivergedError:
    """The one sentence for a run that stops on a non-finite step (training.on_nonfinite)."""
    bad, cfg = run.metrics.nonfinite or {}, run.cfg
    figures = ", ".join(
        f"{k} {'-' if bad.get(k) is None else format(bad[k], '.4g')}" for k in NONFINITE_KEYS
    )
    if "skipped_steps" in bad:
        what = (
            f"run {cfg.run.id} skipped {bad['skipped_steps']} steps with a non-finite loss or "
            f"gradient, more than training.max_skipped_steps = {cfg.training.max_skipped_steps} "
            f"(the last at step {bad['step']}: {figures})"
        )
    else:
        what = f"run {cfg.run.id} diverged at step {bad.get('step')} ({figures})"
    newest = run.ckpt.newest()
    kept = (
        "no checkpoint was saved"
        if newest is None
        else f"the newest checkpoint, {newest}, is finite"
    )
    return DivergedError(
        f"{what}; it stopped before saving anything non-finite ({kept}) and is not restarted, "
        "since resuming with the same settings and data diverges again: lower optimizer.lr or "
        "fix the data and start a new run.id, or roll back past a damaged checkpoint with "
        f"`runtime checkpoints rollback {run.store.uri('')} --to-step N`",
        step=int(bad.get("step") or run.step),
    )


def _settled_index(ckpt: CheckpointService) -> dict:
    """The index once started saves are committed (every host stops at the same step, so the
    waits line up); as it stands if that fails (the failure being reported matters more)."""
    try:
        ckpt.wait()
    except Exception:  # noqa: BLE001
        pass
    return ckpt.read_index()


def _save_metrics(run: Run, losses: dict[str, float] | None) -> None:
    """The first eval's loss onto the checkpoint of this step (saved before the eval ran)."""
    if losses and run.cfg.evals:
        run.ckpt.set_metrics(run.step, {"val_loss": losses[run.cfg.evals[0].name]})


def _save(run: Run) -> bool:
    """Start saving this step (the caller knows it is due, or the last); True when a save
    started, False when the step is saved already. The caller has checked the step's metrics
    are finite."""
    state, t0 = run.state, time.perf_counter()
    if run.ckpt.save(run.step, params=state.params, opt_state=state.opt_state, meta=_meta(run)):
        # How long the loop stood still for it: an async save's copy off the chip, and any wait
        # for the previous save (`waited_s`), the rest being written in the background.
        blocked = time.perf_counter() - t0
        run.art.event(
            EventKind.CHECKPOINT, step=run.step, blocked_s=round(blocked, 3),
            waited_s=round(run.ckpt.waited_s, 3),
        )  # fmt: skip
        return True
    return False


#: How long a periodic save waits for the write before it to end: a small state's write (a toy
#: model's, the test suite's) ends by then and is saved as always. A write still going after it
#: is storage slower than the cadence: that save is skipped, and so is every later one that
#: finds a write going, at once.
SAVE_GRACE_S = 1.0


def _save_unless_writing(run: Run, emit) -> bool:
    """A periodic save, unless the one before is still being written on some host: then it is
    skipped on every host (the loop does not wait for storage between steps) and the next due
    step saves. The first skip is said once on stdout (advice on the cadence, not a fault);
    each is an event with the count so far. True when a save started."""
    grace = 0.0 if run.skipped_saves else SAVE_GRACE_S
    writing = run.ckpt.writing_anywhere(grace)
    if writing is None:
        return _save(run)
    run.skipped_saves += 1
    run.art.event(EventKind.CHECKPOINT_SKIPPED, step=run.step, writing=writing,
                  skipped=run.skipped_saves)  # fmt: skip
    if run.skipped_saves == 1 and run.store.is_writer:
        emit(
            f"note: checkpoint {run.step} skipped: checkpoint {writing} is still being written, "
            f"as saves every {run.cfg.checkpoint.every} steps come faster than the storage takes "
            "them; the next due step saves (skips are counted in events.jsonl); raise "
            "checkpoint.every to save at each"
        )
    return False


def _meta(run: Run) -> CheckpointMeta:
    step, cfg = run.step, run.cfg
    return CheckpointMeta(
        step=step,
        tokens=step * cfg.training.tokens_per_step,
        rng=np.asarray(jax.device_get(run.state.rng)).tolist(),
        decay_steps=run.decay_steps,
        config=resolved_dict(cfg),
        fingerprint=run.fingerprint,
        # The loader's state is process-count independent; each process records its own.
        data_state={str(jax.process_index()): run.batches.state_for(step)},
        # Router biases move outside the gradient; saved even when training leaves them, so a
        # resume reads them rather than computing the model's initial ones.
        model_state=model_state_record(run.state)
        if jax.tree.leaves(run.state.model_state)
        else None,
        skipped_steps=run.metrics.skipped_steps,
    )
