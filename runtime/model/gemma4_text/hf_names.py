"""The gemma4_text family's HF name map (`Gemma4ForCausalLM`; unrolled layers only).

Fused expert stacks stay fused in HF's own layout (`experts.gate_up_proj` [E, 2I, D],
`experts.down_proj` [E, D, I]), untransposed; `layer_scalar` is HF's persistent buffer [1]. A
K/V-shared layer has no k_proj, v_proj, k_norm or v_norm; an `attention_k_eq_v` full layer has
no v_proj. (Import ignores those tensors where a checkpoint carries them: `hf_ignored`.)
"""

from __future__ import annotations

from functools import partial

from jobspec.families.model_config import ModelConfig
from runtime.hf.names import Entry, ends, in_layer
from runtime.model.gemma4_text.decoder import layer_shapes, settings


def hf_names(cfg: ModelConfig) -> list[Entry]:
    g = settings(cfg)
    out = ends(cfg)
    if g.hidden_size_per_layer_input:
        out += [
            Entry(("embed_tokens_per_layer", "embedding"), "model.embed_tokens_per_layer.weight", False),
            Entry(("per_layer_model_projection", "kernel"), "model.per_layer_model_projection.weight", True),
            Entry(("per_layer_projection_norm", "scale"), "model.per_layer_projection_norm.weight", False),
        ]  # fmt: skip
    for i, s in enumerate(layer_shapes(cfg)):
        at = partial(in_layer, cfg, i)

        out.append(at(("layer_scalar",), "layer_scalar", False))
        projections = ["q", "o"]
        if s.source == i:
            projections += ["k"] if s.k_eq_v else ["k", "v"]
        out += [
            at(("self_attn", f"{n}_proj", "kernel"), f"self_attn.{n}_proj.weight", True)
            for n in projections
        ]
        out += [
            at(("self_attn", f"{n}_norm", "scale"), f"self_attn.{n}_norm.weight", False)
            for n in (("q", "k") if s.source == i else ("q",))
        ]
        out += [
            at(("mlp", f"{n}_proj", "kernel"), f"mlp.{n}_proj.weight", True)
            for n in ("gate", "up", "down")
        ]
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if g.hidden_size_per_layer_input:
            out += [
                at(("per_layer_input_gate", "kernel"), "per_layer_input_gate.weight", True),
                at(("per_layer_projection", "kernel"), "per_layer_projection.weight", True),
            ]
            norms.append("post_per_layer_input_norm")
        if g.enable_moe_block:
            out += [
                at(("router", "proj", "kernel"), "router.proj.weight", True),
                at(("router", "scale"), "router.scale", False),
                at(("router", "per_expert_scale"), "router.per_expert_scale", False),
                at(("experts", "gate_up_proj"), "experts.gate_up_proj", False),
                at(("experts", "down_proj"), "experts.down_proj", False),
            ]
            norms += [
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ]
        out += [at((n, "scale"), f"{n}.weight", False) for n in norms]
    return out


def hf_ignored(cfg: ModelConfig) -> set[str]:
    """Tensors a Gemma 4 checkpoint may carry that the model does not use: the k/v weights and
    norms of K/V-shared layers (transformers drops them on load too)."""
    out = set()
    for i, s in enumerate(layer_shapes(cfg)):
        if s.source != i:
            out |= {
                f"model.layers.{i}.self_attn.{n}.weight"
                for n in ("k_proj", "v_proj", "k_norm", "v_norm")
            }
    return out
