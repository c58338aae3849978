"""The "qwen3" family's contract: the dense Qwen3 decoder takes only the shared `[model]` keys;
its HF config.json is `Qwen3ForCausalLM`'s. qwen3_moe and qwen2 extend this class."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from jobspec.families.hf import (
    cannot_load,
    copy_dtype,
    copy_plain,
    qwen_problems,
    rope_theta,
    shared_hf_config,
)
from jobspec.families.model_config import ModelConfig


class Qwen3ModelConfig(ModelConfig):
    family: Literal["qwen3"] = Field("qwen3", description="Architecture family.")

    #: HF `architectures[0]`.
    architecture: ClassVar[str] = "Qwen3ForCausalLM"

    @classmethod
    def hf_problems(cls, hf: dict[str, Any]) -> list[str]:
        """Settings of the HF config this family cannot load."""
        return qwen_problems(hf)

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        problems = cls.hf_problems(hf)
        theta = rope_theta(hf, problems)
        if problems:
            cannot_load(what, problems)
        out: dict[str, Any] = {"family": cls.family_name()}
        copy_plain(hf, out)
        out |= cls.more_fields_from_hf(hf)
        if theta is not None:
            out["rope_theta"] = theta
        # HF Qwen3Config defaults tie_word_embeddings to false; ours defaults to true.
        out.setdefault("tie_word_embeddings", False)
        copy_dtype(hf, out)
        return out

    @classmethod
    def more_fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        """A subclass's further keys from the HF config."""
        return {}

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        out = shared_hf_config(
            model,
            architecture=cls.architecture,
            model_type=cls.family_name(),
            rope={"rope_type": "default", "rope_theta": float(model["rope_theta"])},
            own={"use_sliding_window": False, "sliding_window": None},
        )
        return out | cls.more_hf_config(model)

    @classmethod
    def more_hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        """A subclass's further config.json entries."""
        return {}
