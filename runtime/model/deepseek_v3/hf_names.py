"""The deepseek_v3 family's HF name map (`DeepseekV3ForCausalLM`; unrolled layers only).

Attention: `self_attn.{q_proj | q_a_proj, q_b_proj}`, `kv_a_proj_with_mqa`, `kv_b_proj` and
`o_proj` transpose as every projection; `q_a_layernorm`/`kv_a_layernorm` weights copy. Dense
layers: `mlp.{gate,up,down}_proj`. MoE layers: qwen3_moe's router `mlp.gate.weight` and
per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (as transformers saves them),
`mlp.shared_experts.*`, and `mlp.gate.e_score_correction_bias`, which is our `mlp.router_bias`:
not a parameter (no gradient; `router_bias_update_rate` steps it), but imported and exported.
With `model.scan_layers` layer i is slice i of the stacked `layers.dense` or slice
i - first_k_dense_replace of `layers.moe` (decoder.py). A checkpoint's multi-token-prediction layers (`model.layers.{num_layers + j}.*`, j <
`num_nextn_predict_layers`) are skipped on import: `hf_ignored`.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer
from runtime.model.deepseek_v3.decoder import moe_layers
from runtime.model.deepseek_v3.mla import settings
from runtime.model.qwen3.hf_names import layer_norm_names, mlp_names
from runtime.model.qwen3_moe.hf_names import moe_names

#: The tensors of an MTP layer besides a decoder layer's (DeepSeek's `model.layers.{N}.*`).
_MTP_EXTRAS = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
               "shared_head.norm.weight", "shared_head.head.weight")  # fmt: skip


def mla_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """The latent attention's projections and its two latent norms."""
    at = partial(in_layer, cfg, i)
    projections = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    norms = ["kv_a_layernorm"]
    if settings(cfg).q_lora_rank is None:
        projections.insert(0, "q_proj")
    else:
        projections[:0] = ["q_a_proj", "q_b_proj"]
        norms.insert(0, "q_a_layernorm")
    out = [at(("self_attn", n, "kernel"), f"self_attn.{n}.weight", True) for n in projections]
    return out + [at(("self_attn", n, "scale"), f"self_attn.{n}.weight", False) for n in norms]


def deepseek_moe_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """The router, routed experts and router bias, then the shared experts."""
    at = partial(in_layer, cfg, i)
    out = moe_names(cfg, i)
    out.append(at(("mlp", "router_bias"), "mlp.gate.e_score_correction_bias", False))
    out += [
        at(("mlp", "shared_experts", f"{n}_proj", "kernel"), f"mlp.shared_experts.{n}_proj.weight", True)
        for n in ("gate", "up", "down")
    ]  # fmt: skip
    return out


def layer_names(cfg: ModelConfig, i: int, moe: bool) -> list[Entry]:
    out = mla_names(cfg, i) + layer_norm_names(cfg, i)
    return out + (deepseek_moe_names(cfg, i) if moe else mlp_names(cfg, i))


def hf_names(cfg: ModelConfig) -> list[Entry]:
    unrolled = cfg.model_copy(update={"scan_layers": False})
    out = []
    for i, moe in enumerate(moe_layers(cfg)):
        out += layer_names(unrolled, i, moe)
    if cfg.scan_layers:
        out = [_grouped(e, settings(cfg).first_k_dense_replace) for e in out]
    return ends(cfg) + out


def _grouped(e: Entry, first_moe: int) -> Entry:
    """An unrolled layer's entry (`layers.{i}.…`) as its slice of the scanned group."""
    i = e.path[1]
    assert isinstance(i, int)
    group, j = ("dense", i) if i < first_moe else ("moe", i - first_moe)
    return dataclasses.replace(e, path=("layers", group, *e.path[2:]), layer=j)


def hf_ignored(cfg: ModelConfig) -> set[str]:
    """The MTP layers' tensors: a MoE decoder layer's names (DeepSeek's MTP block is one) and
    its embedding, norms, projection and head, at layer indices num_layers and up."""
    out: set[str] = set()
    for j in range(settings(cfg).num_nextn_predict_layers):
        i = cfg.num_layers + j
        out |= {e.name for e in layer_names(cfg, i, i >= settings(cfg).first_k_dense_replace)}
        out |= {f"model.layers.{i}.{name}" for name in _MTP_EXTRAS}
    return out
