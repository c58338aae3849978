"""The qwen3_5 families' HF name map (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`):
qwen3_next's, but for the DeltaNet input projections (layers scanned in periods as there).

DeltaNet layers: `linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}` transpose as
every projection; `conv1d.weight` [C, 1, K] is our `conv1d.kernel` [K, C]; `A_log`, `dt_bias`
and the gated norm's weight copy as they are. Attention layers: qwen3's names (`q_proj` is
[q | gate] per head). Dense layers: `mlp.{gate,up,down}_proj`; MoE layers: the router
`mlp.gate`, per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_expert.*` and
`mlp.shared_expert_gate.weight`. The files hold the experts fused instead, as the released
checkpoints do (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]): import
reads either layout and export writes the fused one (runtime/hf/experts.py, the spec's
`hf_read`/`hf_write`); transformers loads both. A released checkpoint's
multi-token-prediction head (`mtp.*`) is skipped on import: `HF_IGNORED_PREFIXES`. (A multimodal
checkpoint's `model.language_model.*` is read as `model.*`: runtime/hf/convert.py.)
"""

from __future__ import annotations

from functools import partial

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer, in_periods
from runtime.model.decoder import period_of
from runtime.model.qwen3.hf_names import attention_names, layer_norm_names, mlp_names
from runtime.model.qwen3_5.decoder import layer_kinds
from runtime.model.qwen3_next.hf_names import shared_moe_names

HF_IGNORED_PREFIXES: tuple[str, ...] = ("mtp.",)

#: The DeltaNet projections (all transposed).
PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def deltanet_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """A Gated DeltaNet mixer's projections, conv, decay parameters and gated norm."""
    at = partial(in_layer, cfg, i)
    la = "linear_attn"
    out = [at((la, n, "kernel"), f"{la}.{n}.weight", True) for n in PROJECTIONS]
    out.append(at((la, "conv1d", "kernel"), f"{la}.conv1d.weight", True, hf_unit_axis=1))
    out += [at((la, n), f"{la}.{n}", False) for n in ("A_log", "dt_bias")]
    out.append(at((la, "norm", "scale"), f"{la}.norm.weight", False))
    return out


def hf_names(cfg: ModelConfig) -> list[Entry]:
    kinds = layer_kinds(cfg)
    unrolled = cfg.model_copy(update={"scan_layers": False})
    out = []
    for i, kind in enumerate(kinds):
        out += deltanet_names(unrolled, i) if kind.linear else attention_names(unrolled, i)
        out += layer_norm_names(unrolled, i)
        out += shared_moe_names(unrolled, i) if kind.moe else mlp_names(unrolled, i)
    return ends(cfg) + (in_periods(out, period_of(kinds)) if cfg.scan_layers else out)
