"""An attempt's start: the run's store (and its one live owner), then the train state, fresh or
restored from a committed checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jobspec.errors import CheckpointError, ConfigError
from jobspec.run_config import RunConfig
from jobspec.run_dir import CHECKPOINTS, MANIFEST
from jobspec.run_store import ArtifactStore
from jobspec.storage import RetryPolicy, join, use_policy
from runtime.host import boot
from runtime.model.sharding import replicated
from runtime.observe import ledger as buckets
from runtime.observe.ledger import TimeLedger
from runtime.observe.startup_log import StartupLog
from runtime.run import artifacts, owner
from runtime.run.checkpoint import (
    CheckpointService,
    UnreadableCheckpointError,
    reconciled_entries,
    repair_index,
    step_damage,
)
from runtime.run.compat import check_compatible
from runtime.train.optim import build_optimizer
from runtime.train.state import (
    TrainState,
    abstract_opt_state,
    new_state,
    restored_state,
    state_shardings,
)


@dataclass
class InitialState:
    """Where an attempt starts."""

    state: TrainState
    shardings: Any  # the state's sharding tree
    step: int  # the committed step resumed from; 0 for a fresh run
    decay_steps: int  # the schedule length fixed by the first attempt
    data_state: dict | None  # the loader's state at `step`
    skipped_steps: int  # skip_step's count so far


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
        decay_steps = cfg.optimizer.schedule.decay_steps or total_steps
        return InitialState(state, shardings, 0, decay_steps, None, 0)
    # The newest intact step: a damaged newer one is said, recorded and discarded first.
    start_step = ckpt.resume_step(from_step)
    if start_step > total_steps:  # the intact steps left after damaged ones are past the end
        raise past_the_end(cfg, start_step, ckpt.steps(), "the newest intact checkpoint")
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
        # The run's own record made honest before the attempt ends: the index marks the step,
        # the events say why, and the manifest no longer says completed or running.
        try:
            ckpt.mark_unreadable(e.step, e.cause)
            artifacts.record_unreadable_checkpoint(ckpt.store, e.step, e.cause, str(e))
        except Exception:  # noqa: BLE001 - the unreadable step matters more than its record
            pass
        raise
    ckpt.mark_readable(start_step)
    if from_step is not None:
        _discard_later(ckpt, from_step)
    state = restored_state(parts, params, opt_state, meta, shardings)
    data_state = meta.data_state_for(jax.process_index())
    return InitialState(
        state, shardings, start_step, meta.decay_steps, data_state, meta.skipped_steps
    )


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


def _discard_later(ckpt: CheckpointService, from_step: int) -> None:
    """--from-step: the run branches off at `from_step`; the later checkpoints go, each said."""
    discarded = ckpt.discard_after(from_step)
    for s in discarded:
        print(f"discarded checkpoint {s} (newer than --from-step {from_step})", flush=True)
    artifacts.record_discarded_checkpoints(ckpt.store, discarded, from_step)
