"""The "qwen3_moe" family's contract: the Qwen3 decoder with a routed-experts MLP in every layer
(the shared expert keys, all required); its HF config.json is `Qwen3MoeForCausalLM`'s."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from jobspec.families.hf import HF_MOE_KEYS
from jobspec.families.model_config import EXPERT_KEYS
from jobspec.families.qwen3 import Qwen3ModelConfig

#: Our key <- HF key candidates (first present wins).
_HF_CANDIDATES: dict[str, tuple[str, ...]] = {
    "num_experts_per_tok": ("num_experts_per_tok",),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "norm_topk_prob": ("norm_topk_prob",),
    "num_experts": ("num_experts", "num_local_experts"),
}


class Qwen3MoeModelConfig(Qwen3ModelConfig):
    family: Literal["qwen3_moe"] = Field(description="Architecture family.")

    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    takes_expert_keys: ClassVar[bool] = True
    hf_keys: ClassVar[tuple[str, ...]] = HF_MOE_KEYS

    def family_problem(self) -> str | None:
        missing = [k for k in EXPERT_KEYS if getattr(self, k) is None]
        if missing:
            return f"family qwen3_moe needs {', '.join(missing)}"
        assert self.num_experts is not None and self.num_experts_per_tok is not None
        if self.num_experts_per_tok > self.num_experts:
            return f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
        return None

    @classmethod
    def hf_problems(cls, hf: dict[str, Any]) -> list[str]:
        problems = super().hf_problems(hf)
        if hf.get("decoder_sparse_step", 1) != 1:
            problems.append("decoder_sparse_step != 1")
        if hf.get("mlp_only_layers"):
            problems.append("non-empty mlp_only_layers")
        return problems

    @classmethod
    def more_fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for ours, candidates in _HF_CANDIDATES.items():
            value = next((hf[c] for c in candidates if c in hf), None)
            if value is not None:
                out[ours] = value
        out.setdefault("norm_topk_prob", False)  # HF Qwen3MoeConfig's default; ours is true
        return out

    @classmethod
    def more_hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        return {
            "num_experts": model["num_experts"],
            "num_experts_per_tok": model["num_experts_per_tok"],
            "moe_intermediate_size": model["moe_intermediate_size"],
            "norm_topk_prob": bool(model.get("norm_topk_prob", True)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
