"""The host loop around the pure train step: data in, metrics and checkpoints out, signals.

It owns I/O, timing and signals; all math lives in train_step.py. Every host runs this same
loop; host-global files go through the ArtifactStore, which only the writer may use for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jobspec.errors import CheckpointError, ConfigError
from jobspec.exit_codes import EXIT_RESTARTABLE
from jobspec.load import resolved_dict
from jobspec.run_config import RunConfig
from jobspec.storage import configure_gcs_env, join
from runtime.data.loader import TokenBatches, check_for_run, train_batches
from runtime.data.prepare import ensure_manifest
from runtime.host import boot
from runtime.host.coordination import HostWatchdog, StopAgreement
from runtime.model.build import build_model
from runtime.model.sharding import batch_sharding, build_mesh, replicated
from runtime.run import artifacts
from runtime.run.checkpoint import CheckpointService, reconciled_entries
from runtime.run.compat import check_compatible, fingerprint
from runtime.run.store import ArtifactStore
from runtime.train.evaluate import Evaluator
from runtime.train.metrics import Throughput
from runtime.train.optim import build_optimizer
from runtime.train.state import opt_state_shardings, others_from_saved
from runtime.train.step import make_train_step


@dataclass
class TrainResult:
    status: str  # completed | interrupted | stopped
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
    state: dict
    start_step: int
    data_state: dict | None
    decay_steps: int
    fingerprint: dict
    batch_sharding: Any
    global_shape: tuple[int, int, int]


def _emit(line: str) -> None:
    print(line, flush=True)


def _open_run(cfg: RunConfig, resume: bool | str, writer_index: int) -> tuple[ArtifactStore, bool]:
    """The run's store, after checking that starting or resuming is what the index allows.

    Reads checkpoints/index.json and the committed step folders only; Orbax is not touched until the config and data are known
    to fit, so a bad input ends before any checkpoint machinery starts.
    """
    store = ArtifactStore(
        join(cfg.run.output_uri, cfg.run.id),
        process_index=jax.process_index(),
        writer_index=writer_index,
    )
    store.check_writable()
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


def _prepare(
    cfg: RunConfig, source_toml: str, resume: bool, reshard: bool, store, ckpt, manifest, mesh
) -> Run:
    fp = fingerprint(
        cfg,
        manifest_fingerprint=manifest.fingerprint,
        tokenizer_id=manifest.tokenizer.id,
        process_count=jax.process_count(),
    )
    total_steps = cfg.training.total_steps
    start_step = ckpt.resolve("latest") if resume else 0
    if resume:
        # Before Orbax reads anything; with --reshard Orbax lays the arrays out for this mesh.
        check_compatible(ckpt.fingerprint(start_step), fp, step=start_step, reshard=reshard)

    parts = build_model(cfg.model, cfg.run.seed, mesh, materialise=not resume)
    # The optimizer state's structure does not depend on the schedule length, so the shardings
    # can come from a provisional optimizer before a resumed run learns its decay_steps.
    provisional, _ = build_optimizer(
        cfg.optimizer, cfg.optimizer.schedule.decay_steps or total_steps
    )
    o_sh = opt_state_shardings(provisional, parts.params, parts.param_shardings, mesh)
    rep = replicated(mesh)
    data_state = None
    if resume:
        abstract_opt = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(provisional.init, parts.params),
            o_sh,
        )
        params, opt_state, meta = ckpt.restore(
            start_step, params_target=parts.params, opt_state_target=abstract_opt
        )
        rng = jax.device_put(np.asarray(meta["rng"], dtype=np.uint32), rep)
        decay_steps = int(meta["decay_steps"])
        saved = meta["data_state"]
        data_state = saved.get(str(jax.process_index()), saved["0"])
    else:
        params = parts.params
        opt_state = jax.jit(provisional.init, out_shardings=o_sh)(params)
        rng = jax.device_put(jax.random.PRNGKey(cfg.run.seed), rep)
        decay_steps = cfg.optimizer.schedule.decay_steps or total_steps
    tx, schedule = build_optimizer(cfg.optimizer, decay_steps)
    state = {
        "params": params,
        "opt_state": opt_state,
        "step": jax.device_put(jnp.asarray(start_step, jnp.int32), rep),
        "rng": rng,
    }
    state_sh = {"params": parts.param_shardings, "opt_state": o_sh, "step": rep, "rng": rep}
    rate = cfg.model.router_bias_update_rate
    if rate > 0:
        # MoE routing biases move outside the gradient each step, so they are train state too
        # (and are checkpointed in meta, see _save).
        others = parts.others
        if resume and "router_bias" in meta:
            others = others_from_saved(parts.others, meta["router_bias"], rep)
        state["others"] = others
        state_sh["others"] = jax.tree.map(lambda _: rep, others)

    t = cfg.training
    batches = train_batches(
        manifest, cfg.data, t, cfg.run.seed, jax.process_index(), jax.process_count()
    )
    b_sh = batch_sharding(mesh, 3, leading=1)
    step_fn = jax.jit(
        make_train_step(
            parts.graphdef,
            parts.others,
            tx,
            schedule,
            objective=t.objective,
            pg_clip_epsilon=t.pg_clip_epsilon,
            router_bias_update_rate=rate,
        ),
        in_shardings=(state_sh, b_sh),
        out_shardings=(state_sh, rep),
        donate_argnums=0,
    )
    art = artifacts.RunArtifacts(store, cfg, source_toml)
    art.start(
        resume=resume,
        start_step=start_step,
        total_steps=total_steps,
        diagnostics=artifacts.runtime_diagnostics(
            cfg, mesh, manifest, batches, parts.param_shardings
        ),
    )
    return Run(
        cfg=cfg, store=store, ckpt=ckpt, art=art, batches=batches,
        evaluator=Evaluator(cfg, manifest, parts, mesh), step_fn=step_fn, state=state,
        start_step=start_step, data_state=data_state, decay_steps=decay_steps, fingerprint=fp,
        batch_sharding=b_sh, global_shape=(t.gradient_accumulation_steps, t.global_batch_size, t.seq_len),
    )  # fmt: skip


def train(
    cfg: RunConfig,
    source_toml: str,
    *,
    resume: bool | str,
    max_steps: int | None = None,
    writer_index: int = 0,
    reshard: bool = False,
    emit: Callable[[str], None] = _emit,
) -> TrainResult:
    """Train to target_tokens (or `max_steps` more steps, then checkpoint and stop).

    Every host of a job calls this with the same arguments after `boot.boot()`; `writer_index`
    is the host that writes host-global files (agreed by `writer.elect_writer`). `resume="auto"`
    continues from the latest committed checkpoint if there is one, else starts.
    """
    configure_gcs_env()
    t_start = time.perf_counter()
    store, resume = _open_run(cfg, resume, writer_index)
    manifest = ensure_manifest(cfg.data, is_writer=store.is_writer)
    check_for_run(manifest, cfg.data, cfg.model.vocab_size, cfg.training)
    mesh = build_mesh(cfg.mesh)
    ckpt = CheckpointService(store, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_)
    try:
        run = _prepare(cfg, source_toml, resume, reshard, store, ckpt, manifest, mesh)
    except BaseException:
        ckpt.close()
        raise
    if resume:
        emit(
            f"resumed {cfg.run.id} from checkpoint {run.start_step}; training to step {cfg.training.total_steps}"
        )
    info = boot.current()
    stop = StopAgreement(run_id=cfg.run.id, attempt=info.attempt if info else 0)
    stop.install()
    watchdog = HostWatchdog(
        timeout_s=cfg.runtime.host_loss_timeout_s,
        run_id=cfg.run.id,
        attempt=info.attempt if info else 0,
    )
    watchdog.start()
    step = run.start_step
    try:
        result = _loop(run, stop, max_steps, emit, t_start)
        watchdog.mark_done()
        return result
    except BaseException as e:
        # A collective that failed because a peer died: let the watchdog name the lost host.
        watchdog.explain_failure(e)
        # What was committed stays; the failure is recorded; a half-save never becomes latest.
        run.art.fail(step, e)
        raise
    finally:
        stop.restore()
        ckpt.close()


def _loop(
    run: Run, stop: StopAgreement, max_steps: int | None, emit, t_start: float
) -> TrainResult:
    cfg, t = run.cfg, run.cfg.training
    total_steps = t.total_steps
    end_step = total_steps if max_steps is None else min(total_steps, run.start_step + max_steps)
    meter = Throughput(t.tokens_per_step, run.art.flops_per_token, run.art.job_peak_flops)
    pending: list[tuple[int, dict, dict]] = []  # (step, device metrics, provenance) until next sync
    last_row: dict | None = None
    step = run.start_step
    with run.batches.iterate(run.start_step) as it:
        if run.data_state is not None:
            it.set_state(run.data_state)
        while step < end_step:
            item = next(it)
            batch = {
                k: jax.make_array_from_process_local_data(run.batch_sharding, v, run.global_shape)
                for k, v in item.batch.items()
            }
            run.state, m = run.step_fn(run.state, batch)
            step += 1
            pending.append((step, m, item.provenance))
            if step == run.start_step + 1:
                # The first step of an attempt includes compilation: time it alone, then start
                # the throughput clock, so tokens/s measures steady-state steps only.
                jax.block_until_ready(m)
                run.art.event(
                    "first_step", step=step, seconds_since_start=time.perf_counter() - t_start
                )
                meter.mark(step)
            run.ckpt.poll()
            stopping = stop.should_stop(step)  # every host agrees on the same step
            last = step == end_step or stopping
            eval_now = t.eval_every > 0 and step % t.eval_every == 0 and step < total_steps
            save_now = (
                cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0 and step < total_steps
            )
            if step % t.log_every == 0 or last or eval_now or save_now:
                last_row = run.art.flush_train_rows(pending, meter, emit) or last_row
                pending = []
            eval_metrics = (
                run.evaluator.run(run.state["params"], step, run.art, emit, run.state.get("others"))
                if eval_now
                else None
            )
            if save_now:
                _save(run, step, eval_metrics)
            if eval_now or save_now:
                meter.mark(step)  # eval and save time is not training throughput
            if stopping:
                break

    wall = time.perf_counter() - t_start
    if stop.stop_step is not None:
        name = stop.reason or "signal"
        if cfg.checkpoint.on_signal:
            _save(run, step, None)
            run.ckpt.wait()
        emit(
            f"{name} received: stopped at step {step}"
            + (", checkpoint saved" if cfg.checkpoint.on_signal else "")
        )
        summary = run.art.finish(
            "interrupted", step, last_row, run.ckpt.read_index(), wall, signal=name
        )
        return TrainResult("interrupted", EXIT_RESTARTABLE, summary)
    if step < total_steps:  # --max-steps reached
        _save(run, step, None)
        run.ckpt.wait()
        emit(
            f"stopped after {step - run.start_step} steps (--max-steps) at step {step}, checkpoint saved"
        )
        summary = run.art.finish("stopped", step, last_row, run.ckpt.read_index(), wall)
        return TrainResult("stopped", 0, summary)
    eval_metrics = (
        run.evaluator.run(run.state["params"], step, run.art, emit, run.state.get("others"))
        if cfg.evals
        else None
    )
    _save(run, step, eval_metrics)
    run.ckpt.wait()
    summary = run.art.finish(
        "completed", step, last_row, run.ckpt.read_index(), time.perf_counter() - t_start
    )
    return TrainResult("completed", 0, summary)


def _save(run: Run, step: int, eval_metrics: dict[str, float] | None) -> None:
    meta = {
        "step": step,
        "tokens": step * run.cfg.training.tokens_per_step,
        "rng": np.asarray(jax.device_get(run.state["rng"])).tolist(),
        "decay_steps": run.decay_steps,
        # The loader's state is process-count independent; each process records its own.
        "data_state": {str(jax.process_index()): run.batches.state_for(step)},
        "fingerprint": run.fingerprint,
        "config": resolved_dict(run.cfg),
    }
    if "others" in run.state:  # MoE router biases: small fp32 vectors, exact through JSON
        meta["router_bias"] = [
            np.asarray(x).tolist() for x in jax.tree.leaves(jax.device_get(run.state["others"]))
        ]
    metrics = {"val_loss": eval_metrics[run.cfg.evals[0].name]} if eval_metrics else None
    if run.ckpt.save(
        step,
        params=run.state["params"],
        opt_state=run.state["opt_state"],
        meta=meta,
        metrics=metrics,
    ):
        run.art.event("checkpoint", step=step, metrics=metrics)
