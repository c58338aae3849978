"""job.yaml `k8s:`: where the JobSet goes and how its pods run (Pod Security "restricted").

The pods share no folder with this machine: their paths must be storage they all reach."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from jobspec.backends.section import BackendSection
from jobspec.errors import ConfigError
from jobspec.names import check_k8s_names
from jobspec.prepare_job import PrepareSection, local_relative
from jobspec.run_config import is_remote

# A Kubernetes resource quantity, as emptyDir sizeLimit takes it (e.g. 8Gi, 512Mi).
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")  # fullmatch


class K8sSection(BackendSection):
    # Inside a container a relative path is the container's own.
    hosts_see_this_filesystem: ClassVar[bool] = False

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
    # root filesystem with emptyDirs where the runtime writes (docs/jobs-and-backends.md, "Kubernetes pods").
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

    @model_validator(mode="after")
    def _names(self) -> K8sSection:
        check_k8s_names(namespace=self.namespace, service_account=self.service_account,
                        queue=self.queue, priority_class=self.priority_class,
                        node_selector=self.node_selector, labels=self.labels,
                        annotations=self.annotations)  # fmt: skip
        return self

    def check_prepare(self, section: PrepareSection) -> None:
        """The dataset must go to storage every pod shares, and a relative path (this machine's
        job.yaml folder) means nothing inside a container."""
        if not is_remote(section.out):
            raise ConfigError(
                f"prepare.out: {section.out!r} is a local path, but on the k8s backend every pod "
                "writes its parts into prepare.out, which must be storage they all share; use gs://…"
            )
        named = [("prepare.tokenizer", section.tokenizer)] if section.tokenizer != "byte" else []
        named += [(f"prepare.inputs[{k}]", p) for k, p in enumerate(section.inputs)]
        for field, path in named:
            if local_relative(path):
                raise ConfigError(
                    f"{field}: {path!r} is relative to the job.yaml's folder on this machine, "
                    "which the pods do not have; use gs://… or an absolute path inside the image"
                )
