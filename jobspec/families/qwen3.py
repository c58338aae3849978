"""The "qwen3" family's contract: the dense Qwen3 decoder takes only the shared `[model]` keys;
its HF config.json is `Qwen3ForCausalLM`'s. qwen3_moe and qwen2 extend this class."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from jobspec.families.hf import cannot_load, copy_dtype, copy_plain, rope_theta
from jobspec.families.model_config import ModelConfig


class Qwen3ModelConfig(ModelConfig):
    family: Literal["qwen3"] = Field("qwen3", description="Architecture family.")

    #: HF `architectures[0]`.
    architecture: ClassVar[str] = "Qwen3ForCausalLM"

    @classmethod
    def hf_problems(cls, hf: dict[str, Any]) -> list[str]:
        """Settings of the HF config this family cannot load."""
        problems = []
        if hf.get("attention_bias"):
            problems.append("attention_bias = true")
        if hf.get("use_sliding_window"):
            problems.append("use_sliding_window = true")
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act = {hf.get('hidden_act')!r}")
        return problems

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any], what: str) -> dict[str, Any]:
        problems = cls.hf_problems(hf)
        try:
            theta = rope_theta(hf)
        except ValueError as e:
            problems.append(str(e))
            theta = None
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
        head_dim = model.get("head_dim") or model["hidden_size"] // model["num_heads"]
        out: dict[str, Any] = {
            "architectures": [cls.architecture],
            "model_type": cls.family_name(),
            "vocab_size": model["vocab_size"],
            "hidden_size": model["hidden_size"],
            "intermediate_size": model["intermediate_size"],
            "num_hidden_layers": model["num_layers"],
            "num_attention_heads": model["num_heads"],
            "num_key_value_heads": model["num_kv_heads"],
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": model["max_position_embeddings"],
            "initializer_range": model.get("init_std", 0.02),
            "rms_norm_eps": model["rms_norm_eps"],
            "tie_word_embeddings": bool(model["tie_word_embeddings"]),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(model["rope_theta"])},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "use_cache": True,
            "dtype": model.get("param_dtype", "float32"),
        }
        return out | cls.more_hf_config(model)

    @classmethod
    def more_hf_config(cls, model: dict[str, Any]) -> dict[str, Any]:
        """A subclass's further config.json entries."""
        return {}
