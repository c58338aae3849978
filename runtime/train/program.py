"""The jitted train step exactly as a run compiles it, and the same step in abstract form.

`train_program` is the one place the train step is wrapped in `jax.jit` (shardings, donation,
the activation mesh for sharding constraints). The train loop calls it with real parameters;
`runtime plan` calls `abstract_program` and lowers the result for a target's compile-only
devices: the same function, shardings and donation, with ShapeDtypeStructs for every argument.
"""

from __future__ import annotations

import atexit
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jobspec.run_config import RunConfig
from runfolder.background import in_background
from runtime.host import compile_cache
from runtime.model.attention import kernels as attention
from runtime.model.build import ModelParts, build_model
from runtime.model.sharding import batch_sharding, on_mesh, replicated
from runtime.train.optim import build_optimizer
from runtime.train.state import TrainState, abstract_opt_state, state_shardings
from runtime.train.step import BATCH_KEYS, PG_BATCH_KEYS, make_train_step

_FLOAT_KEYS = {"loss_mask", *PG_BATCH_KEYS}

#: What a compile that runs out of device memory says (XLA's TPU compiler raises; the CPU and GPU
#: compilers do not check memory).
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|exceeds available HBM|Ran out of memory", re.I)


def remat_choices(cfg: RunConfig, platform: str) -> tuple[str, ...]:
    """The remat policies to compile in turn, the first that fits the devices taken: the config's
    own, or for "auto" "attention" then "full" where the attention kernel is splash (the only
    kernel whose outputs "attention" keeps; without it "attention" is "full")."""
    remat = cfg.model.remat
    if remat != "auto":
        return (remat,)
    if attention.resolve(cfg.model.attention, platform) == "splash" and platform == "tpu":
        return ("attention", "full")
    return ("full",)


def with_remat(cfg: RunConfig, remat: str) -> RunConfig:
    """cfg with `model.remat` set (a resolved "auto")."""
    if cfg.model.remat == remat:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"remat": remat})})


def compile_first_fitting(
    cfg: RunConfig,
    platform: str,
    compile_one: Callable[[RunConfig], tuple[AbstractProgram, object]],
) -> tuple[AbstractProgram, object]:
    """compile_one(cfg with each of `remat_choices` in turn) -> (program, compiled) of the first
    that compiles within the devices' memory; the last choice's out-of-memory error is raised (or,
    where `compile_one` returns it in place of a compiled program, returned)."""
    choices = remat_choices(cfg, platform)
    for i, remat in enumerate(choices):
        last = i == len(choices) - 1
        try:
            prog, compiled = compile_one(with_remat(cfg, remat))
        except Exception as e:
            if last or not OUT_OF_MEMORY.search(str(e)):
                raise
            continue
        if last or not isinstance(compiled, Exception):
            return prog, compiled
    raise AssertionError("unreachable: the last choice returns or raises")


def train_program(
    cfg: RunConfig,
    parts: ModelParts,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    state_sh: TrainState,
    mesh: Mesh,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted (state, batch) -> (state, metrics) step; the state argument is donated."""
    t = cfg.training
    step = make_train_step(
        parts.graphdef,
        tx,
        schedule,
        objective=t.objective,
        pg_clip_epsilon=t.pg_clip_epsilon,
        router_bias_update_rate=cfg.model.router_bias_update_rate,
        loss_chunk_size=t.loss_chunk_size,
        logits_dtype=t.logits_dtype,
        count_dropped=cfg.model.moe_capacity_factor is not None,
        skip_nonfinite=t.on_nonfinite == "skip_step",
    )

    return jax.jit(
        on_mesh(step, mesh),
        in_shardings=(state_sh, batch_sharding(mesh, 3, leading=1)),
        out_shardings=(state_sh, replicated(mesh)),
        donate_argnums=0,
    )


def batch_keys(cfg: RunConfig) -> tuple[str, ...]:
    """The arrays a train batch carries for this config's objective."""
    if cfg.training.objective == "clipped_pg":
        return BATCH_KEYS + PG_BATCH_KEYS
    return BATCH_KEYS


def abstract_batch(cfg: RunConfig, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """One global train batch [accum, global_batch_size, seq_len] as ShapeDtypeStructs."""
    t = cfg.training
    shape = (t.gradient_accumulation_steps, t.global_batch_size, t.seq_len)
    sh = batch_sharding(mesh, 3, leading=1)
    return {
        k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in _FLOAT_KEYS else jnp.int32, sharding=sh)
        for k in batch_keys(cfg)
    }


@dataclass(frozen=True)
class AbstractProgram:
    """The run's train step with abstract arguments: `step.lower(state, batch)` compiles it."""

    step: Callable
    state: TrainState
    batch: dict[str, jax.ShapeDtypeStruct]
    parts: ModelParts
    cfg: RunConfig  # the config it was built from (a resolved remat "auto": see remat_choices)


def default_decay_steps(cfg: RunConfig) -> int:
    """The schedule's length for a run that starts afresh (a resumed one keeps its own)."""
    return cfg.optimizer.schedule.decay_steps or cfg.training.total_steps


def abstract_program(cfg: RunConfig, mesh: Mesh, decay_steps: int | None = None) -> AbstractProgram:
    """What `runtime worker` would compile on `mesh`, with no array materialised or data read
    (`decay_steps`: the schedule's length, `default_decay_steps` unless given)."""
    parts = build_model(cfg.model, cfg.run.seed, mesh, materialise=False, abstract_others=True)
    tx, schedule = build_optimizer(cfg.optimizer, decay_steps or default_decay_steps(cfg))
    state_sh = state_shardings(parts, tx, mesh)
    rep = state_sh.step
    state = TrainState(
        params=parts.params,
        opt_state=abstract_opt_state(tx, parts.params, state_sh),
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
        model_state=parts.others,
    )
    step = train_program(cfg, parts, tx, schedule, state_sh, mesh)
    return AbstractProgram(
        step=step, state=state, batch=abstract_batch(cfg, mesh), parts=parts, cfg=cfg
    )


@dataclass
class AheadTimes:
    """When the ahead compile's thread started, finished lowering and finished compiling
    (perf_counter seconds; None until then), whether XLA's program came from the persistent
    compilation cache, and the remat policy it was compiled with (remat "auto" resolved)."""

    started: float | None = None
    lowered: float | None = None
    done: float | None = None
    from_cache: bool = False
    remat: str | None = None


class AheadStep:
    """The train step, lowered and compiled on a background thread while the model is built (or
    its checkpoint restored).

    `compile_ahead` traces and lowers the run's step from abstract arguments (the program
    `runtime plan` compiles) and compiles it on a thread, so the step's tracing and XLA's compile
    run beside the parameter init or the restore instead of one after the other. The first call
    takes that compiled program when it matches what the run built (the schedule's length; the
    arguments' shapes and shardings, which the compiled program checks itself); otherwise the
    jitted step compiles as it always did. A step that cannot be traced raises at
    `wait_lowered` (before the run writes its records); one that does not compile (out of
    memory) raises at the first step, as the jitted step's own compile would."""

    def __init__(
        self, lowered_for: int, lowering: Future, future: Future, times: AheadTimes
    ) -> None:
        self.decay_steps = lowered_for
        self._lowering = lowering
        self._future: Future | None = future
        self._jitted: Callable | None = None
        self._compiled: Callable | None = None
        self.times = times
        self.used = False  # whether the steps run the program compiled ahead
        self.waited_s = 0.0  # how long the first step waited for the compile to finish

    def bind(self, jitted: Callable, decay_steps: int) -> AheadStep:
        """The run's own jitted step, and its schedule's length (a resumed run's may differ)."""
        self._jitted = jitted
        if decay_steps != self.decay_steps:
            self._future = None
        return self

    def wait_lowered(self) -> None:
        """Raise what tracing the step raised (a config the step cannot run), on this thread."""
        self._lowering.result()

    @property
    def pending(self) -> bool:
        """Whether the first call will take the program compiled ahead (if it matches)."""
        return self._future is not None

    def __call__(self, state: TrainState, batch: dict[str, jax.Array]):
        if self._compiled is not None:
            return self._compiled(state, batch)
        assert self._jitted is not None, "AheadStep.bind() first"
        future, self._future = self._future, None
        if future is not None:
            try:
                t0 = time.perf_counter()
                compiled = future.result()
                self.waited_s = time.perf_counter() - t0
                out = compiled(state, batch)  # checks the arguments before it runs
            except (TypeError, ValueError):  # not this run's program: nothing was donated
                pass
            else:
                self._compiled, self.used = compiled, True
                return out
        self._compiled = self._jitted
        return self._jitted(state, batch)


def compile_ahead(cfg: RunConfig, mesh: Mesh, decay_steps: int | None = None) -> AheadStep:
    """Lower and compile on a thread the train step of a run whose schedule is `decay_steps`
    long (a fresh run's, `default_decay_steps`, unless given; see `AheadStep`)."""
    decay = decay_steps or default_decay_steps(cfg)
    times, lowering = AheadTimes(), Future()

    def compile_one(c: RunConfig):
        try:
            prog = abstract_program(c, mesh, decay)
            lowered = prog.step.lower(prog.state, prog.batch)
        except BaseException as e:
            if not lowering.done():
                lowering.set_exception(e)
            raise
        if not lowering.done():
            times.lowered = time.perf_counter()
            lowering.set_result(None)
        hits = compile_cache.hits_on_this_thread()
        compiled = lowered.compile()
        times.from_cache = compile_cache.hits_on_this_thread() > hits
        times.remat = c.model.remat
        return prog, compiled

    def lower_and_compile():
        times.started = time.perf_counter()
        platform = mesh.devices.flat[0].platform
        _, compiled = compile_first_fitting(cfg, platform, compile_one)
        times.done = time.perf_counter()
        return compiled

    compile_cache.count_hits()
    future = in_background(lower_and_compile, "jaxjob-compile-ahead")
    # A run that ends before its first step (a refused resume, a bad input) must let the compile
    # finish before Python tears down: a thread still inside XLA then aborts the process
    # (SIGABRT, "exception not rethrown") instead of its own exit code. Registered now, after
    # JAX's own exit handlers, so it runs before them.
    atexit.register(wait, [future])
    return AheadStep(decay, lowering, future, times)
