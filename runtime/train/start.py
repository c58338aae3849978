"""An attempt's start: the run's store (and its one live owner), then the train state, fresh or
restored from a committed checkpoint."""

from __future__ import annotations

import atexit
import contextlib
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jobspec.errors import CheckpointError, ConfigError
from jobspec.run_config import RunConfig
from runfolder.background import in_background
from runfolder.layout import CHECKPOINTS, MANIFEST
from runfolder.storage import RetryPolicy, join, use_policy
from runfolder.store import ArtifactStore
from runtime.host import boot
from runtime.model.build import ModelParts, build_model
from runtime.model.sharding import replicated
from runtime.observe import ledger as buckets
from runtime.observe.ledger import TimeLedger
from runtime.observe.startup_log import StartupLog
from runtime.run import artifacts, owner
from runtime.run.checkpoint.errors import UnreadableCheckpointError
from runtime.run.checkpoint.index import reconciled_entries, repair_index
from runtime.run.checkpoint.service import CheckpointService
from runtime.run.checkpoint.verify import step_damage
from runtime.run.compat import check_compatible
from runtime.run.meta import CheckpointMeta
from runtime.train.optim import build_optimizer
from runtime.train.state import (
    TrainState,
    abstract_opt_state,
    new_state,
    restored_state,
    state_shardings,
)


@dataclass(frozen=True)
class RestoreTimes:
    """When a resume's restore ran (perf_counter seconds: the checkpoint read, its checksums
    compared beside it, and the finiteness check) and how long the checksums took."""

    started: float
    done: float
    verify_s: float | None  # None: the step was saved before checksums (nothing compared)


@dataclass
class InitialState:
    """Where an attempt starts."""

    state: TrainState
    shardings: Any  # the state's sharding tree
    step: int  # the committed step resumed from; 0 for a fresh run
    decay_steps: int  # the schedule length fixed by the first attempt
    data_state: dict | None  # the loader's state at `step`
    skipped_steps: int  # skip_step's count so far
    restore: RestoreTimes | None = None  # a resume's; None for a fresh run


def open_run(cfg: RunConfig, resume: bool | str, writer_index: int) -> tuple[ArtifactStore, bool]:
    """The run's store, after checking that starting or resuming is what the index allows.

    Reads checkpoints/index.json and the committed step folders only; Orbax is not touched until the config and data are known
    to fit, so a bad input ends before any checkpoint machinery starts.
    """
    retry = RetryPolicy(total_s=cfg.runtime.storage_retry_s)
    use_policy(retry)  # the data reads' (Grain's threads hand them none)
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
    if resume:  # a damaged index is rebuilt (and kept beside), as a missing one is
        repair_index(store)
    # The index as disk has it (a crash between Orbax's commit and the index write still counts).
    has_ckpt = bool(reconciled_entries(store))
    if resume == "auto":  # a restarted attempt continues; a first attempt starts
        return store, has_ckpt
    if not resume and has_ckpt:
        raise ConfigError(
            f"run {cfg.run.id!r} already has checkpoints at {store.uri(CHECKPOINTS)}; pass --resume "
            "to continue it, or set a new run.id"
        )
    if resume and not has_ckpt:
        raise CheckpointError(
            f"--resume was given but {store.uri(CHECKPOINTS)} holds no committed checkpoint; "
            "run without --resume to start the run"
        )
    return store, bool(resume)


def nothing_to_train(
    cfg: RunConfig, store: ArtifactStore, from_step: int | None, fp: dict, reshard: bool
) -> str | None:
    """The line a resume with nothing to train says instead of training (it then writes
    nothing): its latest checkpoint, intact, is the last step of a run that completed and the
    config is one that checkpoint's resume accepts (`fp`: its fingerprint). A resume past the
    last step (target_tokens lowered) is refused; None: train as usual."""
    entries = reconciled_entries(store)
    if not entries:
        return None
    latest, last = max(entries), cfg.training.total_steps
    if from_step is not None and from_step in entries and from_step > last:
        raise past_the_end(cfg, from_step, entries, "--from-step")
    if (from_step is not None and from_step != latest) or latest < last:
        return None
    if step_damage(store, latest) is not None:
        return None  # the resume says so and falls back to an intact step
    if latest > last:
        raise past_the_end(cfg, latest, entries, "its latest checkpoint")
    manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
    if manifest.get("status") != "completed":
        return None  # e.g. stopped by a signal at its last step: the final evals are still due
    check_compatible(dict(entries[latest].get("fingerprint") or {}), fp, step=latest,
                     reshard=reshard)  # fmt: skip
    return (
        f"run {cfg.run.id} completed step {last} already (training.target_tokens = "
        f"{cfg.training.target_tokens:,}): nothing to train; raise target_tokens to continue it"
    )


def past_the_end(cfg: RunConfig, step: int, steps, what: str) -> ConfigError:
    """The sentence for a resume from a step past the run's last (target_tokens lowered)."""
    t = cfg.training
    earlier = [s for s in sorted(steps) if s <= t.total_steps]
    way = (
        f"branch off an earlier checkpoint with --resume --from-step {earlier[-1]} (at or "
        f"before step {t.total_steps}: {', '.join(map(str, earlier))})"
        if earlier
        else f"start a new run.id (no checkpoint is at or before step {t.total_steps})"
    )
    return ConfigError(
        f"run {cfg.run.id!r} cannot resume from step {step} ({what}): training.target_tokens = "
        f"{t.target_tokens:,} ends it at step {t.total_steps}, so nothing was trained; raise "
        f"target_tokens past {step * t.tokens_per_step:,} to continue it, or {way}"
    )


def resume_decay_steps(ckpt: CheckpointService, from_step: int | None) -> int | None:
    """The schedule length a resume will most likely restore (that of `from_step`, else of the
    latest step), read from the step's small meta file ahead of the restore, so the step compiled
    ahead is the resumed run's; None when it cannot be told (the step then compiles at step 1)."""
    step = from_step if from_step is not None else ckpt.latest()
    meta = None if step is None or step not in ckpt.steps() else ckpt.read_meta(step)
    return None if meta is None else meta.decay_steps


def initial_state(
    cfg: RunConfig,
    resume: bool,
    reshard: bool,
    ckpt: CheckpointService,
    fp: dict,
    parts,
    mesh,
    ledger: TimeLedger,
    from_step: int | None = None,
    say: StartupLog | None = None,
) -> InitialState:
    """The state of a fresh or resumed attempt.

    A resume builds nothing: `parts` is abstract (shapes and shardings) and the checkpoint is
    read straight into it, its checksums compared beside the read. `from_step` resumes from
    that committed step instead of the latest, and discards the later ones once it has been
    read (never before: a bad choice must not cost the newer ones).
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
        decay_steps = cfg.optimizer.schedule.decay_steps or total_steps
        return InitialState(state, shardings, 0, decay_steps, None, 0)
    targets = {
        "params_target": parts.params,
        "opt_state_target": abstract_opt_state(provisional, parts.params, shardings),
    }
    finite_check = _finite_check_ahead(list(targets.values()), mesh)
    fallback = "rollback" if boot.current() else "resume"

    def before_read(step: int) -> None:
        if step > total_steps:  # the intact steps left after damaged ones are past the end
            raise past_the_end(cfg, step, ckpt.steps(), "the newest intact checkpoint")
        if say is not None:
            say(f"restoring checkpoint {step}")
        # Before Orbax reads anything; with --reshard Orbax lays the arrays out for this mesh.
        check_compatible(ckpt.fingerprint(step), fp, step=step, reshard=reshard)

    started = time.perf_counter()
    try:
        with ledger.timing(buckets.RESTORE):
            got = ckpt.restore_resume(
                from_step,
                before_read=before_read,
                # A launched job (booted by `runtime worker`) is resumed by submitting it again.
                fallback=fallback,
                **targets,
            )
            # Saves are finite (the loop checks first): NaN/inf read back is damage, said now
            # rather than as a divergence at the first step.
            if not _all_finite((got.params, got.opt_state), mesh, finite_check):
                raise ckpt.unreadable(
                    got.step, "its arrays hold NaN or infinite values", fallback=fallback
                )
    except UnreadableCheckpointError as e:
        # The run's own record made honest before the attempt ends: the index marks the step,
        # the events say why, and the manifest no longer says completed or running.
        try:
            ckpt.mark_unreadable(e.step, e.cause)
            artifacts.record_unreadable_checkpoint(ckpt.store, e.step, e.cause, str(e))
        except Exception:  # noqa: BLE001 - the unreadable step matters more than its record
            pass
        raise
    times = RestoreTimes(started, time.perf_counter(), got.verify_s)
    ckpt.mark_readable(got.step)
    if from_step is not None:
        _discard_later(ckpt, from_step)
    parts = _with_model_state(cfg, parts, got.meta, mesh)
    state = restored_state(parts, got.params, got.opt_state, got.meta, shardings)
    data_state = got.meta.data_state_for(jax.process_index())
    return InitialState(
        state, shardings, got.step, got.meta.decay_steps, data_state, got.meta.skipped_steps,
        times,
    )  # fmt: skip


def _with_model_state(cfg: RunConfig, parts: ModelParts, meta: CheckpointMeta, mesh) -> ModelParts:
    """`parts` whose non-Param state can seed the restored one: the abstract state serves when
    the checkpoint recorded it (or the model has none); otherwise (a checkpoint from before
    router biases were saved with every checkpoint, of a run that never moved them) their
    initial values are computed: the one init program a resume may run."""
    if meta.model_state is not None or not jax.tree.leaves(parts.others):
        return parts
    built = build_model(cfg.model, cfg.run.seed, mesh, materialise=False)
    return replace(parts, others=built.others)


def _finite_check(mesh):
    return jax.jit(
        lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs])),
        out_shardings=replicated(mesh),
    )


def _floating(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _finite_check_ahead(targets: Any, mesh) -> Future | None:
    """The finiteness check of a restore, compiled on a thread while the checkpoint is read."""
    leaves = _floating(targets)
    if not leaves:
        return None
    future = in_background(
        lambda: _finite_check(mesh).lower(leaves).compile(), "jaxjob-finite-check"
    )
    atexit.register(wait, [future])  # no thread inside XLA at exit (see compile_ahead)
    return future


def _all_finite(tree: Any, mesh, ahead: Future | None = None) -> bool:
    """Whether every floating array of `tree` is finite: one small program, once per restore
    (`ahead`: that program compiled beside the read)."""
    leaves = _floating(tree)
    if not leaves:
        return True
    if ahead is not None:
        with contextlib.suppress(TypeError, ValueError):  # not these arrays' program
            return bool(np.asarray(jax.device_get(ahead.result()(leaves))))
    return bool(np.asarray(jax.device_get(_finite_check(mesh)(leaves))))


def _discard_later(ckpt: CheckpointService, from_step: int) -> None:
    """--from-step: the run branches off at `from_step`; the later checkpoints go, each said."""
    discarded = ckpt.discard_after(from_step)
    for s in discarded:
        print(f"discarded checkpoint {s} (newer than --from-step {from_step})", flush=True)
    artifacts.record_discarded_checkpoints(ckpt.store, discarded, from_step)
