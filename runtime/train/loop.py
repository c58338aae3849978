"""The host loop around the pure train step: data in, metrics and checkpoints out, signals.

It owns I/O, timing and signals; all math lives in step.py. Every host runs this same
loop; host-global files go through the ArtifactStore, which only the writer may use for them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jobspec.errors import CheckpointError, ConfigError, DivergedError
from jobspec.exit_codes import EXIT_RESTARTABLE
from jobspec.load import resolved_dict
from jobspec.run_config import RunConfig
from jobspec.run_store import ArtifactStore
from jobspec.storage import RetryPolicy, configure_gcs_env, join
from runtime.data.eval_rows import check_evals
from runtime.data.loader import TokenBatches, check_for_run, train_batches
from runtime.data.mixture import load_data
from runtime.host import boot, startup
from runtime.host.coordination import HostWatchdog, StopAgreement
from runtime.host.stop_guard import StopGuard
from runtime.model.build import build_model
from runtime.model.sharding import batch_sharding, build_mesh, replicated
from runtime.observe import ledger as buckets
from runtime.observe.ledger import TimeLedger
from runtime.observe.profile import ProfileWindow
from runtime.observe.sinks import MetricSinks
from runtime.observe.startup_log import StartupLog
from runtime.run import artifacts, owner
from runtime.run.checkpoint import (
    CheckpointService,
    UnreadableCheckpointError,
    reconciled_entries,
)
from runtime.run.compat import check_compatible, run_fingerprint
from runtime.run.meta import CheckpointMeta
from runtime.train.evaluate import Evaluator
from runtime.train.optim import build_optimizer
from runtime.train.program import train_program
from runtime.train.state import (
    TrainState,
    abstract_opt_state,
    model_state_record,
    new_state,
    restored_state,
    state_shardings,
)


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
    batches: TokenBatches
    evaluator: Evaluator
    step_fn: Callable
    state: TrainState
    start_step: int
    data_state: dict | None
    decay_steps: int
    fingerprint: dict
    batch_sharding: Any
    global_shape: tuple[int, int, int]
    ledger: TimeLedger
    profile: ProfileWindow
    say: StartupLog
    step: int = 0  # the last step completed in this attempt (what a failure is recorded at)


def _emit(line: str) -> None:
    print(line, flush=True)


def _open_run(cfg: RunConfig, resume: bool | str, writer_index: int) -> tuple[ArtifactStore, bool]:
    """The run's store, after checking that starting or resuming is what the index allows.

    Reads checkpoints/index.json and the committed step folders only; Orbax is not touched until the config and data are known
    to fit, so a bad input ends before any checkpoint machinery starts.
    """
    retry = RetryPolicy(total_s=cfg.runtime.storage_retry_s)
    store = ArtifactStore(
        join(cfg.run.output_uri, cfg.run.id),
        process_index=jax.process_index(),
        writer_index=writer_index,
        retry=retry,
    )
    store.check_writable()
    # Before anything in the run changes (index repair, Orbax's tmp cleanup, artifacts): one
    # live owner per run; every host gets the writer's answer (run/owner.py).
    owner.claim_run(
        store.root_uri,
        run_id=cfg.run.id,
        is_writer=store.is_writer,
        lease_s=cfg.runtime.owner_lease_s,
        timeout_s=cfg.runtime.boot_timeout_s,
        retry=retry,
    )
    # The index as disk has it (a crash between Orbax's commit and the index write still counts).
    has_ckpt = bool(reconciled_entries(store))
    if resume == "auto":  # a restarted attempt continues; a first attempt starts
        return store, has_ckpt
    if not resume and has_ckpt:
        raise ConfigError(
            f"run {cfg.run.id!r} already has checkpoints at {store.uri('checkpoints')}; pass --resume "
            "to continue it, or set a new run.id"
        )
    if resume and not has_ckpt:
        raise CheckpointError(
            f"--resume was given but {store.uri('checkpoints')} holds no committed checkpoint; "
            "run without --resume to start the run"
        )
    return store, bool(resume)


def _initial_state(
    cfg: RunConfig,
    resume: bool,
    reshard: bool,
    ckpt,
    fp,
    parts,
    mesh,
    ledger: TimeLedger,
    from_step: int | None = None,
    say: StartupLog | None = None,
):
    """(state, shardings, start step, decay_steps, data state, skipped steps) for a fresh or
    resumed attempt.

    `from_step` resumes from that committed step instead of the latest, and discards the later
    ones once it has been read (never before: a bad choice must not cost the newer ones).
    """
    total_steps = cfg.training.total_steps
    # The optimizer state's structure does not depend on the schedule length, so the shardings
    # can come from a provisional optimizer before a resumed run learns its decay_steps.
    provisional, _ = build_optimizer(
        cfg.optimizer, cfg.optimizer.schedule.decay_steps or total_steps
    )
    shardings = state_shardings(parts, provisional, mesh)
    if not resume:
        state = new_state(parts, provisional, shardings, cfg.run.seed)
        return state, shardings, 0, cfg.optimizer.schedule.decay_steps or total_steps, None, 0
    # The newest intact step: a damaged newer one is said, recorded and discarded first.
    start_step = ckpt.resume_step(from_step)
    if say is not None:
        say(f"restoring checkpoint {start_step}")
    # Before Orbax reads anything; with --reshard Orbax lays the arrays out for this mesh.
    check_compatible(ckpt.fingerprint(start_step), fp, step=start_step, reshard=reshard)
    fallback = "rollback" if boot.current() else "resume"
    try:
        with ledger.timing(buckets.RESTORE):
            params, opt_state, meta = ckpt.restore(
                start_step,
                params_target=parts.params,
                opt_state_target=abstract_opt_state(provisional, parts.params, shardings),
                # A launched job (booted by `runtime worker`) is resumed by submitting it again.
                fallback=fallback,
            )
            # Saves are finite (the loop checks first): NaN/inf read back is damage, said now
            # rather than as a divergence at the first step.
            if not _all_finite((params, opt_state), mesh):
                raise ckpt.unreadable(
                    start_step, "its arrays hold NaN or infinite values", fallback=fallback
                )
    except UnreadableCheckpointError as e:
        try:
            _record_unreadable(ckpt, e)
        except Exception:  # noqa: BLE001 - the unreadable step matters more than its record
            pass
        raise
    ckpt.mark_readable(start_step)
    if from_step is not None:
        _discard_later(ckpt, from_step)
    state = restored_state(parts, params, opt_state, meta, shardings)
    data_state = meta.data_state_for(jax.process_index())
    return state, shardings, start_step, meta.decay_steps, data_state, meta.skipped_steps


def _all_finite(tree: Any, mesh) -> bool:
    """Whether every floating array of `tree` is finite: one small program, once per restore."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return True
    check = jax.jit(
        lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs])),
        out_shardings=replicated(mesh),
    )
    return bool(np.asarray(jax.device_get(check(leaves))))


def _record_unreadable(ckpt: CheckpointService, e: UnreadableCheckpointError) -> None:
    """Make the run's own record honest before the attempt ends: the index marks the step, the
    events say why, and the manifest no longer says completed or running."""
    store = ckpt.store
    ckpt.mark_unreadable(e.step, e.cause)
    if not store.is_writer:
        return
    store.append_jsonl(
        artifacts.EVENTS,
        [{"time": artifacts.now(), "event": "checkpoint_unreadable", "step": e.step,
          "error": e.cause}],
    )  # fmt: skip
    if store.exists("manifest.json"):
        manifest = store.read_json("manifest.json")
        manifest.update(status="failed", failure=str(e), updated=artifacts.now())
        store.write_json("manifest.json", manifest)


def _discard_later(ckpt: CheckpointService, from_step: int) -> None:
    """--from-step: the run branches off at `from_step`; the later checkpoints go, each said."""
    discarded = ckpt.discard_after(from_step)
    for s in discarded:
        _emit(f"discarded checkpoint {s} (newer than --from-step {from_step})")
    if discarded and ckpt.store.is_writer:
        ckpt.store.append_jsonl(
            artifacts.EVENTS,
            [{"time": artifacts.now(), "event": "checkpoints_discarded", "steps": discarded,
              "resume_from": from_step}],
        )  # fmt: skip


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
    say(f"building the model on a {_mesh_text(mesh)} mesh")
    with ledger.timing(buckets.MODEL_INIT):  # a restore inside it is timed as restore
        parts = build_model(cfg.model, cfg.run.seed, mesh, materialise=not resume)
        say("creating the optimizer state" if not resume else "reading the checkpoint index")
        state, state_sh, start_step, decay_steps, data_state, skipped = _initial_state(
            cfg, resume, reshard, ckpt, fp, parts, mesh, ledger, from_step, say
        )
    tx, schedule = build_optimizer(cfg.optimizer, decay_steps)
    t = cfg.training
    say("opening the data loader")
    batches = train_batches(
        manifest, cfg.data, t, cfg.run.seed, jax.process_index(), jax.process_count()
    )
    b_sh = batch_sharding(mesh, 3, leading=1)
    step_fn = train_program(cfg, parts, tx, schedule, state_sh, mesh)
    say("opening the run's records")
    sinks = MetricSinks.open(
        cfg.metrics, store, run_id=cfg.run.id, start_step=start_step, config=resolved_dict(cfg)
    )
    art = artifacts.RunArtifacts(store, cfg, source_toml, ledger, sinks)
    art.skipped_steps = skipped  # skip_step's count goes on from the checkpoint's
    art.start(
        resume=resume,
        start_step=start_step,
        total_steps=t.total_steps,
        diagnostics=artifacts.runtime_diagnostics(
            cfg, mesh, manifest, batches, parts.param_shardings
        ),
    )
    return Run(
        cfg=cfg, store=store, ckpt=ckpt, art=art, batches=batches,
        evaluator=Evaluator(cfg, manifest, parts, mesh), step_fn=step_fn, state=state,
        start_step=start_step, data_state=data_state, decay_steps=decay_steps, fingerprint=fp,
        batch_sharding=b_sh, global_shape=(t.gradient_accumulation_steps, t.global_batch_size, t.seq_len),
        ledger=ledger, profile=ProfileWindow(cfg.profile, store, start_step), say=say,
        step=start_step,
    )  # fmt: skip


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
    writer owns the run directory from `_open_run` until this returns or raises.
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
    store, resume = _open_run(cfg, resume, writer_index)
    say(
        "reading the data"
        if cfg.data.prepare is None
        else "reading the data (preparing it first where it is missing)"
    )
    with ledger.timing(buckets.DATA_OPEN):
        manifest = load_data(cfg.data, is_writer=store.is_writer)  # or [[data.sources]]
    check_for_run(manifest, cfg.data, cfg.model.vocab_size, cfg.training)
    # An eval whose split gives no row ends the run here, before any step (not at its end).
    small_evals = check_evals(manifest, cfg)
    mesh = build_mesh(cfg.mesh)
    ckpt = CheckpointService(
        store,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_,
        every=cfg.checkpoint.every,
        last_step=cfg.training.total_steps,
    )
    info = boot.current()
    stop = StopAgreement(run_id=cfg.run.id, attempt=info.attempt if info else 0)
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
        run.art.event("eval_rows_reused", **small)
    if resume:
        emit(
            f"resumed {cfg.run.id} from checkpoint {run.start_step}; training to step {cfg.training.total_steps}"
        )
    watchdog = HostWatchdog(
        timeout_s=cfg.runtime.host_loss_timeout_s,
        run_id=cfg.run.id,
        attempt=info.attempt if info else 0,
    )
    watchdog.start()
    # A stop on a storage that stopped answering must still end the run (stop_guard.py).
    guard = StopGuard(store.probe, store.root_uri).install()
    failed = False
    try:
        status = _loop(run, stop, watchdog, max_steps, emit, t_start)
        result = _finish(run, status, stop, watchdog, emit, t_start)
        watchdog.mark_done()
        return result
    except BaseException as e:
        failed = True
        # A collective that failed because a peer died: let the watchdog name the lost host.
        watchdog.explain_failure(e)
        # What was committed stays; the failure is recorded at the step reached (run.step is
        # moved on as each step completes); a half-save never becomes latest.
        run.art.fail(
            run.step, e, _settled_index(run.ckpt) if isinstance(e, DivergedError) else None
        )
        raise
    finally:
        guard.end()
        run.profile.abandon()
        stop.restore()
        # After a failure, close() only logs what it cannot finish: the first error is the
        # one the user sees and the one the exit code comes from.
        ckpt.close(after_failure=failed)


def _loop(
    run: Run,
    stop: StopAgreement,
    watchdog: HostWatchdog,
    max_steps: int | None,
    emit,
    t_start: float,
) -> str:
    """Steps until the end, `max_steps` or an agreed stop; returns how it ended.

    The loop only says "a step is done": the artifacts decide when to write rows, the evaluator
    when to evaluate, the checkpoint service when to save. It tells the watchdog where it is at
    points every host passes in the same order (the same `due` answers on every host), so a
    host stuck between two of them is seen by its peers (coordination.HostWatchdog).
    """
    total_steps = run.cfg.training.total_steps
    end_step = total_steps if max_steps is None else min(total_steps, run.start_step + max_steps)
    ledger, profile = run.ledger, run.profile
    with run.batches.iterate(run.start_step) as it:
        if run.data_state is not None:
            it.set_state(run.data_state)
        while run.step < end_step:
            ledger.switch(buckets.DATA_WAIT)
            item = next(it)
            batch = {
                k: jax.make_array_from_process_local_data(run.batch_sharding, v, run.global_shape)
                for k, v in item.batch.items()
            }
            step = run.step + 1
            with ledger.timing(buckets.PROFILE):
                profile.start(step, emit)
            first = step == run.start_step + 1
            if first:
                run.say(f"compiling the train step, then step {step}")
            ledger.switch(ledger.step_bucket(step, first_of_attempt=first))
            run.state, m = run.step_fn(run.state, batch)
            run.step = step
            ledger.stepped(step)
            if first:
                # The first step of an attempt includes compilation: time it alone, then start
                # the throughput clock, so tokens/s measures steady-state steps only.
                jax.block_until_ready(m)
                run.art.event(
                    "first_step", step=step, seconds_since_start=time.perf_counter() - t_start
                )
                run.art.meter.mark(step)
            # Stepping from here on: compile is over, a stall is judged.
            watchdog.progress(step, outputs=m)
            run.ckpt.poll()
            stopping = stop.should_stop(step)  # every host agrees on the same step
            eval_due, save_due = run.evaluator.due(step), run.ckpt.due(step)
            pause = eval_due or save_due
            # Profiled steps are synced at both ends and kept out of tokens/s.
            traced = profile.active(step)
            run.art.step_done(
                step, m, item.provenance, emit,
                sync=pause or stopping or step == end_step or profile.starts_after(step)
                or profile.ends_at(step),
                timed=not traced,
            )  # fmt: skip
            # Read from the rows just fetched (no sync of its own); every step before an eval,
            # a save or the end is fetched, so nothing non-finite is evaluated or saved.
            if run.art.nonfinite is not None:
                raise _diverged(run)
            if traced:
                with ledger.timing(buckets.PROFILE):
                    if (captured := profile.stop(step, m, emit)) is not None:
                        run.art.event("profile", **captured)
                        run.art.meter.mark(step)
            # The save first: an eval that fails (or never ends) cannot cost the checkpoint; the
            # eval's loss reaches the index afterwards (it picks `best`).
            if save_due:
                watchdog.progress(step, "checkpoint")
            with ledger.timing(buckets.CHECKPOINT):
                saved = _save(run)
            if eval_due:
                watchdog.progress(step, "eval")  # may be long: its own compile, many batches
            with ledger.timing(buckets.EVAL):
                eval_metrics = run.evaluator.maybe_run(step, run.state, run.art, emit)
            if saved:
                _save_metrics(run, eval_metrics)
            if pause:
                watchdog.progress(step)  # back to stepping
                run.art.meter.mark(step)  # eval and save time is not training throughput
            run.art.record_time(force=pause)
            if stopping:
                return "interrupted"
    return "completed" if run.step == total_steps else "stopped"


def _finish(
    run: Run, status: str, stop: StopAgreement, watchdog: HostWatchdog, emit, t_start: float
) -> TrainResult:
    """The one way a run ends: final evals, final save, wait for it, summary, exit code."""
    cfg, step = run.cfg, run.step
    watchdog.progress(step, "finish")  # final evals and saves may be long: not judged
    run.profile.abandon()  # an attempt that stopped inside the window: no partial trace
    run.ledger.switch(buckets.FINISH)
    extra: dict[str, Any] = {}
    save = status != "interrupted" or cfg.checkpoint.on_signal
    # The final save starts before the final evals: one that raises still leaves it committed
    # (the failure path waits for started saves), and their loss is added to its entry.
    if save:
        with run.ledger.timing(buckets.CHECKPOINT):
            _save(run, final=True)
    with run.ledger.timing(buckets.EVAL):
        eval_metrics = (
            run.evaluator.maybe_run(step, run.state, run.art, emit, final=True)
            if status != "interrupted"  # completed, or stopped by --max-steps
            else None
        )
    if save:
        with run.ledger.timing(buckets.CHECKPOINT):
            _save_metrics(run, eval_metrics)
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
    bad, cfg = run.art.nonfinite or {}, run.cfg
    figures = ", ".join(
        f"{k} {'-' if bad.get(k) is None else format(bad[k], '.4g')}"
        for k in artifacts.NONFINITE_KEYS
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


def _save_metrics(run: Run, eval_metrics: dict[str, float] | None) -> None:
    """The first eval's loss onto the checkpoint of this step (saved before the eval ran)."""
    if eval_metrics and run.cfg.evals:
        run.ckpt.set_metrics(run.step, {"val_loss": eval_metrics[run.cfg.evals[0].name]})


def _save(run: Run, *, final: bool = False) -> bool:
    """Hand the checkpoint service this step; it saves when the step is due, or when final.
    True when a save started. The caller has checked the step's metrics are finite."""
    step, cfg = run.step, run.cfg

    def meta() -> CheckpointMeta:
        return CheckpointMeta(
            step=step,
            tokens=step * cfg.training.tokens_per_step,
            rng=np.asarray(jax.device_get(run.state.rng)).tolist(),
            decay_steps=run.decay_steps,
            config=resolved_dict(cfg),
            fingerprint=run.fingerprint,
            # The loader's state is process-count independent; each process records its own.
            data_state={str(jax.process_index()): run.batches.state_for(step)},
            # Router biases move outside the gradient, so they are saved when training moves them.
            model_state=model_state_record(run.state)
            if cfg.model.router_bias_update_rate > 0
            else None,
            skipped_steps=run.art.skipped_steps,
        )

    if run.ckpt.maybe_save(
        step, params=run.state.params, opt_state=run.state.opt_state, meta=meta, final=final
    ):
        run.art.event("checkpoint", step=step)
        return True
    return False
