"""The qwen2 family's HF name map (`Qwen2ForCausalLM`): Qwen3's, with the q/k/v biases and no
q/k norms in the attention."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry
from runtime.model.qwen3.hf_names import attention_names as qwen3_attention_names
from runtime.model.qwen3.hf_names import decoder_names


def attention_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """Qwen3's projections plus the q/k/v biases, without the q/k norms."""
    return qwen3_attention_names(cfg, i, qk_norm=False, qkv_bias=True)


def hf_names(cfg: ModelConfig) -> list[Entry]:
    return decoder_names(cfg, attention=attention_names)
