"""Routed-expert weights in transformers' fused layout <-> one tensor per expert.

transformers 5 holds an MoE layer's experts as two stacks, `PREFIX.experts.gate_up_proj`
[E, 2F, D] (per expert the gate rows, then the up rows) and `PREFIX.experts.down_proj` [E, D, F],
and a checkpoint may store them so (Qwen3.5's released MoE checkpoints do); a model it built
itself saves one `PREFIX.experts.{e}.{gate,up,down}_proj.weight` per expert ([F, D], [F, D],
[D, F]). The two hold the same values: `split_fused_experts` reads the first as the second (views,
no copy), `fuse_experts` writes the second as the first.
"""

from __future__ import annotations

import re

import numpy as np

from jobspec.errors import ConfigError

_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<kind>gate|up|down)_proj\.weight$"
)


def split_fused_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with every fused expert stack replaced by its per-expert tensors."""
    out: dict[str, np.ndarray] = {}
    for name, a in tensors.items():
        m = _FUSED.match(name)
        if m is None or a.ndim != 3:
            out[name] = a
            continue
        prefix = m["prefix"]
        if m["kind"] == "down_proj":
            out |= {f"{prefix}.{e}.down_proj.weight": a[e] for e in range(a.shape[0])}
            continue
        if a.shape[1] % 2:
            raise ConfigError(
                f"HF tensor {name!r} has shape {a.shape}; a fused gate/up stack needs an even "
                "second axis (the gate rows, then the up rows)"
            )
        f = a.shape[1] // 2
        for e in range(a.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"] = a[e, :f]
            out[f"{prefix}.{e}.up_proj.weight"] = a[e, f:]
    return out


def fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with every layer's per-expert tensors replaced by the two fused stacks."""
    out: dict[str, np.ndarray] = {}
    groups: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for name, a in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = a
        else:
            groups.setdefault(m["prefix"], {}).setdefault(m["kind"], {})[int(m["e"])] = a
    for prefix, kinds in groups.items():
        experts = range(len(kinds["down"]))
        gate_up = [np.concatenate([kinds["gate"][e], kinds["up"][e]]) for e in experts]
        out[f"{prefix}.gate_up_proj"] = np.stack(gate_up)
        out[f"{prefix}.down_proj"] = np.stack([kinds["down"][e] for e in experts])
    return out
