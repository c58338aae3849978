"""The local backend (the default): the job's N host processes on this machine, on CPU.

`submit` writes the run's folder in the registry (cfg.toml, job.yaml, plan.json) and starts a
detached supervisor (`supervisor.py`, run as `python -m launch.backends.local supervise`) that
runs and restarts the hosts; `status`, `logs` and `cancel` read its files and signal it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from launch.backend import Handle, RenderedFile, Submission
from launch.backends.local import render, status, submit
from launch.state import RunFolders


class LocalBackend:
    """The Backend protocol for this machine, over the render/submit/status modules."""

    name = "local"
    writes_run_files = True  # submit writes cfg.toml and job.yaml into the registry's run folder
    handle_keys = ("run_dir",)
    cli_options = ()

    def __init__(self, registry: RunFolders | None = None) -> None:
        self.registry = registry or RunFolders()

    def render(self, sub: Submission) -> list[RenderedFile]:
        return render.render_files(sub, self.registry.run_dir(sub.run_id))

    def submit(self, sub: Submission) -> Handle:
        return submit.submit(self.registry, sub)

    def status(self, handle: Handle) -> dict[str, Any]:
        return status.status(handle)

    def cancel(self, handle: Handle) -> None:
        submit.cancel(handle)

    def logs(
        self,
        handle: Handle,
        *,
        host: int | None,
        follow: bool,
        tail: int | None,
        since_submission: bool = False,
    ) -> Iterator[str]:
        return status.logs(
            handle, host=host, follow=follow, tail=tail, since_submission=since_submission
        )
