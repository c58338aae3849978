"""JobSpec: the `job.yaml` a user submits to any backend (local, slurm, k8s).

Only this module and jobspec/files/job_yaml.py parse YAML. The run config it names is a RunConfig
(cfg.toml), given as a path relative to the job.yaml or inline; a job with `prepare:` instead of
`run:` prepares a dataset on all of its hosts (jobspec/prepare_job.py). Nothing here imports jax.
"""

from __future__ import annotations

import re

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jobspec.backends.k8s import K8sSection
from jobspec.backends.local import LocalSection
from jobspec.backends.section import BackendSection
from jobspec.backends.slurm import SlurmSection
from jobspec.errors import ConfigError
from jobspec.files.secrets import find_secrets, refusal, secret_env_name
from jobspec.hardware.catalogue import Accelerator, lookup
from jobspec.prepare_job import PrepareSection
from jobspec.run_config import RunConfig, check_dns_label
from jobspec.section import NonNegativeInt, PositiveInt

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: `$` passes "NAME\n"
RESERVED_ENV = ("JAXJOB_", "JAX_COORDINATOR", "JAX_PLATFORMS")


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecretRef(Spec):
    """A value taken from a Kubernetes secret (or, on SLURM/local, from this shell's env)."""

    secret: str = Field(description="Kubernetes secret name.")
    key: str = Field(description="Key inside the secret.")


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
    hosts: PositiveInt | None = Field(
        None, description="Hosts per slice (TPU: fixed by the slice; GPU: nodes; cpu: processes)."
    )
    slices: PositiveInt = Field(1, description="TPU slices (multi-slice over DCN).")
    output_uri: str | None = Field(None, description="Overrides run.output_uri (path or gs://).")
    env: dict[str, str | SecretRef] = Field(
        {}, description="Extra environment; secrets by reference."
    )
    max_restarts: NonNegativeInt = Field(3, description="Restarts of the whole job.")
    # One section per backend, named as `launch --backend` names it (jobspec/backends/).
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

    def backend_section(self, backend: str) -> BackendSection:
        """The job.yaml section of `backend` (a `launch --backend` name)."""
        section = getattr(self, backend, None) if backend in type(self).model_fields else None
        if not isinstance(section, BackendSection):
            raise ConfigError(f"no backend is called {backend!r}")
        return section

    def devices_per_host(self, backend: str) -> int:
        return self.backend_section(backend).devices_per_host(self.catalogue)

    def host_processes(self, backend: str) -> int:
        return self.backend_section(backend).host_processes(self.total_hosts, self.catalogue)


def spec_yaml(spec: JobSpec) -> str:
    """The validated job spec as YAML: the keys the user set, no comments, no unknown keys; what
    the backends embed (ConfigMap, run folder) instead of the file as written."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def check_mesh_fits(spec: JobSpec, run: RunConfig, backend: str) -> None:
    """The run's mesh must use exactly the job's devices; said before anything is submitted."""
    procs, per = spec.host_processes(backend), spec.devices_per_host(backend)
    devices = procs * per
    if run.mesh.size != devices:
        m = run.mesh
        raise ConfigError(
            f"run.mesh: {m.product()}, but this job has {procs} host(s) x {per} device(s) = {devices} on the "
            f"{backend} backend; make the mesh product {devices}"
        )
    if run.mesh.slices != 1 and run.mesh.slices != spec.slices:
        raise ConfigError(
            f"run.mesh.slices is {run.mesh.slices} but the job has slices: {spec.slices}; make them equal"
        )
