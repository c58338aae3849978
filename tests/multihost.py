"""Run N host processes on this machine as one jax.distributed CPU cluster.

Each host gets the env contract (docs/jobs-and-backends.md, "Multi-host") with a coordinator on 127.0.0.1 at a
free port, `JAX_PLATFORMS=cpu` and `--xla_force_host_platform_device_count` for its devices.
stdout/stderr go to files (pipes could fill up and block a host nobody is reading).

    results = run_hosts(["worker", "cfg.toml"], num_processes=2, devices_per_process=2)
    with start_hosts([...], 2, 2) as hosts:           # for signal and kill tests
        hosts.wait_for_output(1, "READY", timeout=60)
        hosts.signal(1, signal.SIGTERM)
        results = hosts.wait(timeout=60)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class HostResult:
    process_id: int
    returncode: int | None  # None: still running when the harness gave up (then killed)
    stdout: str
    stderr: str
    elapsed: float  # seconds from start to exit

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines(self, prefix: str) -> list[str]:
        """stdout lines starting with `prefix`, with the prefix removed."""
        return [
            ln[len(prefix) :].strip() for ln in self.stdout.splitlines() if ln.startswith(prefix)
        ]


def host_env(
    process_id: int,
    num_processes: int,
    devices_per_process: int,
    coordinator: str,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one host: ours, minus any contract of the calling shell, plus the
    contract; `env` entries win (a value of "" removes the variable)."""
    # Proxies are dropped: gRPC to 127.0.0.1 must not go through one (JAX warns about them).
    out = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXJOB_") and not k.lower().endswith("_proxy")
    }
    flags = [f for f in out.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    out.update(
        {
            "JAXJOB_RUN_ID": "mh-test",
            "JAXJOB_COORDINATOR": coordinator,
            "JAXJOB_NUM_PROCESSES": str(num_processes),
            "JAXJOB_PROCESS_ID": str(process_id),
            "JAXJOB_ATTEMPT": "0",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags),
            "PYTHONUNBUFFERED": "1",
        }
    )
    for k, v in (env or {}).items():
        if v == "":
            out.pop(k, None)
        else:
            out[k] = v
    return out


class Hosts:
    """Running host processes; a context manager that kills whatever is left on exit."""

    def __init__(
        self,
        command: Sequence[str],
        num_processes: int,
        devices_per_process: int,
        *,
        env: Mapping[str, str] | None = None,
        per_host_env: Sequence[Mapping[str, str]] | None = None,
        cwd: str | os.PathLike[str] = REPO,
        coordinator: str | None = None,
    ) -> None:
        self.coordinator = coordinator or f"127.0.0.1:{free_port()}"
        self._dir = tempfile.TemporaryDirectory(prefix="jaxjob-mh-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self._files: list[tuple[Path, Path]] = []
        self._ended: dict[int, float] = {}
        self.started = time.monotonic()
        for i in range(num_processes):
            e = host_env(i, num_processes, devices_per_process, self.coordinator, env)
            if per_host_env:
                e.update(per_host_env[i])
            # Import jaxjob from the checkout being tested, not wherever `pip install -e` points.
            e["PYTHONPATH"] = os.pathsep.join(x for x in (str(cwd), e.get("PYTHONPATH")) if x)
            out, err = Path(self._dir.name, f"{i}.out"), Path(self._dir.name, f"{i}.err")
            with open(out, "wb") as fo, open(err, "wb") as fe:
                self.procs.append(
                    subprocess.Popen(list(command), cwd=cwd, env=e, stdout=fo, stderr=fe)
                )
            self._files.append((out, err))

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        self._dir.cleanup()

    def stdout(self, i: int) -> str:
        return self._files[i][0].read_text(errors="replace")

    def stderr(self, i: int) -> str:
        return self._files[i][1].read_text(errors="replace")

    def signal(self, i: int, sig: int) -> None:
        self.procs[i].send_signal(sig)

    def kill(self, i: int) -> None:
        self.signal(i, signal.SIGKILL)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def wait_for_output(self, i: int, text: str, timeout: float = 60) -> None:
        """Block until host i has printed `text` on stdout; fail (with its output) otherwise."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout(i):
            if self.procs[i].poll() is not None or time.monotonic() > deadline:
                state = "exited" if self.procs[i].poll() is not None else "timed out"
                raise AssertionError(
                    f"host {i} {state} before printing {text!r}\n{self.describe([i])}"
                )
            time.sleep(0.05)

    def wait(self, timeout: float = 300, only: Sequence[int] | None = None) -> list[HostResult]:
        """Wait for the hosts (all, or `only`) to exit; ones still running at `timeout` are
        killed and reported with returncode None."""
        ids = list(range(len(self.procs))) if only is None else list(only)
        deadline = time.monotonic() + timeout
        pending = set(ids)
        while pending and time.monotonic() < deadline:
            for i in sorted(pending):
                if self.procs[i].poll() is not None:
                    self._ended.setdefault(i, time.monotonic())
                    pending.discard(i)
            time.sleep(0.02)
        for i in pending:
            self.procs[i].kill()
            self.procs[i].wait()
        return [
            HostResult(
                process_id=i,
                returncode=None if i in pending else self.procs[i].returncode,
                stdout=self.stdout(i),
                stderr=self.stderr(i),
                elapsed=self._ended.get(i, time.monotonic()) - self.started,
            )
            for i in ids
        ]

    def describe(self, ids: Sequence[int] | None = None, tail: int = 3000) -> str:
        """Each host's output tail, for assertion messages."""
        parts = []
        for i in ids if ids is not None else range(len(self.procs)):
            parts.append(
                f"--- host {i} (rc={self.procs[i].poll()}) stdout:\n{self.stdout(i)[-tail:]}"
                f"\n--- host {i} stderr:\n{self.stderr(i)[-tail:]}"
            )
        return "\n".join(parts)


def command_for(
    args: Sequence[str], module: str | None = "runtime", script: str | None = None
) -> list[str]:
    if script is not None:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", str(module), *args]


def start_hosts(
    args: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    env: Mapping[str, str] | None = None,
    *,
    module: str | None = "runtime",
    script: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] = REPO,
    per_host_env: Sequence[Mapping[str, str]] | None = None,
    coordinator: str | None = None,
) -> Hosts:
    """Start `python -m <module> <args>` (or `python <script> <args>`) once per host."""
    return Hosts(
        command_for(args, module, None if script is None else str(script)),
        num_processes,
        devices_per_process,
        env=env,
        per_host_env=per_host_env,
        cwd=cwd,
        coordinator=coordinator,
    )


def run_hosts(
    args: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike[str] = REPO,
    *,
    module: str | None = "runtime",
    script: str | os.PathLike[str] | None = None,
    per_host_env: Sequence[Mapping[str, str]] | None = None,
) -> list[HostResult]:
    """Run the hosts to completion; hosts still running at `timeout` are killed (returncode None)."""
    with start_hosts(
        args,
        num_processes,
        devices_per_process,
        env,
        module=module,
        script=script,
        cwd=cwd,
        per_host_env=per_host_env,
    ) as hosts:
        return hosts.wait(timeout)
