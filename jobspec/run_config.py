"""RunConfig: the `cfg.toml` every host trains from.

Section and key names are the documented contract (docs/config.md, generated from these models);
unknown keys are errors. Nothing here imports jax.
"""

from __future__ import annotations

import math
import re
from pathlib import PurePosixPath
from typing import Annotated, Literal, NamedTuple, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jobspec.families import AnyModelConfig
from jobspec.section import NonNegativeInt, PositiveFloat, PositiveInt, Section

# A step number or count of steps: the train state counts steps in int32.
MAX_STEPS = 2**31 - 1
StepCount = Annotated[int, Field(ge=0, le=MAX_STEPS)]
PositiveStepCount = Annotated[int, Field(gt=0, le=MAX_STEPS)]
# JAX's PRNG seeds are signed 64-bit integers.
MAX_SEED = 2**63 - 1
# Far beyond any corpus trained on (frontier runs are ~1e13 tokens): a larger value is a typo.
MAX_TARGET_TOKENS = 10**16
NONFINITE_POLICIES = ("stop", "skip_step")

# Always fullmatch: `$` alone also matches before a trailing newline ("name\n").
RUN_ID_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _number_outside(value: object, lo: float, hi: float) -> bool:
    """A number (not a bool) outside [lo, hi], NaN and infinities included."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not lo <= value <= hi


def check_dns_label(value: str, what: str, max_len: int = 63) -> str:
    """`value` if it is a DNS-1123 label of at most max_len characters, else the one error
    every run id, job name and JAXJOB_RUN_ID gives (`what` names the field)."""
    if len(value) > max_len or not RUN_ID_RE.fullmatch(value):
        raise ValueError(
            f"{what}{value!r} is not a DNS-1123 label: use 1-{max_len} lowercase letters, digits or "
            "'-', starting and ending with a letter or digit"
        )
    return value


def is_remote(uri: str) -> bool:
    """Whether a location the configs name (run.output_uri, a data glob, a prepare folder) is a
    URI of an object store (gs://...) rather than a path on this machine (`file://` is local)."""
    return "://" in uri and not uri.startswith("file://")


class RunSection(Section):
    """Identity and destination of the run."""

    id: str = Field(description="Run id, a DNS-1123 label (lowercase letters, digits, '-').")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = Field(
        0,
        description="Seed for parameter init, data order and dropout-free RNG; 0 to 2**63 - 1 "
        "(what JAX's PRNG takes).",
    )
    output_uri: str = Field(
        "runs",
        description="Where `<id>/` with artifacts and checkpoints goes: a local path or gs://bucket/prefix.",
    )

    @field_validator("seed", mode="before")
    @classmethod
    def _check_seed(cls, value: object) -> object:
        if _number_outside(value, 0, MAX_SEED):
            raise ValueError(
                f"not a seed JAX's PRNG takes; use an integer from 0 to 2**63 - 1 ({MAX_SEED:,})"
            )
        return value

    @model_validator(mode="after")
    def _check_id(self) -> RunSection:
        check_dns_label(self.id, "run id ")
        return self


class ScheduleConfig(Section):
    """Learning-rate schedule: linear warmup, then decay to min_lr_ratio × lr."""

    kind: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Shape after warmup."
    )
    warmup_steps: StepCount = Field(0, description="Linear warmup from 0 to lr.")
    decay_steps: PositiveStepCount | None = Field(
        None,
        description=(
            "Steps from start to the end of decay. Unset: the first run's total steps; a resumed run "
            "keeps the value its checkpoint recorded, so raising target_tokens continues at the floor."
        ),
    )
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.1, description="Final lr as a fraction of lr."
    )


class OptimizerConfig(Section):
    """AdamW with a schedule and global-norm clipping."""

    name: Literal["adamw"] = Field("adamw", description="Optimizer.")
    lr: Annotated[float, Field(gt=0, le=10)] = Field(
        3e-4, description="Peak learning rate; at most 10."
    )
    b1: Annotated[float, Field(ge=0, lt=1)] = Field(0.9, description="Adam first-moment decay.")
    b2: Annotated[float, Field(ge=0, lt=1)] = Field(0.95, description="Adam second-moment decay.")
    eps: Annotated[float, Field(gt=0, le=1)] = Field(1e-8, description="Adam epsilon; at most 1.")
    weight_decay: Annotated[float, Field(ge=0, le=10)] = Field(
        0.1,
        description="Decoupled weight decay on matrices (norm scales are not decayed); at most 10.",
    )
    grad_clip_norm: PositiveFloat | None = Field(
        1.0, description="Global-norm clip; unset to disable."
    )
    schedule: ScheduleConfig = ScheduleConfig()


class PrepareConfig(Section):
    """How to make the manifest on first use when it does not exist yet."""

    inputs: list[str] = Field(
        min_length=1,
        description=(
            "Globs (local or gs://) of *.parquet, *.jsonl[.gz|.zst] or text files (any other file is "
            "one document); '{stdlib}' expands to this Python's standard-library folder."
        ),
    )
    text_field: str = Field(
        "text", min_length=1, description="The JSONL key or parquet column holding the text."
    )
    workers: PositiveInt | None = Field(
        None, description="Processes tokenizing at once on the writer host (default: its cores)."
    )
    format: Literal["text", "rollouts"] = Field(
        "text",
        description=(
            "text: documents (files, or JSONL 'text' fields) packed into a token stream; rollouts: "
            "JSONL rollouts (prompt, completion, advantages, old_logprobs), one per row."
        ),
    )
    tokenizer: str = Field("byte", description="'byte' or a path or URI of a tokenizer.json.")
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.05, description="Share of documents held out as the validation split."
    )
    max_bytes: PositiveInt | None = Field(
        None, description="Stop reading inputs after this many bytes."
    )


# The orders a run reads its records in (data.order; runtime/data/order.py implements each).
DataOrder = Literal["sequential", "shuffle", "document_buffer"]
DATA_ORDERS: tuple[DataOrder, ...] = get_args(DataOrder)

# Samples per mixture block: each block of a [[data.sources]] mixture holds every source's share of
# it exactly (docs/data.md, "Mixtures"), so a source needs at least 1/MIXTURE_BLOCK of the total weight.
MIXTURE_BLOCK = 4096


def default_source_name(manifest: str) -> str:
    """A source's default name: the folder its manifest.json is in ("data/web/manifest.json": web)."""
    return PurePosixPath(manifest.rstrip("/")).parent.name


class SourceConfig(Section):
    """One prepared-token manifest of a `[[data.sources]]` mixture."""

    manifest: str = Field(
        description=(
            "A mixture source (instead of data.manifest): path or URI of its prepared-token "
            "manifest.json; every source has the same tokenizer and the text (stream) layout."
        )
    )
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        description=(
            "Relative share of the rows drawn from the source; the weights are normalised, so "
            f"they need not sum to 1 (each source needs at least 1/{MIXTURE_BLOCK} of the total)."
        )
    )
    name: str | None = Field(
        None,
        min_length=1,
        description=(
            "The source's label in train rows (tokens_per_source) and errors; default: the "
            "manifest's folder name. Unique within the mixture."
        ),
    )


class DataSource(NamedTuple):
    """One dataset a run reads: its name, manifest, and normalised share of the rows."""

    name: str
    manifest: str
    share: float


class DataConfig(Section):
    manifest: str | None = Field(
        None,
        description="Path or URI of a prepared-token manifest.json (or give [[data.sources]] instead).",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        min_length=1,
        description='A weighted mixture of several manifests instead of data.manifest (docs/data.md, "Mixtures").',
    )
    tokenizer: str | None = Field(
        None,
        description="Expected tokenizer id ('byte' or tokenizer.json path); must match the manifest's.",
    )
    order: DataOrder = Field(
        "shuffle",
        description=(
            "sequential: fixed windows in stream order; shuffle: the same windows permuted per epoch; "
            "document_buffer: documents permuted and packed, joins masked out of the loss."
        ),
    )
    prefetch: NonNegativeInt = Field(
        2, description="Global batches the loader prepares ahead (threads)."
    )
    prepare: PrepareConfig | None = Field(
        None, description="Make the manifest on first use if absent."
    )

    @field_validator("sources")
    @classmethod
    def _name_sources(cls, sources: list[SourceConfig] | None) -> list[SourceConfig] | None:
        """Fill each unnamed source's name, so the resolved config and checkpoints record it."""
        if sources is None:
            return None
        out = []
        for i, s in enumerate(sources):
            name = s.name or default_source_name(s.manifest)
            if not name:
                raise ValueError(
                    f"data.sources[{i}] has no name and its manifest {s.manifest!r} is not inside a "
                    f"folder to name it after; set data.sources[{i}].name"
                )
            out.append(s if s.name else s.model_copy(update={"name": name}))
        return out

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if (self.manifest is None) == (self.sources is None):
            given = "both" if self.sources is not None else "neither"
            raise ValueError(
                "set exactly one of data.manifest (one prepared dataset) and [[data.sources]] (a "
                f"weighted mixture of several); this config sets {given}"
            )
        if self.sources is None:
            return self
        if self.prepare is not None:
            raise ValueError(
                "data.prepare makes one manifest and does not combine with [[data.sources]]; "
                "prepare each source with `runtime data prepare` and point its manifest at the result"
            )
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(
                f"data.sources names must be unique, got {names} (a name defaults to the folder of "
                "its manifest); set distinct data.sources[].name values"
            )
        total = sum(s.weight for s in self.sources)
        for i, s in enumerate(self.sources):
            if s.weight / total * MIXTURE_BLOCK < 1:
                raise ValueError(
                    f"data.sources[{i}].weight ({s.weight:g}) is {s.weight / total:.3g} of the total, "
                    f"below 1/{MIXTURE_BLOCK}, the smallest share a mixture draws; raise it or "
                    "remove the source"
                )
        return self

    @property
    def datasets(self) -> list[DataSource]:
        """Every dataset the run reads: the sources with their weights normalised, or the one
        manifest (share 1), named like a source would be."""
        if self.sources is None:
            manifest = self.manifest or ""
            return [DataSource(default_source_name(manifest), manifest, 1.0)]
        total = sum(s.weight for s in self.sources)
        return [DataSource(s.name or "", s.manifest, s.weight / total) for s in self.sources]


class TrainingConfig(Section):
    objective: Literal["cross_entropy", "clipped_pg"] = Field(
        "cross_entropy",
        description=(
            "cross_entropy: next-token loss; clipped_pg: PPO/GRPO-style clipped policy gradient on "
            "the per-token advantages and old log-probs of a rollouts manifest."
        ),
    )
    pg_clip_epsilon: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.2, description="clipped_pg: ratio clip range [1 - eps, 1 + eps]."
    )
    seq_len: PositiveInt = Field(description="Tokens per training row.")
    global_batch_size: PositiveInt = Field(description="Sequences per microbatch across all hosts.")
    gradient_accumulation_steps: PositiveInt = Field(
        1, description="Microbatches per optimizer step."
    )
    target_tokens: Annotated[int, Field(gt=0, le=MAX_TARGET_TOKENS)] = Field(
        description=(
            "Train until this many tokens have been consumed: at least one step's "
            "(global_batch_size x gradient_accumulation_steps x seq_len), at most 1e16."
        )
    )
    log_every: PositiveStepCount = Field(
        10, description="Steps between live lines and host syncs (every step gets a metrics row)."
    )
    eval_every: StepCount = Field(
        0, description="Steps between evals; 0 runs evals only at the end."
    )
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        "stop",
        description=(
            "A NaN/inf loss, gradient norm or parameter norm: stop ends the run with exit 46 "
            "before anything non-finite is saved; skip_step leaves that step's parameters and "
            "optimizer state unchanged (row `skipped`, a `step_skipped` event) and stops once "
            "max_skipped_steps is exceeded."
        ),
    )
    max_skipped_steps: StepCount = Field(
        10, description="skip_step: the most steps a run may skip before it stops with exit 46."
    )
    loss_chunk_size: NonNegativeInt = Field(
        256,
        description=(
            "Sequence positions per chunk of the loss: the [rows, chunk, vocab] fp32 logits are made "
            "and dropped one chunk at a time (recomputed in the backward pass); 0 = whole sequence."
        ),
    )
    logits_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "How the loss stores the LM head's logits (accumulated in float32 either way, softmax "
            "in float32): bfloat16 halves their memory, as MaxText keeps them, so a large "
            "vocabulary's whole-sequence loss (loss_chunk_size = 0) fits a smaller chip."
        ),
    )

    @field_validator("target_tokens", mode="before")
    @classmethod
    def _check_target(cls, value: object) -> object:
        if _number_outside(value, -math.inf, MAX_TARGET_TOKENS):  # too large, inf or NaN
            raise ValueError(
                f"must be a number of tokens up to 1e16 ({MAX_TARGET_TOKENS:,}), already far "
                "beyond any corpus trained on; check the exponent"
            )
        return value

    @field_validator("target_tokens")
    @classmethod
    def _at_least_one_step(cls, value: int, info: ValidationInfo) -> int:
        # Steps are whole: a target below one step's tokens would train a full step anyway.
        keys = ("global_batch_size", "gradient_accumulation_steps", "seq_len")
        sizes = [info.data.get(k) for k in keys]
        if None in sizes or value >= math.prod(sizes):
            return value  # a size that failed its own check is reported on its own
        batch, accum, seq = sizes
        shape = f"global_batch_size x seq_len = {batch} x {seq}"
        if accum > 1:
            shape = (
                f"global_batch_size x gradient_accumulation_steps x seq_len = "
                f"{batch} x {accum} x {seq}"
            )
        raise ValueError(
            f"must be at least one step's tokens, {shape} = {batch * accum * seq:,} (a run "
            "trains whole steps)"
        )

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.gradient_accumulation_steps * self.seq_len

    @property
    def total_steps(self) -> int:
        return -(-self.target_tokens // self.tokens_per_step)


class MeshConfig(Section):
    """Mesh axis sizes; their product must equal the global device count."""

    data: PositiveInt = Field(1, description="Pure data-parallel replicas.")
    expert: PositiveInt = Field(
        1,
        description=(
            "Devices MoE experts are sharded over (expert parallelism; divides the routed "
            "experts); outside the MoE blocks they split the batch like data."
        ),
    )
    fsdp: PositiveInt = Field(
        1, description="Devices parameters and optimizer state are sharded over."
    )
    tensor: PositiveInt = Field(
        1, description="Tensor-parallel devices (heads, MLP hidden, vocab)."
    )
    context: PositiveInt = Field(
        1,
        description=(
            "Devices one sequence is split over (context parallelism): activations shard their "
            "length over it, attention gathers keys and values; parameters shard over it like fsdp."
        ),
    )
    slices: PositiveInt = Field(
        1,
        description=(
            "Data-parallel groups across the slow (DCN) network: TPU slices, or groups of whole "
            "hosts elsewhere; data/expert/fsdp/tensor then describe one slice."
        ),
    )

    @property
    def size(self) -> int:
        return self.slices * self.data * self.expert * self.fsdp * self.context * self.tensor

    def product(self) -> str:
        """'mesh.slices x mesh.data x ... x mesh.tensor = 1 x 2 x ... = N', for errors."""
        names = ("slices", "data", "expert", "fsdp", "context", "tensor")
        return (
            f"{' x '.join(f'mesh.{n}' for n in names)} = "
            f"{' x '.join(str(getattr(self, n)) for n in names)} = {self.size}"
        )

    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over (slices x data x expert x fsdp)."""
        return self.slices * self.data * self.expert * self.fsdp


class EvalConfig(Section):
    name: str = Field(
        pattern=r"^[a-z0-9_-]+$",
        description="Row label in metrics/eval.jsonl; the first eval picks `best`.",
    )
    split: Literal["validation", "train"] = Field("validation", description="Data split evaluated.")
    batches: PositiveInt = Field(
        4, description="Global batches of global_batch_size rows per eval."
    )


class CheckpointConfig(Section):
    every: StepCount = Field(0, description="Save every N steps; 0 saves only at the end.")
    keep: PositiveInt = Field(3, description="Most recent checkpoints kept (the best is kept too).")
    async_: bool = Field(
        True, alias="async", description="Save in the background while training continues."
    )
    on_signal: bool = Field(
        True, description="On SIGTERM/SIGINT, save a final checkpoint before exiting."
    )


class ArtifactsConfig(Section):
    provenance: Literal["ids", "hash"] = Field(
        "ids", description="Per train row: the record ids that fed the step, or only their hash."
    )


class RuntimeConfig(Section):
    """How hosts find each other and what counts as a lost host."""

    boot_timeout_s: PositiveInt = Field(
        300, description="Seconds a host waits for the coordinator (process 0) before giving up."
    )
    host_loss_timeout_s: PositiveInt = Field(
        60,
        description="Seconds without a peer's heartbeat, or without a host's progress while "
        "stepping, before the hosts exit 43; keep it above the longest training step.",
    )
    storage_retry_s: PositiveFloat = Field(
        120.0,
        description="Seconds a failing gs:// call (5xx, 429, timeout, connection error) is retried "
        "with backoff before the job ends with exit 45 (restartable).",
    )
    owner_lease_s: int = Field(
        60,
        ge=2,
        description=(
            "Seconds the run's owner claim (owner.json) stays valid without renewal; the writer "
            "renews it every few seconds, and a claim older than this is taken over as stale."
        ),
    )


class WandbConfig(Section):
    """Weights & Biases: the same scalars as metrics/train.jsonl, from the writer host only."""

    project: str = Field(min_length=1, description="W&B project the run logs to.")
    entity: str | None = Field(None, description="W&B entity (team or user); default: yours.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="online: stream to the W&B server (needs WANDB_API_KEY or `wandb login`); "
        "offline: a run directory under <run>/wandb/ to `wandb sync` later.",
    )


class MetricsConfig(Section):
    """Metric sinks beside the JSON records (which stay the source of truth); off by default.
    A sink that fails (no network, no key, a missing package) is one warning, never a failed run."""

    tensorboard: bool = Field(
        False, description="Write TensorBoard event files under <run>/tensorboard/."
    )
    wandb: WandbConfig | None = Field(None, description="Log to Weights & Biases.")


class ProfileConfig(Section):
    """A jax.profiler trace of a few steps on every host, into <run>/profile/host-<i>/."""

    start_step: Annotated[int, Field(ge=2, le=MAX_STEPS)] = Field(
        description="First step traced (step 1 of an attempt compiles, so 2 or later)."
    )
    steps: PositiveStepCount = Field(
        2, description="Steps traced; they count as training but not in tokens/s."
    )

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


class RunConfig(Section):
    run: RunSection
    model: AnyModelConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig
    training: TrainingConfig
    mesh: MeshConfig = MeshConfig()
    evals: list[EvalConfig] = []
    checkpoint: CheckpointConfig = CheckpointConfig()
    artifacts: ArtifactsConfig = ArtifactsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig | None = None

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        t, m = self.training, self.model
        if t.total_steps > MAX_STEPS:
            raise ValueError(
                f"training.target_tokens ({t.target_tokens:,}) takes {t.total_steps:,} steps of "
                f"{t.tokens_per_step:,} tokens, more than the {MAX_STEPS:,} a run counts; lower "
                "target_tokens or raise the tokens per step"
            )
        if t.seq_len > m.max_position_embeddings:
            raise ValueError(
                f"training.seq_len ({t.seq_len}) is longer than model.max_position_embeddings "
                f"({m.max_position_embeddings}); shorten seq_len or raise max_position_embeddings"
            )
        shards = self.mesh.batch_shards
        if t.global_batch_size % shards:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"mesh.slices x data x expert x fsdp = {shards}, the devices each batch is split "
                "over"
            )
        if self.mesh.context > 1:
            if t.seq_len % self.mesh.context:
                raise ValueError(
                    f"training.seq_len ({t.seq_len}) must be a multiple of mesh.context "
                    f"({self.mesh.context}), the devices each sequence is split over"
                )
        if self.mesh.expert > 1:
            experts = m.routed_experts
            if experts is None:
                raise ValueError(
                    f"mesh.expert = {self.mesh.expert} shards MoE experts, but this model has no "
                    "MoE layers; fold those devices into mesh.data or mesh.fsdp"
                )
            if experts % self.mesh.expert:
                raise ValueError(
                    f"mesh.expert ({self.mesh.expert}) must divide the {experts} routed experts "
                    "of each MoE layer; pick a divisor"
                )
            if m.moe_dispatch == "dense":
                raise ValueError(
                    "model.moe_dispatch = 'dense' runs every expert on every token and cannot "
                    f"use mesh.expert = {self.mesh.expert}; set it to 'sparse' or 'auto'"
                )
        if self.profile and self.profile.start_step > t.total_steps:
            raise ValueError(
                f"profile.start_step ({self.profile.start_step}) is past the run's last step "
                f"({t.total_steps}); pick a step the run reaches"
            )
        names = [e.name for e in self.evals]
        if len(names) != len(set(names)):
            raise ValueError(f"evals: names must be unique, got {names}")
        return self
