"""The qwen3_next family's HF name map (`Qwen3NextForCausalLM`).

DeltaNet layers: `linear_attn.{in_proj_qkvz,in_proj_ba,out_proj}` transpose as every
projection (their outputs keep HF's per-key-head-group order); `conv1d.weight` [C, 1, K] is
our `conv1d.kernel` [K, C] (unit axis dropped, then transposed); `A_log`, `dt_bias` and the
gated norm's weight copy as they are. Attention layers: qwen3's names (`q_proj` is twice the
query width: [q | gate] per head). MoE layers: qwen3_moe's router and per-expert tensors as
HF saves them (`mlp.experts.{e}.{gate,up,down}_proj.weight`), plus `mlp.shared_expert.*` and
`mlp.shared_expert_gate.weight` [1, hidden]; dense layers: `mlp.{gate,up,down}_proj`.
MTP (multi-token prediction) tensors a checkpoint may carry are skipped on import:
`HF_IGNORED_PREFIXES`. With `model.scan_layers` layer i is block i % P of the period stack,
slice i // P (`in_periods`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer, in_periods
from runtime.model.decoder import period_of
from runtime.model.qwen3.hf_names import attention_names, layer_norm_names, mlp_names
from runtime.model.qwen3_moe.hf_names import moe_names
from runtime.model.qwen3_next.decoder import LayerKind, layer_kinds

HF_IGNORED_PREFIXES: tuple[str, ...] = ("mtp.",)


def deltanet_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """A Gated DeltaNet mixer's projections, conv, decay parameters and gated norm."""
    at = partial(in_layer, cfg, i)
    la = "linear_attn"
    out = [
        at((la, n, "kernel"), f"{la}.{n}.weight", True)
        for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")
    ]
    out.append(at((la, "conv1d", "kernel"), f"{la}.conv1d.weight", True, hf_unit_axis=1))
    out += [at((la, n), f"{la}.{n}", False) for n in ("A_log", "dt_bias")]
    out.append(at((la, "norm", "scale"), f"{la}.norm.weight", False))
    return out


def shared_moe_names(cfg: ModelConfig, i: int) -> list[Entry]:
    """qwen3_moe's router and routed experts, then the shared expert and its gate."""
    at = partial(in_layer, cfg, i)
    out = moe_names(cfg, i)
    out += [
        at(("mlp", "shared_expert", f"{n}_proj", "kernel"), f"mlp.shared_expert.{n}_proj.weight", True)
        for n in ("gate", "up", "down")
    ]  # fmt: skip
    out.append(at(("mlp", "shared_expert_gate", "kernel"), "mlp.shared_expert_gate.weight", True))
    return out


def hybrid_names(
    cfg: ModelConfig, kinds: list[LayerKind], deltanet: Callable[[ModelConfig, int], list[Entry]]
) -> list[Entry]:
    """The map of a hybrid decoder of these layer kinds, `deltanet` naming a DeltaNet mixer's
    tensors (the one thing Qwen3.5's map does differently); layers scanned in periods when
    `model.scan_layers`."""
    unrolled = cfg.model_copy(update={"scan_layers": False})
    out = []
    for i, kind in enumerate(kinds):
        out += deltanet(unrolled, i) if kind.linear else attention_names(unrolled, i)
        out += layer_norm_names(unrolled, i)
        out += shared_moe_names(unrolled, i) if kind.moe else mlp_names(unrolled, i)
    return ends(cfg) + (in_periods(out, period_of(kinds)) if cfg.scan_layers else out)


def hf_names(cfg: ModelConfig) -> list[Entry]:
    return hybrid_names(cfg, layer_kinds(cfg), deltanet_names)
