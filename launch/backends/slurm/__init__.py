"""The SLURM backend: one sbatch script per run, status without accounting, logs per host.

A run directory (`rundir`, on a filesystem every node and the submitting host share) holds
`job.sbatch`, `cfg.toml`, `job.yaml`, `logs/host-<N>.log` (one per host, from srun) and
`logs/batch.log` (the batch shell: what it decided and why). `render` writes the script (its
docstring says what the script does and why), `submit` runs sbatch/scontrol/scancel, `status`
reads state and logs. `launch` never imports jax.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError
from launch.backend import ClusterRun, Handle, RenderedFile, Submission
from launch.backends.slurm import queue, render, status, submit
from launch.backends.slurm.render import RunDir, default_rundir
from launch.backends.slurm.submit import SlurmError

__all__ = ["SlurmBackend", "SlurmError"]


class SlurmBackend:
    """Render, submit, watch and cancel runs through sbatch/scontrol/scancel on this shell's cluster.

    `hosts_per_node` > 1 packs that many host processes on each node, for CPU jobs only: how a
    one-machine dev cluster runs a 2-host job. Production GPU jobs keep one host per node.
    `runtime_command` starts the runtime on a node (default `runtime`, on the nodes' PATH after
    the setup lines). On a multi-cluster site the cluster sbatch names is kept in the handle and
    passed to every later command as `--clusters`.
    """

    name = "slurm"
    # submit writes cfg.toml and job.yaml into the run directory (by default the registry's)
    writes_run_files = True
    handle_keys = ("job_id", "workdir")
    identity_keys = ("job_id",)  # one submission on the cluster (launch list: seen once)
    cli_options = ()

    def __init__(
        self,
        *,
        hosts_per_node: int | None = None,
        runtime_command: Sequence[str] = ("runtime",),
        poll_s: float = 1.0,
    ) -> None:
        # None: the job spec's slurm.hosts_per_node decides.
        if hosts_per_node is not None and hosts_per_node < 1:
            raise ConfigError(f"hosts_per_node={hosts_per_node} must be at least 1")
        self.hosts_per_node = hosts_per_node
        self.runtime_command = tuple(runtime_command)
        self.poll_s = poll_s

    def render(
        self, sub: Submission, *, rundir: Path | None = None, cwd: Path | None = None
    ) -> list[RenderedFile]:
        """job.sbatch, cfg.toml and job.yaml, as submit writes them into `rundir` (default: the
        run's registry folder); the hosts start in `cwd` (default: this working directory)."""
        return render.render_files(
            sub,
            Path(os.path.abspath(rundir or default_rundir(sub.run_id))),
            cwd=cwd,
            hosts_per_node=self.hosts_per_node or sub.spec.slurm.hosts_per_node,
            runtime_command=self.runtime_command,
        )

    def submit(
        self, sub: Submission, *, rundir: Path | None = None, cwd: Path | None = None
    ) -> Handle:
        rd = RunDir(Path(os.path.abspath(rundir or default_rundir(sub.run_id))))
        cwd = Path(os.path.abspath(cwd if cwd is not None else os.getcwd()))
        return submit.submit(sub, rd, self.render(sub, rundir=rd.root, cwd=cwd))

    def status(self, handle: Handle) -> dict[str, Any]:
        return status.status(handle)

    def logs(
        self,
        handle: Handle,
        *,
        host: int | None = None,
        follow: bool = False,
        tail: int | None = None,
        since_submission: bool = False,
    ) -> Iterator[str]:
        """Each host's log lines, prefixed `[host N] `; with follow, until the job has ended.
        (Every sbatch job is one submission: `since_submission` changes nothing.)"""
        return status.logs(handle, host=host, follow=follow, tail=tail, poll_s=self.poll_s)

    def cancel(self, handle: Handle, *, grace_s: float | None = None, wait: bool = False) -> None:
        """SIGTERM to every host, then scancel after the grace (see submit.cancel)."""
        submit.cancel(handle, grace_s=grace_s, wait=wait, poll_s=self.poll_s)

    def cluster_runs(self, all_namespaces: bool = False) -> list[ClusterRun]:
        """The user's jaxjob jobs in squeue (queue.py); `all_namespaces` is k8s's alone."""
        return queue.cluster_runs(self.status)

    def escalate(self, handle: Handle, grace_s: float) -> None:
        """Wait up to `grace_s` for the job to end after its SIGTERM, then scancel it outright."""
        submit.escalate(handle, grace_s, poll_s=self.poll_s)
