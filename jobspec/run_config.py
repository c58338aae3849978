"""RunConfig: the `cfg.toml` every host trains from.

Section and key names are the documented contract (README "Config reference");
unknown keys are errors. Nothing here imports jax.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]

RUN_ID_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RunSection(Section):
    """Identity and destination of the run."""

    id: str = Field(description="Run id, a DNS-1123 label (lowercase letters, digits, '-').")
    seed: NonNegativeInt = Field(0, description="Seed for parameter init, data order and dropout-free RNG.")
    output_uri: str = Field(
        "runs",
        description="Where `<id>/` with artifacts and checkpoints goes: a local path or gs://bucket/prefix.",
    )

    @model_validator(mode="after")
    def _check_id(self) -> RunSection:
        if not RUN_ID_RE.match(self.id):
            raise ValueError(
                f"run id {self.id!r} is not a DNS-1123 label: use 1-63 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit"
            )
        return self


class ModelConfig(Section):
    """Qwen3-family decoder sizes. Names follow the Hugging Face config keys."""

    family: Literal["qwen3"] = "qwen3"
    vocab_size: PositiveInt = Field(description="Embedding rows; must exceed every token id in the data.")
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt | None = Field(None, description="Defaults to hidden_size / num_heads.")
    intermediate_size: PositiveInt = Field(description="SwiGLU hidden width.")
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat = 1_000_000.0
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = True
    init_std: PositiveFloat = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "block", "full"] = Field(
        "none",
        description="none: keep all activations; block: per-block remat keeping matmul outputs; full: per-block remat keeping only block inputs.",
    )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly"
            )
        return self


class ScheduleConfig(Section):
    """Learning-rate schedule: linear warmup, then decay to min_lr_ratio × lr."""

    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    decay_steps: PositiveInt | None = Field(
        None,
        description=(
            "Steps from start to the end of decay. Unset: the first run's total steps; a resumed run "
            "keeps the value its checkpoint recorded, so raising target_tokens continues at the floor."
        ),
    )
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1


class OptimizerConfig(Section):
    """AdamW with a schedule and global-norm clipping."""

    name: Literal["adamw"] = "adamw"
    lr: PositiveFloat = 3e-4
    b1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    b2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    grad_clip_norm: PositiveFloat | None = Field(1.0, description="Global-norm clip; unset to disable.")
    schedule: ScheduleConfig = ScheduleConfig()


class PrepareConfig(Section):
    """How to make the manifest on first use when it does not exist yet."""

    inputs: list[str] = Field(
        min_length=1,
        description="Globs of text/JSONL files; '{stdlib}' expands to this Python's standard-library folder.",
    )
    tokenizer: str = Field("byte", description="'byte' or a path to a local tokenizer.json.")
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.05
    max_bytes: PositiveInt | None = Field(None, description="Stop reading inputs after this many bytes.")


class DataConfig(Section):
    manifest: str = Field(description="Path or URI of a prepared-token manifest.json.")
    tokenizer: str | None = Field(
        None, description="Expected tokenizer id ('byte' or tokenizer.json path); must match the manifest's."
    )
    order: Literal["sequential", "shuffle", "document_buffer"] = "shuffle"
    prefetch: NonNegativeInt = Field(2, description="Global batches the loader prepares ahead (threads).")
    prepare: PrepareConfig | None = None


class TrainingConfig(Section):
    seq_len: PositiveInt
    global_batch_size: PositiveInt = Field(description="Sequences per microbatch across all hosts.")
    gradient_accumulation_steps: PositiveInt = 1
    target_tokens: PositiveInt = Field(description="Train until this many tokens have been consumed.")
    log_every: PositiveInt = 10
    eval_every: NonNegativeInt = Field(0, description="Steps between evals; 0 runs evals only at the end.")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.gradient_accumulation_steps * self.seq_len

    @property
    def total_steps(self) -> int:
        return -(-self.target_tokens // self.tokens_per_step)


class MeshConfig(Section):
    """Mesh axis sizes; their product must equal the global device count."""

    data: PositiveInt = 1
    fsdp: PositiveInt = 1
    tensor: PositiveInt = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor


class EvalConfig(Section):
    name: str = Field(pattern=r"^[a-z0-9_-]+$")
    split: Literal["validation", "train"] = "validation"
    batches: PositiveInt = Field(4, description="Global batches of global_batch_size rows per eval.")


class CheckpointConfig(Section):
    every: NonNegativeInt = Field(0, description="Save every N steps; 0 saves only at the end.")
    keep: PositiveInt = Field(3, description="Most recent checkpoints kept (the best is kept too).")
    async_: bool = Field(True, alias="async", description="Save in the background while training continues.")
    on_signal: bool = Field(True, description="On SIGTERM/SIGINT, save a final checkpoint before exiting.")


class ArtifactsConfig(Section):
    provenance: Literal["ids", "hash"] = Field(
        "ids", description="Per train row: the record ids that fed the step, or only their hash."
    )
    flush_every: PositiveInt = Field(1, description="Log steps between rewrites of metrics files.")


class RunConfig(Section):
    run: RunSection
    model: ModelConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig
    training: TrainingConfig
    mesh: MeshConfig = MeshConfig()
    evals: list[EvalConfig] = []
    checkpoint: CheckpointConfig = CheckpointConfig()
    artifacts: ArtifactsConfig = ArtifactsConfig()

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        t, m = self.training, self.model
        if t.seq_len > m.max_position_embeddings:
            raise ValueError(
                f"training.seq_len ({t.seq_len}) is longer than model.max_position_embeddings "
                f"({m.max_position_embeddings}); shorten seq_len or raise max_position_embeddings"
            )
        names = [e.name for e in self.evals]
        if len(names) != len(set(names)):
            raise ValueError(f"evals: names must be unique, got {names}")
        return self
