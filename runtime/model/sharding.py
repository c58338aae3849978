"""The mesh from `[mesh]`, and the one table mapping logical axis names to mesh axes.

Model code names only logical axes (parameters: vocab, embed, heads, kv_heads, mlp, norm,
expert, and `layers`, the leading axis of parameters stacked for `model.scan_layers`;
activations also batch and length); this module alone knows mesh axes. FSDP shards
parameters (and so optimizer state) over `fsdp` x `context` along `embed`; TP shards heads, MLP
hidden and vocab over `tensor`; MoE experts shard over `expert`; the batch is split over `slice`
x `data` x `expert` x `fsdp` (outside the MoE blocks the expert axis is one more data-parallel
axis), and each sequence's length over `context` (context parallelism: attention gathers the
keys and values over it, runtime/model/attention/kernels.py).

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

# `context` beside `tensor`, innermost but one: both exchange activations every layer, so they
# get the devices nearest each other.
MESH_AXES = ("slice", "data", "expert", "fsdp", "context", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("slice", "data", "expert", "fsdp"),
    "length": "context",
    "vocab": "tensor",
    # Parameters shard over the context devices too (as over fsdp's): each holds a part of every
    # layer, gathered when it runs; an activation's embed finds both axes taken by batch, length.
    "embed": ("fsdp", "context"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    # MoE experts: sharded over the expert-parallel axis (runtime/model/moe/dispatch.py).
    "expert": "expert",
    # The stacked-layer axis of scanned parameters: every chip holds every layer's shard (the
    # scan slices one layer per step), so it is never split.
    "layers": None,
}


def build_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if cfg.size != len(devices):
        raise ConfigError(
            f"{cfg.product()}, but this job has {len(devices)} device(s); make the product "
            "equal the device count"
        )
    per_slice = (cfg.data, cfg.expert, cfg.fsdp, cfg.context, cfg.tensor)
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
            per_slice, (cfg.slices, 1, 1, 1, 1), devices=devices
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
        if "context" in group and dim % _axis_size(mesh, group):
            # A parameter dim fsdp divides but fsdp x context does not: fsdp alone.
            group = tuple(a for a in group if a != "context")
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


def context_size() -> int:
    """The current mesh's `context` axis (1 without a mesh)."""
    mesh = _ACTIVATION_MESH.get()
    return 1 if mesh is None else int(mesh.shape["context"])


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """x with a sharding constraint from its logical axis names (one per dimension)."""
    mesh = _ACTIVATION_MESH.get()
    if mesh is None or mesh.size == 1:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {names} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, mesh_spec(names, x.shape, mesh)))


def batch_sharding(mesh: Mesh, ndim: int, leading: int = 0) -> NamedSharding:
    """Rows split over the batch axes (slice x data x expert x fsdp, LOGICAL_RULES["batch"]), and
    the dim after them (the sequence) over `context`; `leading` unsharded dims (e.g. the
    microbatch axis) before them."""
    rest = ["context" if mesh.shape["context"] > 1 else None] + [None] * (ndim - leading - 2)
    spec = [None] * leading + [LOGICAL_RULES["batch"]] + rest[: ndim - leading - 1]
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def host_block(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The part of a global array of `shape` this process's devices hold under `sharding`: one
    slice per dim, the union of its devices' shards (a box for every mesh built here: checked).
    With `context` across hosts, two hosts hold the same rows, each a part of the sequence."""
    boxes = {
        tuple((range(n)[sl][0], range(n)[sl][-1]) for sl, n in zip(idx, shape, strict=True))
        for idx in sharding.addressable_devices_indices_map(shape).values()
    }
    lo = [min(b[d][0] for b in boxes) for d in range(len(shape))]
    hi = [max(b[d][1] for b in boxes) + 1 for d in range(len(shape))]
    if math.prod(h - low for low, h in zip(lo, hi, strict=True)) != sum(
        math.prod(e - a + 1 for a, e in b) for b in boxes
    ):
        raise ValueError(f"this process's shards of {shape} under {sharding.spec} are not one box")
    return tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))


def host_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[int, int, slice]:
    """For a batch [accum, rows, seq] under `sharding`: (which block of rows this process reads,
    how many blocks the rows make, its part of the sequence). Processes that share rows (a
    `context` axis across hosts) read the same block and keep different parts of it."""
    box = host_block(sharding, shape)
    rows = box[1].stop - box[1].start
    return box[1].start // rows, shape[1] // rows, box[2]
