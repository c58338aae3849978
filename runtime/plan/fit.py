"""`runtime plan --fit`: the settings that fit a target and train fastest, chosen by compiling.

A user gives a model, a target and a global batch; this searches the settings that trade memory
for speed and that users otherwise tune by trial and out-of-memory on the real hardware:

* `model.remat`: none, block, attention, attention_host, full (less memory, more
  recomputation, in that order; attention and attention_host keep the splash kernel's outputs,
  so they are tried with splash only);
* `training.loss_chunk_size`: 256, 1024, 0 (whole sequence; more memory in that order);
* `training.gradient_accumulation_steps`: 1, 2, 4, ... while each microbatch still splits over
  the batch shards (more steps, less memory);
* `model.attention`: every kernel that applies to the target's platform (TPU splash and xla,
  GPU cudnn and xla, CPU xla);
* `mesh.context` (with `mesh.fsdp`): only when nothing fits with the mesh as configured, the
  sequence split over 2, 4, 8, ... of the fsdp x context devices (less memory for activations,
  more for the gathered keys and values), each degree searched like the first.

Each candidate is compiled for the target (`runtime.plan.compile.plan`, the step `runtime
worker` runs), in worker processes where more than one can run at once. A candidate that
needs at least as much memory as one already found not to fit (the same attention, and no more
remat, no smaller loss chunks, no more accumulation) is not compiled: it cannot fit either.
More accumulation of a setting that already fits is not compiled either: the same program on
smaller microbatches is never faster. Of those that fit with at least `MIN_HEADROOM` of HBM
free, the one with the best predicted tokens/s (runtime/plan/steptime.py) wins. The cpu target
has neither an HBM figure nor chip figures for a step time, so nothing ranks its candidates: the
first that compiles (least memory first) is the pick, and the rest are not compiled.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from jobspec.errors import ConfigError

MIN_HEADROOM = 0.05
REMAT_ORDER = ("full", "attention_host", "attention", "block", "none")  # least memory first
#: Policies that keep what a fused kernel names (runtime/model/layers.py): tried with it only.
KERNEL_REMAT = {"attention": "splash", "attention_host": "splash"}
CHUNK_ORDER = (256, 1024, 0)
ATTENTION = {"tpu": ("splash", "xla"), "gpu": ("cudnn", "xla"), "cpu": ("xla",)}
GIB = 2**30


@dataclass(frozen=True)
class Candidate:
    attention: str
    remat: str
    loss_chunk_size: int
    accumulation: int
    context: int = 1
    fsdp: int = 1

    def sets(self) -> dict[str, dict[str, Any]]:
        return {
            "model": {"attention": self.attention, "remat": self.remat},
            "training": {
                "loss_chunk_size": self.loss_chunk_size,
                "gradient_accumulation_steps": self.accumulation,
            },
            "mesh": {"context": self.context, "fsdp": self.fsdp},
        }

    def needs_at_least(self, other: Candidate) -> bool:
        """Whether this candidate needs at least as much memory as `other`."""
        return (
            self.attention == other.attention
            and self.context <= other.context
            and REMAT_ORDER.index(self.remat) >= REMAT_ORDER.index(other.remat)
            and _chunk_rank(self.loss_chunk_size) >= _chunk_rank(other.loss_chunk_size)
            and self.accumulation <= other.accumulation
        )

    def slower_than(self, other: Candidate) -> bool:
        """Whether this is `other` with more accumulation: smaller microbatches of the same
        program, never faster, so not worth compiling once `other` fits."""
        return (self.attention, self.remat, self.loss_chunk_size, self.context) == (
            other.attention,
            other.remat,
            other.loss_chunk_size,
            other.context,
        ) and self.accumulation > other.accumulation


def _chunk_rank(chunk: int) -> int:
    return CHUNK_ORDER.index(chunk) if chunk in CHUNK_ORDER else len(CHUNK_ORDER)


def context_degrees(cfg) -> list[int]:
    """The `mesh.context` degrees past the configured one that --fit may try: powers of two that
    divide the fsdp x context devices and split the sequence."""
    pool, t = cfg.mesh.fsdp * cfg.mesh.context, cfg.training.seq_len
    out, c = [], 2 * cfg.mesh.context
    while pool % c == 0 and t % c == 0:
        out.append(c)
        c *= 2
    return out


def candidates(cfg, kind: str, batch_shards: int, context: int | None = None) -> list[Candidate]:
    """Every candidate for cfg on a target of `kind`, least memory first within each
    accumulation level (smallest accumulation first: the fastest when it fits); with `context`,
    the sequence split over that many of the fsdp x context devices."""
    pool = cfg.mesh.fsdp * cfg.mesh.context
    context = context or cfg.mesh.context
    fsdp = pool // context
    batch_shards = batch_shards // cfg.mesh.fsdp * fsdp
    t = cfg.training
    chunks = [c for c in CHUNK_ORDER if c < t.seq_len] or [0]
    total = sequences_per_step(cfg)
    accs = []
    a = 1
    while total % a == 0 and (total // a) % batch_shards == 0:
        accs.append(a)
        a *= 2
    if not accs:
        raise ConfigError(
            f"training.global_batch_size: {total} sequences a step do not split over the "
            f"target's {batch_shards} batch shards; use a multiple of {batch_shards}"
        )
    out = []
    for acc in accs:
        for attention in ATTENTION[kind]:
            for remat in _remats(attention):
                for chunk in chunks:
                    out.append(Candidate(attention, remat, chunk, acc, context, fsdp))
    return out


def _remats(attention: str) -> list[str]:
    """The remat policies worth compiling with `attention`, least memory first: a policy that
    keeps another kernel's outputs would keep nothing here (it would compile as full)."""
    return [r for r in REMAT_ORDER if KERNEL_REMAT.get(r, attention) == attention]


def sequences_per_step(cfg) -> int:
    """The step's global batch: global_batch_size sequences per microbatch x microbatches."""
    return cfg.training.global_batch_size * cfg.training.gradient_accumulation_steps


def _with(cfg, c: Candidate):
    from jobspec.files.run_toml import merge, resolved_dict
    from jobspec.run_config import RunConfig

    # The sequences a step trains on stay; accumulation splits them into microbatches.
    over = c.sets()
    over["training"]["global_batch_size"] = sequences_per_step(cfg) // c.accumulation
    return RunConfig.model_validate(merge(resolved_dict(cfg), over))


def _compile_one(payload: tuple) -> dict[str, Any]:
    """One candidate's plan summary (in a worker process, or in this one)."""
    cfg_dict, accelerator, hosts, slices, cand = payload
    from runtime.host import platform
    from runtime.plan.environment import prepare_environment

    platform.choose()  # a spawned worker starts as `runtime` does: no plugin it will not use
    prepare_environment(accelerator)
    from jobspec.run_config import RunConfig
    from runtime.plan.compile import plan
    from runtime.plan.targets import resolve_target

    cfg = RunConfig.model_validate(cfg_dict)
    try:
        report = plan(cfg, resolve_target(accelerator, hosts, slices))
    except Exception as e:  # noqa: BLE001 - a candidate that cannot be built is a row, not the end
        return {"candidate": cand, "error": str(e).splitlines()[0][:300]}
    m, st = report["memory"], report.get("step_time") or {}
    return {
        "candidate": cand,
        "compiled": report["compiled"],
        "fits": m["fits"],
        "peak_bytes": m.get("peak_bytes"),
        "hbm_bytes": m.get("hbm_bytes"),
        "headroom": m.get("headroom"),
        "step_seconds": st.get("step_seconds"),
        "bound": st.get("bound"),
        "compile_seconds": report["compile_seconds"],
    }


def _workers(requested: int | None) -> int:
    if requested:
        return max(1, requested)
    try:  # each compile of a real model can take a few GiB of host memory
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 * GIB
    return max(1, min(os.cpu_count() or 1, int(avail // (6 * GIB))))


@dataclass
class _Search:
    """What the search has learnt so far: the rows compiled, and what they rule out."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    failed: list[Candidate] = field(default_factory=list)  # did not fit, or did not compile
    fitted: list[Candidate] = field(default_factory=list)
    skipped: list[Candidate] = field(default_factory=list)  # need the memory of a failed one
    slower: list[Candidate] = field(default_factory=list)  # more accumulation of a fitted one
    unranked: list[Candidate] = field(default_factory=list)  # after the pick, on the cpu target

    def next_wave(
        self, pending: list[Candidate], size: int
    ) -> tuple[list[Candidate], list[Candidate]]:
        """Up to `size` candidates to compile at once, and those left for later waves; the
        candidates what is known already rules out are set aside (skipped, slower)."""
        wave: list[Candidate] = []
        rest: list[Candidate] = []
        for c in pending:
            if any(c.needs_at_least(f) for f in self.failed):
                self.skipped.append(c)
            elif any(c.slower_than(f) for f in self.fitted):
                self.slower.append(c)
            elif len(wave) < size and not any(c.needs_at_least(w) for w in wave):
                wave.append(c)  # a wave holds no candidate another in it could rule out
            else:
                rest.append(c)
        return wave, rest

    def record(self, r: dict[str, Any], tokens_per_step: int) -> None:
        """Keep one compiled candidate's row, with its predicted tokens/s."""
        c = r["candidate"]
        if r.get("fits") is False or not r.get("compiled", True):
            self.failed.append(c)
        elif r.get("compiled"):
            self.fitted.append(c)
        r["predicted_tokens_per_s"] = (
            round(tokens_per_step / r["step_seconds"]) if r.get("step_seconds") else None
        )
        self.rows.append(r)

    def pick(self) -> dict[str, Any] | None:
        """The fastest row that fits with MIN_HEADROOM to spare."""
        # A target without an HBM figure (cpu) cannot say it fits; what compiled there is eligible.
        eligible = [
            r for r in self.rows
            if r.get("compiled") and r.get("fits") is not False
            and (r.get("headroom") is None or r["headroom"] >= MIN_HEADROOM)
        ]  # fmt: skip
        ranked = sorted(eligible, key=lambda r: -(r["predicted_tokens_per_s"] or 0))
        return ranked[0] if ranked else None


def _pool(workers: int) -> ProcessPoolExecutor | None:
    """Compile workers, spawned (a fork of a process running jax may deadlock); None for one."""
    if workers <= 1:
        return None
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def fit(
    cfg,
    accelerator: str,
    hosts: int | None,
    slices: int,
    *,
    jobs: int | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Search the candidates; returns the rows tried (in order), the skipped ones and the pick."""
    from jobspec.files.run_toml import resolved_dict
    from runtime.plan.targets import check_mesh, resolve_target

    target = resolve_target(accelerator, hosts, slices)
    check_mesh(cfg.mesh.size, cfg.mesh.slices, target)
    batch_shards = cfg.mesh.slices * cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.expert
    pending = candidates(cfg, target.kind, batch_shards)
    # More context only when nothing fits with the mesh as configured.
    more_context = [candidates(cfg, target.kind, batch_shards, c) for c in context_degrees(cfg)]
    tokens_per_step = cfg.training.tokens_per_step
    search = _Search()
    # Without a step time (cpu) the first candidate that compiles is the pick: one at a time.
    ranked = target.kind != "cpu"
    workers = _workers(jobs) if ranked else 1
    pool = _pool(workers)
    try:
        while pending or (more_context and search.pick() is None):
            if not pending:
                pending = more_context.pop(0)
            if not ranked and search.pick() is not None:
                search.unranked, pending = pending, []
                break
            wave, pending = search.next_wave(pending, workers)
            payloads = [(resolved_dict(_with(cfg, c)), accelerator, hosts, slices, c) for c in wave]
            results = (
                list(pool.map(_compile_one, payloads))
                if pool
                else [_compile_one(p) for p in payloads]
            )
            for r in results:
                search.record(r, tokens_per_step)
                if progress:
                    progress(r)
    finally:
        if pool:
            pool.shutdown()
    rows = search.rows
    return {
        "target": target.describe(),
        "sequences_per_step": sequences_per_step(cfg),
        "tried": rows,
        "skipped": [c.__dict__ for c in search.skipped],
        "not_compiled_slower": [c.__dict__ for c in search.slower],
        "not_compiled_unranked": [c.__dict__ for c in search.unranked],
        "pick": search.pick(),
        "smallest_peak_bytes": min(
            (r["peak_bytes"] for r in rows if r.get("peak_bytes")), default=None
        ),
    }


def overlay_toml(
    pick: Candidate,
    sequences: int,
    config_path: str,
    overlay_path: str,
    accelerator: str,
    mesh_as_configured: tuple[int, int] = (1, 1),
) -> str:
    """A run config that is CONFIG with the picked settings: `runtime local OVERLAY` trains it
    (a [mesh] table too when the pick split the sequence differently from CONFIG's
    `mesh_as_configured` (context, fsdp))."""
    rel = os.path.relpath(
        os.path.abspath(config_path), os.path.dirname(os.path.abspath(overlay_path))
    )
    mesh = (
        f"\n[mesh]\ncontext = {pick.context}\nfsdp = {pick.fsdp}\n"
        if (pick.context, pick.fsdp) != mesh_as_configured
        else ""
    )
    return (
        f"# runtime plan --fit for {accelerator}: the settings that fit and train fastest\n"
        f"include = [{rel!r}]\n\n"
        f"[model]\nattention = {pick.attention!r}\nremat = {pick.remat!r}\n\n"
        f"[training]\nglobal_batch_size = {sequences // pick.accumulation}\n"
        f"gradient_accumulation_steps = {pick.accumulation}\n"
        f"loss_chunk_size = {pick.loss_chunk_size}\n{mesh}"
    ).replace("'", '"')
