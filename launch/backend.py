"""What every backend implements, and the facts a submission hands it.

`launch` never imports jax: backends render and submit; the hosts run `runtime worker`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from jobspec.errors import JaxjobError
from jobspec.job_spec import JobSpec

# The states after which a run never changes again (every backend's status() reports one of
# these, or pending/running/unknown).
TERMINAL = ("succeeded", "failed", "cancelled")


def has_ended(st: dict[str, Any]) -> bool:
    """Whether a status will not change any more: a terminal state, or `unknown` that the
    backend says is for good (`ended`: e.g. a JobSet gone without a record of how it ended)."""
    return st.get("state") in TERMINAL or bool(st.get("ended"))


T = TypeVar("T")


def tail_lines(lines: Sequence[T], tail: int | None) -> list[T]:
    """The last `tail` items of `lines` (all of them for None, none for 0), as `--tail` means."""
    if tail is None:
        return list(lines)
    return list(lines[max(0, len(lines) - tail) :])


class AlreadyRunningError(JaxjobError):
    """A submit of a run id whose previous submission has not ended: two submissions of one run
    would train side by side and overwrite each other's state."""

    def __init__(self, run_id: str, state: str, attempt: int | None, started: str | None) -> None:
        facts = [f"attempt {attempt}"] if attempt is not None else []
        facts += [f"started {started[:19].replace('T', ' ')} UTC"] if started else []
        said = f" ({', '.join(facts)})" if facts else ""
        super().__init__(
            f"run {run_id} is already {state}{said}; launch cancel {run_id} first or use "
            "another run_id"
        )


@dataclass(frozen=True)
class Submission:
    """Everything a backend needs to render or submit one run."""

    spec: JobSpec
    run_id: str  # DNS-1123 label, the JAXJOB_RUN_ID of every host
    run_toml: str  # the run config every host reads (cfg.toml), run.id already set to run_id
    spec_yaml: str  # the validated job spec, re-serialised (jobspec.job_spec.spec_yaml)
    output_uri: str  # run.output_uri (the run's artifacts are under <output_uri>/<run_id>)
    workdir: Path  # where the job.yaml lives (relative paths resolve here)
    # `launch --set/--env` given: {"set": {key: TOML value}, "env": {NAME: value}}
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class RenderedFile:
    name: str  # file name inside the render directory, e.g. jobset.yaml, job.sbatch
    content: str


@dataclass
class Handle:
    """What the run registry stores for a submitted run (JSON-serialisable `data`)."""

    backend: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterRun:
    """A run jaxjob started that a backend found on its cluster (`launch list --backend B`),
    whether or not this machine submitted it: enough to list it, cancel it and clean it up."""

    run_id: str
    state: str  # as status() says: pending|running|succeeded|failed|cancelled|unknown
    detail: str
    submitted: str  # ISO 8601, UTC ("" when the cluster does not say)
    handle: Handle  # status/cancel/forget take it as they take a registry record's
    where: str  # where it was found, e.g. "k8s ns/jobset-name" or "slurm job 123"


class Backend(Protocol):
    """A way to run a job's hosts, registered by name in `launch.backends.BACKENDS`. Its job.yaml
    section (options, host processes, devices per host) is `jobspec.backends.<name>`."""

    name: str
    # Whether submit writes cfg.toml and job.yaml into the registry's run folder itself;
    # otherwise `launch submit` writes them there (once) for the record.
    writes_run_files: bool
    # What status/logs/cancel read from a Handle's data: a run record without them is broken.
    handle_keys: ClassVar[tuple[str, ...]]
    # The `launch submit/render` options it takes (`context` for --context), passed to its
    # constructor by name; the registry keeps them with the run for status/logs/cancel.
    cli_options: ClassVar[tuple[str, ...]]

    def render(self, sub: Submission) -> list[RenderedFile]:
        """Exactly what submit would send; nothing is sent."""

    def submit(self, sub: Submission) -> Handle: ...

    def status(self, handle: Handle) -> dict[str, Any]:
        """{"state": pending|running|succeeded|failed|cancelled|unknown, "detail": str, ...}."""

    def logs(
        self,
        handle: Handle,
        *,
        host: int | None,
        follow: bool,
        tail: int | None,
        since_submission: bool = False,
    ) -> Iterator[str]:
        """Lines of every host's output (or one host's), each prefixed `[host N] `;
        `since_submission`: only what the handle's own submission ran (`--wait`), not an
        earlier submission of the same run_id."""

    def cancel(self, handle: Handle) -> None:
        """Graceful: SIGTERM to every host first, so the runtime checkpoints."""

    # Optional, for backends with a cluster to ask (k8s, slurm); `launch list/cancel/clean`
    # check with hasattr:
    #   identity_keys: ClassVar[tuple[str, ...]]
    #       the handle keys that name one submission on the cluster (a run both this machine's
    #       registry and cluster_runs know is listed once);
    #   cluster_runs(self, all_namespaces: bool = False) -> list[ClusterRun]
    #       the runs jaxjob made there that the cluster still knows, newest first;
    #   forget(self, handle: Handle) -> str | None
    #       remove what the cluster keeps of an ended run (k8s: its JobSet and ConfigMap),
    #       never the run's storage; what was removed ("JobSet ns/name"), None if nothing;
    #   timed_logs(self, handle, *, host, tail, since_s, timestamps) -> Iterator[str]
    #       `launch logs --follow --since/--timestamps` from the backend's own line times (k8s:
    #       the kubelet's); without it, the run folder's recorded times (launch/logs_options.py).
