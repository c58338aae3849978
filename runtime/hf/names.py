"""The entries of a name map from NNX parameter paths to HF state-dict names, and the pieces
every family's map is built from (each family's map is `hf_names.py` in its folder under
runtime/model/, and `spec_for(cfg).hf_names` in runtime/model/registry.py picks it).

A path is the tuple `nnx.to_flat_state` gives, e.g. `("layers", 0, "self_attn", "q_proj",
"kernel")`. Our kernels are [in, out] and HF `nn.Linear` weights are [out, in], so every
projection transposes; embeddings, biases and norm scales copy as they are. Qwen3-MoE stacks its
experts ([E, in, out], see runtime/model/moe/layer.py); an entry with `expert = e` is slice e of
that stack, which HF's saved checkpoints keep as a separate `mlp.experts.{e}.*_proj.weight` per
expert.
With `model.scan_layers` the layers are stacked too: the path has no layer index
(`("layers", "self_attn", "q_proj", "kernel")`, [L, in, out]) and an entry with `layer = i` is
slice i of it (then slice `expert` of that), HF's `model.layers.{i}.…` either way. Layers
scanned in periods of P (runtime/model/decoder.py `Period`) have layer i at block i % P of the
stack, slice i // P: `in_periods` maps an unrolled map's entries there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jobspec.families.model_config import ModelConfig


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


def in_layer(
    cfg: ModelConfig,
    i: int,
    rest: tuple[str, ...],
    name: str,
    transpose: bool,
    expert: int | None = None,
    hf_unit_axis: int | None = None,
) -> Entry:
    """Layer i's parameter `rest` (the path below the block) as HF `model.layers.{i}.{name}`:
    its own module's path, or slice i of the stacked one when the layers are scanned."""
    hf = f"model.layers.{i}.{name}"
    if cfg.scan_layers:
        return Entry(("layers", *rest), hf, transpose, expert, i, hf_unit_axis)
    return Entry(("layers", i, *rest), hf, transpose, expert, None, hf_unit_axis)


def ends(cfg: ModelConfig) -> list[Entry]:
    """The embedding, the final norm and (untied) the LM head."""
    out = [
        Entry(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
        Entry(("norm", "scale"), "model.norm.weight", False),
    ]
    if not cfg.tie_word_embeddings:
        out.append(Entry(("lm_head", "kernel"), "lm_head.weight", True))
    return out


def in_periods(entries: list[Entry], period: int) -> list[Entry]:
    """An unrolled map's layer entries (`("layers", i, …)`) as their slices of the layers
    scanned in periods of `period`: `("layers", "blocks", i % period, …)`, slice i // period."""
    out = []
    for e in entries:
        if e.path[0] == "layers" and isinstance(e.path[1], int):
            i = e.path[1]
            path = ("layers", "blocks", i % period, *e.path[2:])
            e = dataclasses.replace(e, path=path, layer=i // period)
        out.append(e)
    return out
