"""How a host process learns who it is, and joins the others: the one boot path of `runtime`.

Every backend sets the same environment contract (docs/jobs-and-backends.md, "Multi-host"):

    JAXJOB_RUN_ID  JAXJOB_COORDINATOR (host:port of process 0)  JAXJOB_NUM_PROCESSES
    JAXJOB_PROCESS_ID  JAXJOB_OUTPUT_URI  JAXJOB_ATTEMPT (default 0)
    JAXJOB_SUBMISSION_ID (one submission: the same on every host and every restarted attempt)

`boot()` picks one of three modes and records it in `BootInfo.mode`:

* ``contract``: the distributed variables are set and JAXJOB_NUM_PROCESSES > 1, so
  `jax.distributed.initialize` gets them explicitly;
* ``auto:<cluster>``: no (multi-process) contract, but JAX's own detector for SLURM (more than one
  task) or GKE TPU applies, so JAX derives the parameters;
* ``single-process``: neither; no coordination service.

What jax 0.10.2 does on a bad cluster, seen here, and why boot guards against it:

* a non-zero process whose coordinator is unreachable is killed by JAX from C++ (SIGABRT, exit
  134, "Terminating process because the JAX distributed service detected fatal errors ...
  DEADLINE_EXCEEDED ... RegisterTask") once `initialization_timeout` passes; so we first probe the
  coordinator's TCP port ourselves and raise a JaxjobError with one sentence;
* any process whose peers never all arrive blocks in `connect()` (with the GIL released) and is
  then aborted the same way; so a guard thread ends the process with EXIT_CLUSTER_TIMEOUT and one
  sentence just before JAX would (JAX's own timeout is set a little later than ours);
* process 0 on a port that is already in use gets a JaxRuntimeError ("Failed to start RPC
  server"), which we turn into a JaxjobError.

CPU rule for gloo: the run is on CPU when `jax_platforms` (JAX_PLATFORMS) names cpu first, or
when it is unset and no accelerator PJRT plugin (a `jax_plugins` module or entry point, or
libtpu) is installed. That is decided without initialising a backend, which
`jax.distributed.initialize` forbids.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from jobspec.errors import ConfigError, JaxjobError
from jobspec.exit_codes import EXIT_CLUSTER_TIMEOUT
from jobspec.run_config import check_dns_label
from runtime.host import hostlog

# JAX's own init deadline is ours plus this, so our sentence always comes before its abort.
_JAX_TIMEOUT_MARGIN_S = 10


def _jax_heartbeat_timeout_s(heartbeat_timeout_s: int) -> int:
    """JAX's heartbeat timeout for ours. JAX (0.10) heartbeats every half of its timeout and
    gives a host up once its last heartbeat is a timeout old (a client: once a heartbeat to a
    stopped service went unanswered for half of it), so a host that stops just before a
    heartbeat is given up after about half. Twice ours keeps JAX's abort at least
    `heartbeat_timeout_s` away. Seen with 90 s: a healthy peer aborted 50-57 s after the other
    host was SIGSTOPped, before a 60 s watchdog could name it."""
    return 2 * heartbeat_timeout_s


_DISTRIBUTED_VARS = ("JAXJOB_COORDINATOR", "JAXJOB_NUM_PROCESSES", "JAXJOB_PROCESS_ID")


# ---- the contract ----------------------------------------------------------------------------


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:1234
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"JAXJOB_COORDINATOR={address!r} is not host:port; set it to process 0's address "
            "with a port, e.g. 10.0.0.1:8476"
        )
    return host, int(port)


class BootContract(BaseModel):
    """The environment contract, validated; `from_env` turns every problem into one sentence."""

    model_config = ConfigDict(frozen=True)

    run_id: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    output_uri: str | None = None
    attempt: int = 0
    submission_id: str | None = None

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        return None if v is None else check_dns_label(v, "JAXJOB_RUN_ID=")

    @field_validator("coordinator")
    @classmethod
    def _coordinator(cls, v: str | None) -> str | None:
        if v is not None:
            _split_host_port(v)
        return v

    @field_validator("attempt")
    @classmethod
    def _attempt(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"JAXJOB_ATTEMPT={v} is negative; use 0 for the first attempt")
        return v

    @model_validator(mode="after")
    def _partners(self) -> BootContract:
        n, i, coord = self.num_processes, self.process_id, self.coordinator
        given = [v for v, x in zip(_DISTRIBUTED_VARS, (coord, n, i), strict=True) if x is not None]
        if given:
            # One process needs no coordinator; more need all three variables.
            needed = _DISTRIBUTED_VARS[1:] if n == 1 else _DISTRIBUTED_VARS
            missing = [v for v in needed if v not in given]
            if missing:
                raise ValueError(
                    f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but "
                    f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; "
                    "set all of JAXJOB_COORDINATOR, JAXJOB_NUM_PROCESSES and JAXJOB_PROCESS_ID, "
                    "or none"
                )
        if n is not None and n < 1:
            raise ValueError(f"JAXJOB_NUM_PROCESSES={n} must be at least 1")
        if n is not None and i is not None and not 0 <= i < n:
            raise ValueError(
                f"JAXJOB_PROCESS_ID={i} is outside 0..{n - 1} (JAXJOB_NUM_PROCESSES={n}); "
                "process ids must be 0, 1, ... up to the number of processes minus one"
            )
        return self

    @property
    def distributed(self) -> bool:
        """True when the contract asks for a multi-process cluster."""
        return self.num_processes is not None and self.num_processes > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BootContract:
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None  # an empty variable counts as unset

        def get_int(name: str, example: str) -> int | None:
            raw = get(name)
            if raw is None:
                return None
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(
                    f"{name}={raw!r} is not an integer; set it to a whole number, e.g. {example}"
                ) from None

        values: dict[str, Any] = {
            "run_id": get("JAXJOB_RUN_ID"),
            "coordinator": get("JAXJOB_COORDINATOR"),
            "num_processes": get_int("JAXJOB_NUM_PROCESSES", "2"),
            "process_id": get_int("JAXJOB_PROCESS_ID", "0"),
            "output_uri": get("JAXJOB_OUTPUT_URI"),
            "submission_id": get("JAXJOB_SUBMISSION_ID"),
        }
        attempt = get_int("JAXJOB_ATTEMPT", "0")
        if attempt is not None:
            values["attempt"] = attempt
        try:
            return cls(**values)
        except ValidationError as e:
            err = e.errors()[0]
            ctx_error = (err.get("ctx") or {}).get("error")
            raise ConfigError(str(ctx_error) if ctx_error else err["msg"]) from None


# ---- what boot found --------------------------------------------------------------------------


@dataclass
class BootInfo:
    """Who this host is, for the host loop and diagnostics/runtime.json."""

    mode: str  # "contract" | "auto:<cluster>" | "single-process"
    run_id: str | None
    attempt: int
    process_index: int
    process_count: int
    coordinator: str | None
    platform: str
    local_devices: list[str]
    local_device_count: int
    global_device_count: int
    output_uri: str | None = None
    # Names one submission; a restarted attempt with it succeeds the run's owner (run/owner.py).
    submission_id: str | None = None
    cpu_collectives: str | None = None
    writer_index: int | None = None
    writer_election: str | None = None
    boot_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _State:
    info: BootInfo | None = None
    initialized: bool = False  # we called jax.distributed.initialize


_state = _State()


def current() -> BootInfo | None:
    """The BootInfo of this process once `boot()` ran, else None."""
    return _state.info


def kv_client() -> Any:
    """The jax.distributed coordination-service client (its key-value store), or None when no
    service runs (single process)."""
    from jax._src import distributed

    return distributed.global_state.client


def run_and_attempt(run_id: str | None = None, attempt: int | None = None) -> tuple[str, int]:
    """The run id and attempt that coordination keys are named by: the given ones, else boot's,
    else JAXJOB_RUN_ID / "run" and attempt 0."""
    info = current()
    run = run_id or (info.run_id if info else None) or os.environ.get("JAXJOB_RUN_ID") or "run"
    return run, attempt if attempt is not None else (info.attempt if info else 0)


# ---- platform and cluster detection -------------------------------------------------------------


def _accelerator_plugin_installed() -> bool:
    import importlib.util
    import pkgutil
    from importlib.metadata import entry_points

    if importlib.util.find_spec("libtpu") is not None:
        return True
    if entry_points(group="jax_plugins"):
        return True
    try:
        import jax_plugins  # type: ignore[import-not-found]  # namespace of CUDA/ROCm plugins
    except ImportError:
        return False
    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def will_run_on_cpu() -> bool:
    """Whether JAX will pick the CPU backend, decided without initialising any backend."""
    import jax

    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not _accelerator_plugin_installed()


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """The name of JAX's cluster detector that applies to a multi-process job here, or None.

    Only the two we support: SLURM with more than one task, and GKE TPU with more than one host.
    (JAX also probes OpenMPI, GCE TPU metadata and Kubernetes; its Kubernetes detector numbers
    a pod by its index within its own Job, which repeats across the Jobs of a multi-slice JobSet,
    so those are left to the contract.)
    """
    from jax._src.clusters import GkeTpuCluster, SlurmCluster

    env = os.environ if env is None else env

    def as_int(name: str, default: int) -> int:
        try:
            return int(env.get(name) or default)
        except ValueError:
            return default

    # Slurm's detector reads os.environ itself; only trust it when `env` is os.environ.
    if env is os.environ and SlurmCluster.is_env_present() and as_int("SLURM_NTASKS", 1) > 1:
        return SlurmCluster.name
    if env is os.environ and GkeTpuCluster.is_env_present():
        hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
        if len(hosts.split(",")) * as_int("MEGASCALE_NUM_SLICES", 1) > 1:
            return GkeTpuCluster.name
    return None


# ---- boot -------------------------------------------------------------------------------------


def _probe_coordinator(address: str, timeout_s: float) -> None:
    """Retry a TCP connect to process 0 until it answers or `timeout_s` passes."""
    host, port = _split_host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError:
            if time.monotonic() + 0.25 >= deadline:
                break
            time.sleep(0.25)
    raise JaxjobError(
        f"could not reach the coordinator at {host}:{port} within {timeout_s:g} s "
        "(JAXJOB_COORDINATOR); check that process 0 is running and the address is reachable"
    )


class _FormationGuard:
    """Ends the process with one sentence if `initialize` is still blocked at the deadline."""

    def __init__(self, deadline_s: float, message: str) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(deadline_s, message), name="jaxjob-boot-guard", daemon=True
        )

    def _run(self, deadline_s: float, message: str) -> None:
        if not self._done.wait(deadline_s):
            hostlog.fatal(message, EXIT_CLUSTER_TIMEOUT)

    def __enter__(self) -> _FormationGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()


def _initialize(kwargs: dict[str, Any], *, timeout_s: int, guard_message: str) -> None:
    import jax
    from jax.errors import JaxRuntimeError

    with _FormationGuard(timeout_s, guard_message):
        try:
            jax.distributed.initialize(
                initialization_timeout=timeout_s + _JAX_TIMEOUT_MARGIN_S, **kwargs
            )
        except JaxRuntimeError as e:
            where = kwargs.get("coordinator_address") or "the coordinator address"
            raise JaxjobError(
                f"jax.distributed could not start on {where}: {str(e).splitlines()[0]}; "
                "check that the coordinator port is free on process 0 and reachable from the others"
            ) from None
    _state.initialized = True


def _join_by_contract(
    contract: BootContract, *, timeout_s: int, heartbeat_timeout_s: int, started: float
) -> None:
    """Initialize with the contract's coordinator, process count and id."""
    assert contract.coordinator and contract.num_processes and contract.process_id is not None
    n, i, coord = contract.num_processes, contract.process_id, contract.coordinator
    if i != 0:
        _probe_coordinator(coord, timeout_s)
    elapsed = time.monotonic() - started
    _initialize(
        {
            "coordinator_address": coord,
            "num_processes": n,
            "process_id": i,
            "heartbeat_timeout_seconds": _jax_heartbeat_timeout_s(heartbeat_timeout_s),
            # Else JAX's SLURM/OMPI detection still fills local_device_ids (one GPU per
            # process, [SLURM_LOCALID]) although we gave everything else.
            "cluster_detection_method": "deactivate",
        },
        timeout_s=max(1, round(timeout_s - elapsed)),
        guard_message=(
            f"the cluster of {n} processes did not form within {timeout_s} s: process {i} "
            f"{'started' if i == 0 else 'reached'} the coordinator at {coord} but not all "
            f"{n} processes joined; check that every process started with "
            f"JAXJOB_NUM_PROCESSES={n} and can reach {coord}"
        ),
    )


def _join_detected(cluster: str, *, timeout_s: int, heartbeat_timeout_s: int) -> None:
    """Initialize with the parameters JAX's detector for `cluster` derives."""
    _initialize(
        {
            "cluster_detection_method": cluster,
            "heartbeat_timeout_seconds": _jax_heartbeat_timeout_s(heartbeat_timeout_s),
        },
        timeout_s=timeout_s,
        guard_message=(
            f"the {cluster} cluster did not form within {timeout_s} s; check that every "
            "task of the job started and can reach the first host"
        ),
    )


def _boot_info(
    contract: BootContract, mode: str, collectives: str | None, started: float
) -> BootInfo:
    """What JAX says about this process once it has joined (or not joined) a cluster."""
    import jax
    from jax._src import distributed

    local = jax.local_devices()
    return BootInfo(
        mode=mode,
        run_id=contract.run_id,
        attempt=contract.attempt,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        coordinator=distributed.global_state.coordinator_address if _state.initialized else None,
        platform=jax.default_backend(),
        local_devices=[str(d) for d in local],
        local_device_count=len(local),
        global_device_count=jax.device_count(),
        output_uri=contract.output_uri,
        submission_id=contract.submission_id,
        cpu_collectives=collectives,
        boot_seconds=round(time.monotonic() - started, 3),
    )


def boot(
    *, timeout_s: int, heartbeat_timeout_s: int, env: Mapping[str, str] | None = None
) -> BootInfo:
    """Join the cluster this process belongs to (if any) and say who we are.

    Call before anything touches a JAX backend. Calling it again returns the first BootInfo.
    `heartbeat_timeout_s`: how long a host may stop heartbeating before JAX aborts the others
    (SIGABRT); keep it above the HostWatchdog's timeout so the watchdog's sentence and exit 43
    come first. JAX gets twice as much (_jax_heartbeat_timeout_s): it can give up after half of
    its own timeout.
    """
    if _state.info is not None:
        return _state.info
    started = time.monotonic()
    contract = BootContract.from_env(env)

    import jax

    cpu = will_run_on_cpu()
    # An explicit contract, even of one process, wins over JAX's cluster detection.
    cluster = None if contract.num_processes is not None else detect_cluster(env)
    collectives = None
    if (contract.distributed or cluster) and cpu:
        # Cross-process collectives on CPU need an implementation; gloo runs over TCP.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        collectives = "gloo"

    if contract.distributed:
        mode = "contract"
        _join_by_contract(
            contract, timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s, started=started
        )
    elif cluster:
        mode = f"auto:{cluster}"
        _join_detected(cluster, timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
    else:
        mode = "single-process"
    _state.info = _boot_info(contract, mode, collectives, started)
    return _state.info


def shutdown() -> None:
    """Leave the cluster (waits for the other processes, JAX's shutdown barrier) if we joined."""
    if _state.initialized:
        import jax

        jax.distributed.shutdown()
        _state.initialized = False
    _state.info = None
