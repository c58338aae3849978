"""Plan targets: a catalogue accelerator, hosts and slices as compile-only devices.

TPU targets come from libtpu's topology descriptions (no chip needed), GPU targets from the CUDA
PJRT plugin given a `GpuTargetConfigProto` per chip kind (`gpu_targets/*.txtpb`, no GPU or
driver needed), `cpu` is this process's own host devices (`--xla_force_host_platform_device_count`).
HBM per chip is the vendor's published capacity; peak FLOP/s come from
`jobspec.hardware.peaks.peak_bf16_flops`, the table MFU is reported with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from importlib import resources

from jobspec.errors import ConfigError
from jobspec.hardware.catalogue import Accelerator, lookup
from jobspec.hardware.peaks import peak_bf16_flops

GIB = 2**30
# Published HBM per chip (bytes). TPU v5p: 95 GB; the compiler itself reports 95.74 GiB usable.
HBM_BYTES = {
    "v4": 32 * GIB,
    # What a program may use, not the nameplate: a v5e chip's memory_stats() bytes_limit and
    # its compiler's "exceeds available HBM (15.75G)"; v5p's compiler says 95.74G.
    "v5e": int(15.75 * GIB),
    "v5p": int(95.74 * GIB),
    "v6e": 32 * GIB,
    "a100-40gb": 40 * GIB,
    "a100-80gb": 80 * GIB,
    "h100-80gb": 80 * GIB,
    "h200": 141 * 10**9,
}
# libtpu topology-name prefix per generation; v4 and v5p chips are one megacore device each.
_TPU_TOPOLOGY = {"v4": ("v4", "megacore"), "v5p": ("v5", "megacore"), "v5e": ("v5e", None),
                 "v6e": ("v6e", None)}  # fmt: skip
_GPU_TOPOLOGY = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-80gb": "h100", "h200": "h200"}
GPUS_PER_NODE = 8


def tpu_topology(acc: Accelerator) -> str:
    """The slice's chip grid, e.g. "2x2x1": the catalogue's GKE topology selector."""
    return acc.node_selector["cloud.google.com/gke-tpu-topology"]


def tpu_generation(acc: Accelerator) -> str:
    gen = acc.name.split("-")[1]
    return "v5e" if gen == "v5litepod" else gen


def gpu_target_config(name: str) -> str:
    """The GpuTargetConfigProto text for a catalogue GPU name."""
    return resources.files("runtime.plan.gpu_targets").joinpath(f"{name}.txtpb").read_text()


@dataclass(frozen=True)
class Target:
    accelerator: str
    kind: str  # "tpu" | "gpu" | "cpu"
    hosts: int
    slices: int
    chips_per_host: int
    hbm_bytes: int | None  # per chip; None for cpu
    topology: str  # TPU chip grid per slice, GPU "slices x hosts x gpus", cpu "N"

    @property
    def device_count(self) -> int:
        return self.hosts * self.slices * self.chips_per_host

    @cached_property
    def devices(self) -> list:
        """Compile-only devices (TPU, GPU) or this process's CPU devices, in id order."""
        import jax

        if self.kind == "cpu":
            return list(jax.devices("cpu"))
        from jax.experimental.topologies import get_topology_desc

        if self.kind == "gpu":
            desc = get_topology_desc(
                topology_name=_GPU_TOPOLOGY[self.accelerator],
                platform="cuda",
                target_config=gpu_target_config(self.accelerator),
                topology=self.topology,
            )
            return list(desc.devices)
        acc = lookup(self.accelerator)
        prefix, chip_config = _TPU_TOPOLOGY[tpu_generation(acc)]
        grid = [int(x) for x in self.topology.split("x")]
        dims3 = (grid + [1, 1])[:3]
        per_host = dims3 if self.hosts == 1 else [2, 2, 1]
        # Full cubes of 4 chips per side wrap around (a torus); smaller slices are meshes.
        wrap = tuple(len(grid) == 3 and all(d % 4 == 0 for d in grid) for _ in range(3))
        kwargs = {"chip_config_name": chip_config} if chip_config else {}
        desc = get_topology_desc(
            platform="tpu",
            topology_name=f"{prefix}:{self.topology}",
            chips_per_host_bounds=tuple(per_host),
            num_slices=self.slices,
            wrap=wrap,
            **kwargs,
        )
        return list(desc.devices)

    @cached_property
    def chip(self) -> tuple[str, float] | None:
        """(catalogue name, peak dense bf16 FLOP/s per chip) from the compiled devices' kind."""
        return None if self.kind == "cpu" else peak_bf16_flops(self.devices[0].device_kind)

    @property
    def peak_flops(self) -> float | None:
        return self.chip[1] if self.chip else None

    @property
    def catalogue_name(self) -> str | None:
        return self.chip[0] if self.chip else None

    def describe(self) -> dict:
        return {
            "accelerator": self.accelerator,
            "kind": self.kind,
            "hosts": self.hosts,
            "slices": self.slices,
            "chips_per_host": self.chips_per_host,
            "devices": self.device_count,
            "topology": self.topology,
            "hbm_bytes_per_chip": self.hbm_bytes,
        }


def resolve_target(accelerator: str, hosts: int | None = None, slices: int = 1) -> Target:
    """The target for `--accelerator/--hosts/--slices`, or a ConfigError naming the option."""
    try:
        acc = lookup(accelerator)
    except ConfigError as e:
        raise ConfigError(f"--accelerator: {str(e).removeprefix('accelerator: ')}") from None
    if slices < 1:
        raise ConfigError(f"--slices: {slices} is not a slice count; use 1 or more")
    if hosts is not None and hosts < 1:
        raise ConfigError(f"--hosts: {hosts} is not a host count; use 1 or more")
    if acc.kind == "tpu":
        if hosts not in (None, acc.hosts_per_slice):
            raise ConfigError(
                f"--hosts: {acc.name} is {acc.hosts_per_slice} host(s) of {acc.chips_per_host} "
                f"chips per slice, so --hosts must be {acc.hosts_per_slice} (or unset), not {hosts}"
            )
        gen = tpu_generation(acc)
        return Target(acc.name, "tpu", acc.hosts_per_slice or 1, slices, acc.chips_per_host,
                      HBM_BYTES[gen], tpu_topology(acc))  # fmt: skip
    if slices != 1:
        raise ConfigError(
            f"--slices: {slices} slices need a TPU accelerator; {acc.name} runs as one group of "
            "hosts, so set --hosts instead and remove --slices"
        )
    if acc.kind == "gpu":
        n = hosts or 1
        return Target(acc.name, "gpu", n, 1, GPUS_PER_NODE, HBM_BYTES[acc.name],
                      f"1x{n}x{GPUS_PER_NODE}")  # fmt: skip
    if hosts not in (None, 1):
        raise ConfigError(
            f"--hosts: the cpu target is this process's own devices (one host), not {hosts}; "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=N for N devices"
        )
    import jax

    n = len(jax.devices("cpu"))
    return Target("cpu", "cpu", 1, 1, n, None, str(n))


def check_mesh(mesh_size: int, mesh_slices: int, target: Target) -> None:
    """The run's mesh must use exactly the target's devices, and its slices."""
    if mesh_size != target.device_count:
        raise ConfigError(
            f"mesh.fsdp: slices x data x expert x fsdp x context x tensor = {mesh_size} devices, but {target.accelerator}"
            f" x {target.hosts} host(s) x {target.slices} slice(s) has {target.device_count} "
            f"({target.chips_per_host} per host); make the mesh product {target.device_count} "
            "(e.g. with --set mesh.fsdp=N)"
        )
    if mesh_slices not in (1, target.slices):
        raise ConfigError(
            f"mesh.slices: the run's mesh has {mesh_slices} slices but --slices is "
            f"{target.slices}; make them equal"
        )
