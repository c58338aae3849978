"""What a checkpoint records besides the arrays (CheckpointMeta), and the run manifest record.

Both are built in one place each: the train loop and `runtime import hf` make a CheckpointMeta
with the same constructor, and resume, offline eval/sample and export read it back with
`from_json`. The JSON keys are the checkpoint format; renaming one breaks old checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobspec.errors import CheckpointError
from jobspec.run_config import RunConfig
from runfolder.layout import LAYOUT


@dataclass(frozen=True)
class CheckpointMeta:
    """The non-array part of a checkpoint: position, RNG, schedule length, data state, identity."""

    step: int
    tokens: int
    rng: list[int]  # the train state's PRNG key, as uint32 words
    decay_steps: int  # the schedule length fixed by the first run
    config: dict[str, Any]  # the resolved run config that made it
    # Compatibility fingerprint (run.compat); empty for an HF import without data.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # The data loader's state; process-count independent, keyed by the process that wrote it.
    data_state: dict[str, Any] | None = None
    # The model state that training moves outside the gradient (MoE router biases), one list
    # per array in the model's non-Param state order; None when the run does not move it.
    model_state: list[Any] | None = None
    imported_from: str | None = None  # `runtime import hf`: the HF dir
    # Steps training.on_nonfinite = "skip_step" skipped up to this step (its limit spans attempts).
    skipped_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "tokens": self.tokens,
            "rng": list(self.rng),
            "decay_steps": self.decay_steps,
            "fingerprint": self.fingerprint,
            "config": self.config,
        }
        if self.data_state is not None:
            out["data_state"] = self.data_state
        if self.model_state is not None:
            out["router_bias"] = self.model_state  # the key checkpoints have always used
        if self.imported_from is not None:
            out["imported_from"] = self.imported_from
        if self.skipped_steps:
            out["skipped_steps"] = self.skipped_steps
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any], *, where: str) -> CheckpointMeta:
        try:
            return cls(
                step=int(raw["step"]),
                tokens=int(raw["tokens"]),
                rng=[int(x) for x in raw["rng"]],
                decay_steps=int(raw["decay_steps"]),
                config=dict(raw.get("config") or {}),
                fingerprint=dict(raw.get("fingerprint") or {}),
                data_state=raw.get("data_state"),
                model_state=raw.get("router_bias"),
                imported_from=raw.get("imported_from"),
                skipped_steps=int(raw.get("skipped_steps", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: the checkpoint's meta is missing or has a bad {e}; it was not written "
                "by this version of jaxjob, or is damaged"
            ) from e

    def data_state_for(self, process_index: int) -> dict[str, Any] | None:
        """The loader state to resume with (every process's copy is the same state)."""
        if not self.data_state:
            return None
        return self.data_state.get(str(process_index), self.data_state["0"])


def run_manifest(cfg: RunConfig, output_uri: str, *, status: str, version: str | None,
                 **extra: Any) -> dict[str, Any]:  # fmt: skip
    """The fields of manifest.json that say what the run is; status and progress are updated."""
    return {
        "run_id": cfg.run.id,
        "status": status,
        "output_uri": output_uri,
        "total_steps": cfg.training.total_steps,
        "tokens_per_step": cfg.training.tokens_per_step,
        "layout": LAYOUT,
        "jaxjob_version": version,
        **extra,
    }
