"""The mesh from `[mesh]`, and the one table mapping logical axis names to mesh axes.

Model code names only logical axes (parameters: vocab, embed, heads, kv_heads, mlp, norm,
expert, and `layers`, the leading axis of parameters stacked for `model.scan_layers`;
activations also batch and length); this module alone knows mesh axes. FSDP shards
parameters (and so optimizer state) over `fsdp` along `embed`; TP shards heads, MLP hidden and
vocab over `tensor`; MoE experts shard over `expert`; the batch is split over `slice` x `data` x
`expert` x `fsdp` (outside the MoE blocks the expert axis is one more data-parallel axis).

One table serves parameters and activations: a mesh axis is used once per array, by the first
dimension that claims it, so an activation [batch, length, embed] puts `fsdp` on the batch
while the parameter [embed, mlp] puts it on embed. `constrain(x, names)` pins an activation to
that layout inside a traced step; it is a no-op outside `activation_mesh(mesh)`, so a model
called without a mesh (tests, CPU tools) runs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jobspec.errors import ConfigError
from jobspec.run_config import MeshConfig

MESH_AXES = ("slice", "data", "expert", "fsdp", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("slice", "data", "expert", "fsdp"),
    "length": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    # MoE experts: sharded over the expert-parallel axis (runtime/model/moe_dispatch.py).
    "expert": "expert",
    # The stacked-layer axis of scanned parameters: every chip holds every layer's shard (the
    # scan slices one layer per step), so it is never split.
    "layers": None,
}


def build_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if cfg.size != len(devices):
        raise ConfigError(
            f"mesh.slices x mesh.data x mesh.expert x mesh.fsdp x mesh.tensor = {cfg.slices} x "
            f"{cfg.data} x {cfg.expert} x {cfg.fsdp} x {cfg.tensor} = {cfg.size}, but this job has "
            f"{len(devices)} device(s); make the product equal the device count"
        )
    per_slice = (cfg.data, cfg.expert, cfg.fsdp, cfg.tensor)
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


def _slice_grid(cfg: MeshConfig, devices: list, per_slice: tuple[int, ...]) -> np.ndarray:
    """The slice axis spans the slow network: JAX's hybrid mesh over TPU slices where devices
    know their slice, else whole hosts grouped in process order."""
    if all(hasattr(d, "slice_index") for d in devices):
        return mesh_utils.create_hybrid_device_mesh(
            per_slice, (cfg.slices, 1, 1, 1), devices=devices
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
    """Logical names → mesh PartitionSpec. A dimension the mesh axes do not divide, or whose
    mesh axes an earlier dimension already took, stays replicated."""
    if logical is None:
        return PartitionSpec()
    names = tuple(logical)
    out = []
    used: set[str] = set()
    for dim, name in zip(shape, names, strict=False):
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule")
        axes = LOGICAL_RULES.get(name) if name is not None else None
        group = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        # Size-1 mesh axes shard nothing; dropping them keeps specs short and comparable.
        group = tuple(a for a in group if a not in used and mesh.shape[a] > 1)
        if group and dim % _axis_size(mesh, group) == 0:
            used.update(group)
            out.append(group[0] if len(group) == 1 else group)
        else:
            out.append(None)
    return PartitionSpec(*out)


_ACTIVATION_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "activation_mesh", default=None
)


@contextlib.contextmanager
def activation_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Within this context (at trace time), `constrain` pins activations on `mesh`."""
    token = _ACTIVATION_MESH.set(mesh)
    try:
        yield
    finally:
        _ACTIVATION_MESH.reset(token)


def on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced under `activation_mesh(mesh)`: what every jitted step over model code wraps,
    so its sharding constraints and per-shard kernels see the mesh."""

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with activation_mesh(mesh):
            return fn(*args, **kwargs)

    return traced


def current_mesh() -> Mesh | None:
    """The mesh `activation_mesh` set for the trace in progress, or None."""
    return _ACTIVATION_MESH.get()


def _device_platform(device) -> str:
    """'tpu', 'cuda', 'rocm' or 'cpu' for a (possibly compile-only) device."""
    platform = device.platform
    if platform == "gpu":
        version = str(getattr(device.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def target_platform() -> str:
    """The platform the trace in progress compiles for: the current mesh's devices, else JAX's
    default backend."""
    mesh = current_mesh()
    if mesh is not None:
        return _device_platform(mesh.devices.flat[0])
    backend = jax.default_backend()
    if backend == "gpu":
        return _device_platform(jax.devices()[0])
    return backend


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """x with a sharding constraint from its logical axis names (one per dimension)."""
    mesh = _ACTIVATION_MESH.get()
    if mesh is None or mesh.size == 1:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {names} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, mesh_spec(names, x.shape, mesh)))


def batch_sharding(mesh: Mesh, ndim: int, leading: int = 0) -> NamedSharding:
    """Rows split over the batch axes (slice x data x expert x fsdp, LOGICAL_RULES["batch"]); `leading`
    unsharded dims (e.g. the microbatch axis) before them."""
    spec = [None] * leading + [LOGICAL_RULES["batch"]] + [None] * (ndim - leading - 1)
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
