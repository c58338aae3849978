"""The gpt_oss family's HF name map (`GptOssForCausalLM`).

Attention: `self_attn.{q,k,v,o}_proj.weight` transpose as every projection, their biases (with
`attention_bias`) and `self_attn.sinks` [H] copy as they are. The router `mlp.router.weight`
[E, D] transposes to our `mlp.router.kernel` [D, E]; `mlp.router.bias` copies. The experts stay
in HF's own fused layout, untransposed: `mlp.experts.gate_up_proj` [E, D, 2I] (gate and up
interleaved), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, D], `down_proj_bias` [E, D]. A
Hub checkpoint's MXFP4 experts (`*_blocks` + `*_scales`) are dequantized into these names before
the map applies (runtime/hf/mxfp4.py); export writes them unquantized. With
`model.scan_layers` layer i is block i % P of the period stack, slice i // P (`in_periods`).
"""

from __future__ import annotations

from functools import partial

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer, in_periods
from runtime.model.decoder import period_of
from runtime.model.gpt_oss.decoder import settings, sliding_layers

#: The experts' tensors, kept in HF's layout.
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def layer_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """Layer i's attention, sinks, norms, router and experts."""
    at = partial(in_layer, cfg, i)
    attn = "self_attn"
    out = [at((attn, f"{n}_proj", "kernel"), f"{attn}.{n}_proj.weight", True) for n in "qkvo"]
    if settings(cfg).attention_bias:
        out += [at((attn, f"{n}_proj", "bias"), f"{attn}.{n}_proj.bias", False) for n in "qkvo"]
    out.append(at((attn, "sinks"), f"{attn}.sinks", False))
    out += [
        at((n, "scale"), f"{n}.weight", False)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    out += [
        at(("mlp", "router", "kernel"), "mlp.router.weight", True),
        at(("mlp", "router", "bias"), "mlp.router.bias", False),
    ]
    out += [at(("mlp", "experts", n), f"mlp.experts.{n}", False) for n in EXPERT_TENSORS]
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    unrolled = cfg.model_copy(update={"scan_layers": False})
    out = [e for i in range(cfg.num_layers) for e in layer_names(unrolled, i)]
    if cfg.scan_layers:
        out = in_periods(out, period_of(sliding_layers(cfg)))
    return ends(cfg) + out
