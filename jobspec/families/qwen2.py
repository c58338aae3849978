"""The "qwen2" family's contract: Qwen2, the decoder Qwen3 grew from (a bias on the q/k/v
projections, no q/k norm), with the shared `[model]` keys only; its HF config.json is
`Qwen2ForCausalLM`'s, read and written as Qwen3's (no `attention_bias`: Qwen2's q/k/v always
carry one)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from jobspec.families.qwen3 import Qwen3ModelConfig


class Qwen2ModelConfig(Qwen3ModelConfig):
    family: Literal["qwen2"] = Field(description="Architecture family.")

    architecture: ClassVar[str] = "Qwen2ForCausalLM"

    @classmethod
    def hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        out = super().hf_config(model)
        del out["attention_bias"]
        return out
