"""The qwen2 family's HF name map (`Qwen2ForCausalLM`): Qwen3's, with the q/k/v biases and no
q/k norms in the attention."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, in_layer
from runtime.model.qwen3.hf_names import decoder_names


def attention_names(cfg: ModelConfig, i: int) -> list[Entry]:
    out = [
        in_layer(cfg, i, ("self_attn", f"{n}_proj", "kernel"), f"self_attn.{n}_proj.weight", True)
        for n in "qkvo"
    ]
    out += [
        in_layer(cfg, i, ("self_attn", f"{n}_proj", "bias"), f"self_attn.{n}_proj.bias", False)
        for n in "qkv"
    ]
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    return decoder_names(cfg, attention=attention_names)
