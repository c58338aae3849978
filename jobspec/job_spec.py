"""JobSpec: the `job.yaml` a user submits to any backend (local, slurm, k8s).

Only this module and jobspec/load_job.py parse YAML. The run config it names is a RunConfig
(cfg.toml), given as a path relative to the job.yaml or inline; a job with `prepare:` instead of
`run:` prepares a dataset on all of its hosts (jobspec/prepare_job.py). Nothing here imports jax.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jobspec.catalogue import Accelerator, lookup
from jobspec.errors import ConfigError
from jobspec.names import check_k8s_names
from jobspec.prepare_job import PrepareSection
from jobspec.run_config import RunConfig, check_dns_label
from jobspec.secrets import find_secrets, refusal, secret_env_name

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: `$` passes "NAME\n"
# A Kubernetes resource quantity, as emptyDir sizeLimit takes it (e.g. 8Gi, 512Mi).
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")  # fullmatch
RESERVED_ENV = ("JAXJOB_", "JAX_COORDINATOR", "JAX_PLATFORMS")
# The local backend runs every host as a process on this machine: past a few dozen they only
# contend for its cores and memory (and 20,000 wrote a 16 MB hosts.json).
MAX_LOCAL_PROCESSES = 64


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecretRef(Spec):
    """A value taken from a Kubernetes secret (or, on SLURM/local, from this shell's env)."""

    secret: str = Field(description="Kubernetes secret name.")
    key: str = Field(description="Key inside the secret.")


class K8sSection(Spec):
    namespace: str = Field("default", description="Namespace of the JobSet and ConfigMap.")
    service_account: str | None = Field(None, description="Pod service account.")
    queue: str | None = Field(
        None, description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name)."
    )
    priority_class: str | None = Field(None, description="PriorityClass of the pods.")
    node_selector: dict[str, str] = Field({}, description="Added to the accelerator's selectors.")
    tolerations: list[dict] = Field([], description="Pod tolerations, as Kubernetes writes them.")
    labels: dict[str, str] = Field({}, description="Extra labels on the JobSet and pods.")
    annotations: dict[str, str] = Field({}, description="Extra annotations on the JobSet and pods.")
    termination_grace_s: Annotated[int, Field(ge=30)] = Field(
        300, description="SIGTERM to SIGKILL: time for the final checkpoint."
    )
    ttl_after_finished_s: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Delete the JobSet this long after it finishes."
    )
    # Pod Security "restricted": the pods run as this numeric non-root user, on a read-only
    # root filesystem with emptyDirs where the runtime writes (README, "Kubernetes").
    run_as_user: Annotated[int, Field(ge=1)] = Field(
        1000, description="Numeric user id the containers run as (never 0)."
    )
    run_as_group: Annotated[int, Field(ge=1)] = Field(
        1000, description="Numeric group id of the containers; also the pod's fsGroup."
    )
    shm_size: str = Field(
        "16Gi", description="Size limit of /dev/shm (memory-backed; NCCL and XLA use it)."
    )
    scratch_size: str = Field(
        "20Gi", description="Size limit of each writable scratch emptyDir (HOME, /tmp)."
    )

    @field_validator("shm_size", "scratch_size")
    @classmethod
    def _quantity(cls, v: str) -> str:
        if not QUANTITY.fullmatch(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity; write it like 16Gi or 512Mi")
        return v


class ContainerSection(Spec):
    image: str = Field(description="Container image for srun --container-image (pyxis/enroot).")
    mounts: list[str] = Field([], description="srun --container-mounts entries, SRC:DST.")


class SlurmSection(Spec):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = Field("01:00:00", description="Time limit, as sbatch --time takes it.")
    constraint: str | None = None
    cpus_per_task: Annotated[int, Field(gt=0)] | None = Field(
        None, description="CPUs per host task."
    )
    setup: list[str] = Field([], description="Shell lines run before srun (module load, venv…).")
    signal_grace_s: Annotated[int, Field(ge=10)] = Field(
        120, description="SIGTERM this long before the time limit, so the run checkpoints."
    )
    container: ContainerSection | None = None
    hosts_per_node: Annotated[int, Field(gt=0)] = Field(
        1,
        description="Host processes per node; above 1 only for CPU jobs (e.g. a one-node dev cluster).",
    )


class LocalSection(Spec):
    processes: Annotated[int, Field(gt=0)] | None = Field(
        None, description="Host processes (default: hosts)."
    )
    devices_per_process: Annotated[int, Field(gt=0)] = Field(
        1, description="CPU devices per process."
    )


class JobSpec(Spec):
    name: str = Field(description="DNS-1123 label; the run id is the name plus a unique suffix.")
    run_id: str | None = Field(None, description="Fixed run id (resubmitting resumes that run).")
    image: str | None = Field(None, description="Container image (required by the k8s backend).")
    run: str | dict | None = Field(
        None, description="Run config: a TOML path relative to this file, or inline."
    )
    prepare: PrepareSection | None = Field(
        None, description="Instead of run: prepare a dataset, every host a share of its parts."
    )
    accelerator: str = Field("cpu", description="Catalogue name, e.g. cpu, tpu-v5e-16, h100-80gb.")
    hosts: Annotated[int, Field(gt=0)] | None = Field(
        None, description="Hosts per slice (TPU: fixed by the slice; GPU: nodes; cpu: processes)."
    )
    slices: Annotated[int, Field(gt=0)] = Field(1, description="TPU slices (multi-slice over DCN).")
    output_uri: str | None = Field(None, description="Overrides run.output_uri (path or gs://).")
    env: dict[str, str | SecretRef] = Field(
        {}, description="Extra environment; secrets by reference."
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(3, description="Restarts of the whole job.")
    k8s: K8sSection = K8sSection()
    slurm: SlurmSection = SlurmSection()
    local: LocalSection = LocalSection()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_dns_label(v, "", max_len=40)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        return None if v is None else check_dns_label(v, "")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str | SecretRef]) -> dict[str, str | SecretRef]:
        for name, value in v.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.startswith(RESERVED_ENV):
                raise ValueError(f"{name} is set by jaxjob itself (the env contract); remove it")
            if isinstance(value, str) and secret_env_name(name):
                raise ValueError(
                    f"{name} looks like a secret but has a literal value; reference it instead: "
                    f"{name}: {{secret: SECRET_NAME, key: KEY}}"
                )
        return v

    @model_validator(mode="after")
    def _run_or_prepare(self) -> JobSpec:
        if self.run is None and self.prepare is None:
            raise ValueError(
                "run: required key is missing; give the run config to train, or a prepare: "
                "section instead to prepare a dataset on the job's hosts"
            )
        if self.run is not None and self.prepare is not None:
            raise ValueError(
                "run and prepare: a job either trains (run) or prepares a dataset (prepare), not "
                "both; keep one and submit the other as a job of its own"
            )
        return self

    @model_validator(mode="after")
    def _no_literal_secrets(self) -> JobSpec:
        # Secret references are names, not values: left out of the scan.
        data = self.model_dump(mode="json")
        data["env"] = {k: v for k, v in data["env"].items() if isinstance(v, str)}
        for where, what in find_secrets(data):
            raise ValueError(refusal(where, what))
        return self

    @property
    def catalogue(self) -> Accelerator:
        return lookup(self.accelerator)

    @field_validator("k8s")
    @classmethod
    def _k8s_names(cls, v: K8sSection) -> K8sSection:
        check_k8s_names(namespace=v.namespace, service_account=v.service_account, queue=v.queue,
                        priority_class=v.priority_class, node_selector=v.node_selector,
                        labels=v.labels, annotations=v.annotations)  # fmt: skip
        return v

    @model_validator(mode="after")
    def _topology(self) -> JobSpec:
        try:
            acc = lookup(self.accelerator)
        except ConfigError as e:  # reported with the file name, like every other field
            raise ValueError(str(e)) from None
        if self.slices > 1 and not acc.multi_slice:
            raise ValueError(
                f"slices: {self.slices} slices need a TPU accelerator; {acc.name} runs as one group of "
                "hosts, so set hosts instead and remove slices"
            )
        if acc.hosts_per_slice is not None and self.hosts not in (None, acc.hosts_per_slice):
            raise ValueError(
                f"hosts: {acc.name} is {acc.hosts_per_slice} host(s) of {acc.chips_per_host} chips per "
                f"slice, so hosts must be {acc.hosts_per_slice} (or unset), not {self.hosts}"
            )
        return self

    @property
    def hosts_per_slice(self) -> int:
        acc = self.catalogue
        return acc.hosts_per_slice or self.hosts or 1

    @property
    def total_hosts(self) -> int:
        return self.hosts_per_slice * self.slices

    def devices_per_host(self, backend: Literal["local", "slurm", "k8s"]) -> int:
        if backend == "local":
            return self.local.devices_per_process
        return self.catalogue.chips_per_host

    def host_processes(self, backend: Literal["local", "slurm", "k8s"]) -> int:
        if backend != "local":
            return self.total_hosts
        procs = self.local.processes or self.total_hosts
        if procs > MAX_LOCAL_PROCESSES:
            fixed = self.catalogue.hosts_per_slice is not None  # a TPU slice's own host count
            field = (
                "local.processes" if self.local.processes else "accelerator" if fixed else "hosts"
            )
            raise ConfigError(
                f"{field}: {procs} host processes is more than the {MAX_LOCAL_PROCESSES} the local "
                "backend runs on one machine; use fewer (and a mesh to match), or the slurm or k8s "
                "backend"
            )
        return procs


def spec_yaml(spec: JobSpec) -> str:
    """The validated job spec as YAML: the keys the user set, no comments, no unknown keys; what
    the backends embed (ConfigMap, run folder) instead of the file as written."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def check_mesh_fits(
    spec: JobSpec, run: RunConfig, backend: Literal["local", "slurm", "k8s"]
) -> None:
    """The run's mesh must use exactly the job's devices; said before anything is submitted."""
    procs, per = spec.host_processes(backend), spec.devices_per_host(backend)
    devices = procs * per
    if run.mesh.size != devices:
        m = run.mesh
        raise ConfigError(
            f"run.mesh: slices x data x expert x fsdp x tensor = {m.slices} x {m.data} x "
            f"{m.expert} x {m.fsdp} x {m.tensor} = "
            f"{m.size}, but this job has {procs} host(s) x {per} device(s) = {devices} on the "
            f"{backend} backend; make the mesh product {devices}"
        )
    if run.mesh.slices != 1 and run.mesh.slices != spec.slices:
        raise ConfigError(
            f"run.mesh.slices is {run.mesh.slices} but the job has slices: {spec.slices}; make them equal"
        )
