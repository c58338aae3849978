"""job.yaml `slurm:`: sbatch's settings, and the optional container (pyxis/enroot)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from jobspec.backends.section import BackendSection
from jobspec.section import PositiveInt, Section


class ContainerSection(Section):
    image: str = Field(description="Container image for srun --container-image (pyxis/enroot).")
    mounts: list[str] = Field([], description="srun --container-mounts entries, SRC:DST.")


class SlurmSection(BackendSection):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = Field("01:00:00", description="Time limit, as sbatch --time takes it.")
    constraint: str | None = None
    cpus_per_task: PositiveInt | None = Field(None, description="CPUs per host task.")
    setup: list[str] = Field([], description="Shell lines run before srun (module load, venv…).")
    signal_grace_s: Annotated[int, Field(ge=10)] = Field(
        120, description="SIGTERM this long before the time limit, so the run checkpoints."
    )
    container: ContainerSection | None = None
    hosts_per_node: PositiveInt = Field(
        1,
        description="Host processes per node; above 1 only for CPU jobs (e.g. a one-node dev cluster).",
    )
