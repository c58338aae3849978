"""The Qwen3 decoder's HF name map (`Qwen3ForCausalLM`), built per layer from parts the families
on this decoder (qwen3_moe, qwen2) swap: the attention's names and the MLP's; qwen3_next's
hybrid map reuses the parts."""

from __future__ import annotations

from collections.abc import Callable

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer

#: (cfg, layer) -> the entries of one part of layer i.
LayerNames = Callable[[ModelConfig, int], list[Entry]]


def attention_names(
    cfg: ModelConfig, i: int, *, qk_norm: bool = True, qkv_bias: bool = False
) -> list[Entry]:
    """q/k/v/o projections, then the q/k/v biases (`qkv_bias`: qwen2) and the q/k norms
    (`qk_norm`: Qwen3's and qwen3_next's full attention)."""

    def at(module: str, leaf: str, hf_leaf: str, transpose: bool) -> Entry:
        return in_layer(
            cfg, i, ("self_attn", module, leaf), f"self_attn.{module}.{hf_leaf}", transpose
        )

    out = [at(f"{n}_proj", "kernel", "weight", True) for n in "qkvo"]
    if qkv_bias:
        out += [at(f"{n}_proj", "bias", "bias", False) for n in "qkv"]
    if qk_norm:
        out += [at(f"{n}_norm", "scale", "weight", False) for n in "qk"]
    return out


def mlp_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """The SwiGLU MLP."""
    return [
        in_layer(cfg, i, ("mlp", f"{n}_proj", "kernel"), f"mlp.{n}_proj.weight", True)
        for n in ("gate", "up", "down")
    ]


def layer_norm_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """The block's two pre-norms (also qwen3_next's)."""
    return [
        in_layer(cfg, i, (n, "scale"), f"{n}.weight", False)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]


def decoder_names(
    cfg: ModelConfig, attention: LayerNames = attention_names, mlp: LayerNames = mlp_names
) -> list[Entry]:
    """The ends, then per layer its attention, its two norms and its MLP."""
    out = ends(cfg)
    for i in range(cfg.num_layers):
        out += attention(cfg, i) + layer_norm_names(cfg, i) + mlp(cfg, i)
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    """Dense Qwen3 (`Qwen3ForCausalLM`)."""
    return decoder_names(cfg)
