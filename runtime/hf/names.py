"""One explicit table per family from NNX parameter paths to HF state-dict names.

A path is the tuple `nnx.to_flat_state` gives, e.g. `("layers", 0, "self_attn", "q_proj",
"kernel")`. Our kernels are [in, out] and HF `nn.Linear` weights are [out, in], so every
projection transposes; embeddings and norm scales copy as they are. Qwen3-MoE stacks its experts
([E, in, out], see runtime/model/moe.py); an entry with `expert = e` is slice e of that stack, which
HF's saved checkpoints keep as a separate `mlp.experts.{e}.*_proj.weight` per expert.
With `model.scan_layers` the layers are stacked too: the path has no layer index
(`("layers", "self_attn", "q_proj", "kernel")`, [L, in, out]) and an entry with `layer = i` is
slice i of it (then slice `expert` of that), HF's `model.layers.{i}.…` either way.
Which table a family uses is its line in runtime/model/registry.py (`spec_for(cfg).hf_names`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from jobspec.run_config import ModelConfig


@dataclass(frozen=True)
class Entry:
    """Our parameter at `path` (slice [layer, expert] of it, for those set) is HF tensor `name`,
    transposed when `transpose` (after dropping `hf_unit_axis`, when set)."""

    path: tuple[str | int, ...]
    name: str
    transpose: bool
    expert: int | None = None
    layer: int | None = None
    #: An HF axis of size 1 that our parameter does not have (dropped on import before any
    #: transpose, put back on export after it), e.g. a depthwise conv weight [C, 1, K].
    hf_unit_axis: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """The leading indices that select this tensor from the stored parameter (() if none)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _in_layer(
    cfg: ModelConfig,
    i: int,
    rest: tuple[str, ...],
    name: str,
    transpose: bool,
    expert: int | None = None,
) -> Entry:
    """Layer i's parameter `rest` (the path below the block): its own module's path, or slice i
    of the stacked one when the layers are scanned."""
    if cfg.scan_layers:
        return Entry(("layers", *rest), name, transpose, expert, layer=i)
    return Entry(("layers", i, *rest), name, transpose, expert)


def _qwen3_attention(cfg: ModelConfig, i: int) -> list[Entry]:
    hf = f"model.layers.{i}.self_attn"
    out = [
        _in_layer(cfg, i, ("self_attn", f"{n}_proj", "kernel"), f"{hf}.{n}_proj.weight", True)
        for n in "qkvo"
    ]
    out += [
        _in_layer(cfg, i, ("self_attn", f"{n}_norm", "scale"), f"{hf}.{n}_norm.weight", False)
        for n in "qk"
    ]
    return out


def _qwen3_layer_norms(cfg: ModelConfig, i: int) -> list[Entry]:
    return [
        _in_layer(cfg, i, (n, "scale"), f"model.layers.{i}.{n}.weight", False)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]


def _ends(cfg: ModelConfig) -> list[Entry]:
    out = [
        Entry(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
        Entry(("norm", "scale"), "model.norm.weight", False),
    ]
    if not cfg.tie_word_embeddings:
        out.append(Entry(("lm_head", "kernel"), "lm_head.weight", True))
    return out


def qwen3_names(cfg: ModelConfig) -> list[Entry]:
    """Dense Qwen3 (`Qwen3ForCausalLM`)."""
    out = _ends(cfg)
    for i in range(cfg.num_layers):
        out += _qwen3_attention(cfg, i) + _qwen3_layer_norms(cfg, i)
        out += [
            _in_layer(
                cfg,
                i,
                ("mlp", f"{n}_proj", "kernel"),
                f"model.layers.{i}.mlp.{n}_proj.weight",
                True,
            )
            for n in ("gate", "up", "down")
        ]
    return out


def qwen3_moe_names(cfg: ModelConfig) -> list[Entry]:
    """Qwen3-MoE (`Qwen3MoeForCausalLM`): router `mlp.gate`, per-expert SwiGLU projections.

    The router bias (runtime/model/moe.py `router_bias`) is not a parameter and has no HF tensor.
    """
    assert cfg.num_experts is not None
    out = _ends(cfg)
    for i in range(cfg.num_layers):
        out += _qwen3_attention(cfg, i) + _qwen3_layer_norms(cfg, i)
        hf = f"model.layers.{i}.mlp"
        out.append(_in_layer(cfg, i, ("mlp", "gate", "kernel"), f"{hf}.gate.weight", True))
        for e in range(cfg.num_experts):
            out += [
                _in_layer(
                    cfg,
                    i,
                    ("mlp", "experts", f"{n}_proj"),
                    f"{hf}.experts.{e}.{n}_proj.weight",
                    True,
                    e,
                )  # fmt: skip
                for n in ("gate", "up", "down")
            ]
    return out


def _gemma4_entry(i: int, rest: tuple[str, ...], name: str, transpose: bool) -> Entry:
    return Entry(("layers", i, *rest), f"model.layers.{i}.{name}", transpose)


def gemma4_names(cfg: ModelConfig) -> list[Entry]:
    """Gemma 4 text (`Gemma4ForCausalLM`, runtime/model/gemma4.py): unrolled layers only.

    Fused expert stacks stay fused in HF's own layout (`experts.gate_up_proj` [E, 2I, D],
    `experts.down_proj` [E, D, I]), untransposed; `layer_scalar` is HF's persistent buffer
    [1]. A K/V-shared layer has no k_proj, v_proj, k_norm or v_norm; an `attention_k_eq_v`
    full layer has no v_proj. (Import ignores those tensors where a checkpoint carries them.)
    """
    from runtime.model.gemma4 import layer_shapes

    g = cfg.gemma4
    assert g is not None
    out = [
        Entry(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
        Entry(("norm", "scale"), "model.norm.weight", False),
    ]
    if not cfg.tie_word_embeddings:
        out.append(Entry(("lm_head", "kernel"), "lm_head.weight", True))
    if g.hidden_size_per_layer_input:
        out += [
            Entry(("embed_tokens_per_layer", "embedding"), "model.embed_tokens_per_layer.weight", False),
            Entry(("per_layer_model_projection", "kernel"), "model.per_layer_model_projection.weight", True),
            Entry(("per_layer_projection_norm", "scale"), "model.per_layer_projection_norm.weight", False),
        ]  # fmt: skip
    for i, s in enumerate(layer_shapes(cfg)):
        at = partial(_gemma4_entry, i)

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


def gemma4_ignored(cfg: ModelConfig) -> set[str]:
    """Tensors a Gemma 4 checkpoint may carry that the model does not use: the k/v weights and
    norms of K/V-shared layers (transformers drops them on load too)."""
    from runtime.model.gemma4 import layer_shapes

    out = set()
    for i, s in enumerate(layer_shapes(cfg)):
        if s.source != i:
            out |= {
                f"model.layers.{i}.self_attn.{n}.weight"
                for n in ("k_proj", "v_proj", "k_norm", "v_norm")
            }
    return out


def qwen3_next_names(cfg: ModelConfig) -> list[Entry]:
    """Qwen3-Next (`Qwen3NextForCausalLM`, runtime/model/qwen3_next.py): unrolled layers only.

    DeltaNet layers: `linear_attn.{in_proj_qkvz,in_proj_ba,out_proj}` transpose as every
    projection (their outputs keep HF's per-key-head-group order); `conv1d.weight` [C, 1, K] is
    our `conv1d.kernel` [K, C] (unit axis dropped, then transposed); `A_log`, `dt_bias` and the
    gated norm's weight copy as they are. Attention layers: qwen3's names (`q_proj` is twice the
    query width: [q | gate] per head). MoE layers: qwen3_moe's router and per-expert tensors as
    HF saves them (`mlp.experts.{e}.{gate,up,down}_proj.weight`), plus `mlp.shared_expert.*` and
    `mlp.shared_expert_gate.weight` [1, hidden]; dense layers: `mlp.{gate,up,down}_proj`.
    """
    from runtime.model.qwen3_next import layer_kinds

    out = _ends(cfg)
    for i, kind in enumerate(layer_kinds(cfg)):
        at = partial(_gemma4_entry, i)
        if kind.linear:
            la = "linear_attn"
            out += [
                at((la, n, "kernel"), f"{la}.{n}.weight", True)
                for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")
            ]
            out.append(
                Entry(("layers", i, la, "conv1d", "kernel"), f"model.layers.{i}.{la}.conv1d.weight",
                      True, hf_unit_axis=1)
            )  # fmt: skip
            out += [at((la, n), f"{la}.{n}", False) for n in ("A_log", "dt_bias")]
            out.append(at((la, "norm", "scale"), f"{la}.norm.weight", False))
        else:
            out += [
                at(("self_attn", f"{n}_proj", "kernel"), f"self_attn.{n}_proj.weight", True)
                for n in "qkvo"
            ]
            out += [
                at(("self_attn", f"{n}_norm", "scale"), f"self_attn.{n}_norm.weight", False)
                for n in "qk"
            ]
        out += [
            at((n, "scale"), f"{n}.weight", False)
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
        if not kind.moe:
            out += [
                at(("mlp", f"{n}_proj", "kernel"), f"mlp.{n}_proj.weight", True)
                for n in ("gate", "up", "down")
            ]
            continue
        assert cfg.num_experts is not None
        out.append(at(("mlp", "gate", "kernel"), "mlp.gate.weight", True))
        for e in range(cfg.num_experts):
            out += [
                Entry(("layers", i, "mlp", "experts", f"{n}_proj"),
                      f"model.layers.{i}.mlp.experts.{e}.{n}_proj.weight", True, e)
                for n in ("gate", "up", "down")
            ]  # fmt: skip
        out += [
            at(("mlp", "shared_expert", f"{n}_proj", "kernel"), f"mlp.shared_expert.{n}_proj.weight", True)
            for n in ("gate", "up", "down")
        ]  # fmt: skip
        out.append(
            at(("mlp", "shared_expert_gate", "kernel"), "mlp.shared_expert_gate.weight", True)
        )
    return out
