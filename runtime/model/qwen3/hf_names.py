"""The Qwen3 decoder's HF name map (`Qwen3ForCausalLM`), built per layer from parts the families
on this decoder (qwen3_moe, qwen2) swap: the attention's names and the MLP's."""

from __future__ import annotations

from collections.abc import Callable

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer

#: (cfg, layer) -> the entries of one part of layer i.
LayerNames = Callable[[ModelConfig, int], list[Entry]]


def attention_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """q/k/v/o projections and the q/k norms."""
    out = [
        in_layer(cfg, i, ("self_attn", f"{n}_proj", "kernel"), f"self_attn.{n}_proj.weight", True)
        for n in "qkvo"
    ]
    out += [
        in_layer(cfg, i, ("self_attn", f"{n}_norm", "scale"), f"self_attn.{n}_norm.weight", False)
        for n in "qk"
    ]
    return out


def mlp_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """The SwiGLU MLP."""
    return [
        in_layer(cfg, i, ("mlp", f"{n}_proj", "kernel"), f"mlp.{n}_proj.weight", True)
        for n in ("gate", "up", "down")
    ]


def decoder_names(
    cfg: ModelConfig, attention: LayerNames = attention_names, mlp: LayerNames = mlp_names
) -> list[Entry]:
    """The ends, then per layer its attention, its two norms and its MLP."""
    out = ends(cfg)
    for i in range(cfg.num_layers):
        out += attention(cfg, i)
        out += [
            in_layer(cfg, i, (n, "scale"), f"{n}.weight", False)
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
        out += mlp(cfg, i)
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    """Dense Qwen3 (`Qwen3ForCausalLM`)."""
    return decoder_names(cfg)
