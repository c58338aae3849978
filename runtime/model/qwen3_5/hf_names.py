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
from runtime.hf.names import Entry, in_layer
from runtime.model.qwen3_5.decoder import layer_kinds
from runtime.model.qwen3_next.hf_names import hybrid_names

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
    return hybrid_names(cfg, layer_kinds(cfg), deltanet_names)
