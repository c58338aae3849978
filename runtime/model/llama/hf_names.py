"""The llama and mistral families' HF name map (`LlamaForCausalLM`, `MistralForCausalLM`):
Qwen3's layout without q/k norms, plus the q/k/v/o biases (`attention_bias`) and the MLP biases
(`mlp_bias`) when the config has them."""

from __future__ import annotations

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, in_layer
from runtime.model.llama.decoder import options
from runtime.model.qwen3.hf_names import attention_names as qwen3_attention_names
from runtime.model.qwen3.hf_names import decoder_names
from runtime.model.qwen3.hf_names import mlp_names as qwen3_mlp_names


def _biases(cfg: ModelConfig, i: int, part: str, names: tuple[str, ...]) -> list[Entry]:
    return [
        in_layer(cfg, i, (part, f"{n}_proj", "bias"), f"{part}.{n}_proj.bias", False) for n in names
    ]


def attention_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """q/k/v/o projections, then their biases with `attention_bias`."""
    out = qwen3_attention_names(cfg, i, qk_norm=False)
    if options(cfg).attention_bias:
        out += _biases(cfg, i, "self_attn", ("q", "k", "v", "o"))
    return out


def mlp_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """The SwiGLU MLP, then its biases with `mlp_bias`."""
    out = qwen3_mlp_names(cfg, i)
    if options(cfg).mlp_bias:
        out += _biases(cfg, i, "mlp", ("gate", "up", "down"))
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    return decoder_names(cfg, attention=attention_names, mlp=mlp_names)
