"""What every backend's job.yaml section answers; `JobSpec` asks the section of the backend a
job is submitted to, so no check in the job spec names a backend."""

from __future__ import annotations

from typing import ClassVar

from jobspec.hardware.catalogue import Accelerator
from jobspec.prepare_job import PrepareSection
from jobspec.section import Section


class BackendSection(Section):
    """A backend's options in job.yaml, and how its hosts are laid out."""

    # Whether the hosts see this machine's paths (here or through a shared filesystem): a
    # relative output_uri then means "here" and is resolved before submitting.
    hosts_see_this_filesystem: ClassVar[bool] = True

    def host_processes(self, hosts: int, acc: Accelerator) -> int:
        """Host processes of a job of `hosts` hosts (every slice's) on `acc`."""
        return hosts

    def devices_per_host(self, acc: Accelerator) -> int:
        return acc.chips_per_host

    def check_prepare(self, section: PrepareSection) -> None:
        """Refuse (ConfigError) a prepare job whose paths its hosts could not reach; hosts that
        see this machine's files reach them all."""
