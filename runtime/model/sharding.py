"""The mesh from `[mesh]`, and the one table mapping logical axis names to mesh axes.

Model code names only logical axes (vocab, embed, heads, kv_heads, mlp, norm, expert); this
module alone knows mesh axes. FSDP shards parameters (and so optimizer state) over `fsdp` along
`embed`; TP shards heads, MLP hidden and vocab over `tensor`; the batch is split over `data` x
`fsdp`; MoE experts are replicated for now.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jobspec.errors import ConfigError
from jobspec.run_config import MeshConfig

MESH_AXES = ("slice", "data", "fsdp", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("slice", "data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    # MoE expert axis: replicated for now; an expert-parallel mesh axis can take it later.
    "expert": None,
}


def build_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if cfg.size != len(devices):
        raise ConfigError(
            f"mesh.slices x mesh.data x mesh.fsdp x mesh.tensor = {cfg.slices} x {cfg.data} x "
            f"{cfg.fsdp} x {cfg.tensor} = {cfg.size}, but this job has {len(devices)} device(s); "
            "make the product equal the device count"
        )
    per_slice = (cfg.data, cfg.fsdp, cfg.tensor)
    # Auto axes: shardings are constraints for the compiler (GSPMD), not part of array types,
    # so model code stays free of mesh axes.
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if cfg.slices > 1:
        grid = _slice_grid(cfg, devices, per_slice)
    else:
        try:
            grid = mesh_utils.create_device_mesh(per_slice, devices=devices).reshape(
                (1, *per_slice)
            )
        except (ValueError, AssertionError, NotImplementedError):
            # No topology-aware layout for this shape: a plain reshape is always valid.
            grid = np.asarray(devices).reshape((1, *per_slice))
    return Mesh(grid, MESH_AXES, axis_types=auto)


def offline_mesh(cfg: MeshConfig) -> Mesh:
    """For work outside a job (eval, sample, import): the run's own mesh where this machine has
    its device count, else one device."""
    devices = jax.devices()
    return build_mesh(cfg) if cfg.size == len(devices) else build_mesh(MeshConfig(), devices[:1])


def _slice_grid(cfg: MeshConfig, devices: list, per_slice: tuple[int, int, int]) -> np.ndarray:
    """The slice axis spans the slow network: JAX's hybrid mesh over TPU slices where devices
    know their slice, else whole hosts grouped in process order."""
    if all(hasattr(d, "slice_index") for d in devices):
        return mesh_utils.create_hybrid_device_mesh(
            per_slice, (cfg.slices, 1, 1), devices=devices
        ).reshape((cfg.slices, *per_slice))
    procs = sorted({d.process_index for d in devices})
    if len(procs) % cfg.slices:
        raise ConfigError(
            f"mesh.slices = {cfg.slices} must divide the {len(procs)} host(s) of this job, since "
            "without TPU slice information each slice is a group of whole hosts"
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.asarray(ordered).reshape((cfg.slices, *per_slice))


def _axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in names)


def mesh_spec(
    logical: tuple | PartitionSpec | None, shape: tuple[int, ...], mesh: Mesh
) -> PartitionSpec:
    """Logical names → mesh PartitionSpec; a dimension the mesh axis does not divide stays replicated."""
    if logical is None:
        return PartitionSpec()
    names = tuple(logical)
    out = []
    for dim, name in zip(shape, names, strict=False):
        axes = LOGICAL_RULES.get(name) if name is not None else None
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule")
        out.append(axes if axes is not None and dim % _axis_size(mesh, axes) == 0 else None)
    return PartitionSpec(*out)


def batch_sharding(mesh: Mesh, ndim: int, leading: int = 0) -> NamedSharding:
    """Rows split over the batch axes (slice x data x fsdp, LOGICAL_RULES["batch"]); `leading`
    unsharded dims (e.g. the microbatch axis) before them."""
    spec = [None] * leading + [LOGICAL_RULES["batch"]] + [None] * (ndim - leading - 1)
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
