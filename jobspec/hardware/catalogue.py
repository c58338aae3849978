"""The accelerator catalogue: chips per host, hosts per slice, GKE resource names and selectors.

Names are what a job spec's `accelerator` says: `cpu`, `tpu-v4-N`, `tpu-v5e-N` (or
`tpu-v5litepod-N`), `tpu-v5p-N`, `tpu-v6e-N`, `a100-40gb`, `a100-80gb`, `h100-80gb`, `h200`.
TPU sizes follow Google's naming: for v4 and v5p, N counts TensorCores (2 per chip); for v5e
and v6e, N counts chips. Nothing here imports jax.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jobspec.errors import ConfigError


@dataclass(frozen=True)
class Accelerator:
    name: str
    kind: str  # "cpu" | "tpu" | "gpu"
    chips_per_host: int  # devices one host process drives
    hosts_per_slice: int | None  # fixed by a TPU slice's topology; None = any number of hosts
    resource: str | None  # Kubernetes extended resource, e.g. google.com/tpu
    node_selector: dict[str, str]
    multi_slice: bool = False


_GPUS = {
    "a100-40gb": "nvidia-tesla-a100",
    "a100-80gb": "nvidia-a100-80gb",
    "h100-80gb": "nvidia-h100-80gb",
    "h200": "nvidia-h200-141gb",
}

# generation: (GKE accelerator label, N counts cores (2 per chip)?, 3-D topology?, sizes allowed)
_TPUS = {
    "v4": ("tpu-v4-podslice", True, True),
    "v5p": ("tpu-v5p-slice", True, True),
    "v5e": ("tpu-v5-lite-podslice", False, False),
    "v6e": ("tpu-v6e-slice", False, False),
}
_TOPO_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_TOPO_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}  # fmt: skip
_TPU_RE = re.compile(r"tpu-(v4|v5p|v5e|v5litepod|v6e)-(\d+)")  # fullmatch


def known_names() -> list[str]:
    tpus = [f"tpu-{g}-N" for g in ("v4", "v5e", "v5p", "v6e")]
    return ["cpu", *tpus, *_GPUS]


def _tpu(gen: str, n: int, name: str) -> Accelerator:
    label, counts_cores, three_d = _TPUS[gen]
    chips = n // 2 if counts_cores else n
    table = _TOPO_3D if three_d else _TOPO_2D
    if (counts_cores and n % 2) or chips not in table:
        sizes = sorted(k * 2 if counts_cores else k for k in table)
        raise ConfigError(
            f"accelerator: {name!r} is not a {gen} slice size; use one of "
            + ", ".join(f"tpu-{gen}-{s}" for s in sizes)
        )
    # Single-host slices put all chips on one host (v5e/v6e up to 8); larger slices use
    # 4-chip hosts.
    per_host = chips if chips <= (8 if not three_d else 4) else 4
    return Accelerator(
        name=name,
        kind="tpu",
        chips_per_host=per_host,
        hosts_per_slice=chips // per_host,
        resource="google.com/tpu",
        node_selector={
            "cloud.google.com/gke-tpu-accelerator": label,
            "cloud.google.com/gke-tpu-topology": table[chips],
        },
        multi_slice=True,
    )


def lookup(name: str) -> Accelerator:
    """The catalogue entry for `name`, or a ConfigError listing the known names."""
    if name == "cpu":
        return Accelerator("cpu", "cpu", 1, None, None, {})
    if name in _GPUS:
        return Accelerator(name, "gpu", 8, None, "nvidia.com/gpu",
                           {"cloud.google.com/gke-accelerator": _GPUS[name]})  # fmt: skip
    m = _TPU_RE.fullmatch(name)
    if m:
        gen = "v5e" if m.group(1) == "v5litepod" else m.group(1)
        return _tpu(gen, int(m.group(2)), name)
    raise ConfigError(
        f"accelerator: unknown accelerator {name!r}; known: {', '.join(known_names())}"
    )
