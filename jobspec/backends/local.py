"""job.yaml `local:`: the job's hosts as processes on this machine, on its CPU."""

from __future__ import annotations

from pydantic import Field

from jobspec.backends.section import BackendSection
from jobspec.errors import ConfigError
from jobspec.hardware.catalogue import Accelerator
from jobspec.section import PositiveInt

# Every host is a process on this machine: past a few dozen they only contend for its cores and
# memory (and 20,000 wrote a 16 MB hosts.json).
MAX_LOCAL_PROCESSES = 64


class LocalSection(BackendSection):
    processes: PositiveInt | None = Field(None, description="Host processes (default: hosts).")
    devices_per_process: PositiveInt = Field(1, description="CPU devices per process.")

    def host_processes(self, hosts: int, acc: Accelerator) -> int:
        procs = self.processes or hosts
        if procs > MAX_LOCAL_PROCESSES:
            fixed = acc.hosts_per_slice is not None  # a TPU slice's own host count
            field = "local.processes" if self.processes else "accelerator" if fixed else "hosts"
            raise ConfigError(
                f"{field}: {procs} host processes is more than the {MAX_LOCAL_PROCESSES} the local "
                "backend runs on one machine; use fewer (and a mesh to match), or the slurm or k8s "
                "backend"
            )
        return procs

    def devices_per_host(self, acc: Accelerator) -> int:
        return self.devices_per_process
