"""The local backend (the default): the job's N host processes on this machine, on CPU.

`submit` writes the run's folder in the registry (cfg.toml, job.yaml, plan.json) and starts a
detached supervisor (launch/supervisor.py) that runs and restarts the hosts; `status`, `logs`
and `cancel` read its files and signal it. Nothing here imports jax.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import launch
from jobspec.errors import ConfigError, JaxjobError
from jobspec.job_spec import SecretRef
from launch.backend import TERMINAL, Handle, RenderedFile, Submission, tail_lines
from launch.registry import Registry, read_json, write_json_atomic
from launch.supervisor import (
    ATTEMPT_PLACEHOLDER,
    CANCEL_FILE,
    COORDINATOR_PLACEHOLDER,
    PLAN_FILE,
    STATE_FILE,
    SUPERVISOR_LOG,
    supervise,
)

# Seconds between SIGTERM and SIGKILL: a cancel leaves time for the final checkpoint; after a
# host failure the others usually cannot checkpoint (a peer is gone), so they get less.
CANCEL_GRACE_S = 120.0
FAILURE_GRACE_S = 15.0
# The checkout `launch` runs from: the supervisor and hosts import the same code.
SOURCE_ROOT = str(Path(launch.__file__).resolve().parent.parent)
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _xla_flags(spec_value: str | None, devices: int) -> str:
    base = spec_value if spec_value is not None else os.environ.get("XLA_FLAGS", "")
    flags = [f for f in base.split() if not f.startswith(_DEVICE_FLAG)]
    return " ".join([*flags, f"{_DEVICE_FLAG}={devices}"])


def _secret_names(sub: Submission) -> list[str]:
    return [k for k, v in sub.spec.env.items() if isinstance(v, SecretRef)]


def check_secrets(sub: Submission) -> None:
    """Secret references take their value from this shell's variable of the same name."""
    for name in _secret_names(sub):
        if name not in os.environ:
            ref = sub.spec.env[name]
            assert isinstance(ref, SecretRef)
            raise ConfigError(
                f"env.{name} references secret {ref.secret}/{ref.key}; on the local backend its "
                f"value comes from this shell's ${name}, which is not set: export {name}=... and "
                "submit again"
            )


def host_plan(sub: Submission, run_dir: Path) -> dict[str, Any]:
    """Each host's exact command and the environment jaxjob sets for it (the rest of the
    environment is inherited from the submitting shell)."""
    spec = sub.spec
    procs, devices = spec.host_processes("local"), spec.local.devices_per_process
    literals = {k: v for k, v in spec.env.items() if isinstance(v, str)}
    pythonpath = os.pathsep.join(p for p in (SOURCE_ROOT, os.environ.get("PYTHONPATH")) if p)
    common = {
        **literals,
        "JAXJOB_RUN_ID": sub.run_id,
        "JAXJOB_COORDINATOR": COORDINATOR_PLACEHOLDER,
        "JAXJOB_NUM_PROCESSES": str(procs),
        "JAXJOB_OUTPUT_URI": sub.output_uri,
        "JAXJOB_ATTEMPT": ATTEMPT_PLACEHOLDER,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": _xla_flags(literals.get("XLA_FLAGS"), devices),
        "PYTHONUNBUFFERED": "1",  # lines reach the log files as they are printed
        "PYTHONPATH": pythonpath,
    }
    command = [sys.executable, "-m", "runtime", "worker", str(run_dir / "cfg.toml")]
    return {
        "run_id": sub.run_id,
        "cwd": str(Path.cwd()),  # relative paths in the run config resolve here
        "processes": procs,
        "devices_per_process": devices,
        "max_restarts": spec.max_restarts,
        "grace_s": {"cancel": CANCEL_GRACE_S, "failure": FAILURE_GRACE_S},
        "inherit": "the submitting shell's environment, less JAXJOB_* and *_proxy variables",
        "logs": str(run_dir / "logs" / "attempt-<n>" / "host-<i>.log"),
        "hosts": [
            {
                "index": i,
                "command": command,
                "env": {**common, "JAXJOB_PROCESS_ID": str(i)},
                "env_from_shell": _secret_names(sub),
            }
            for i in range(procs)
        ],
    }


def _is_supervisor(pid: int | None) -> bool:
    """Whether `pid` is a live supervisor (not a zombie, not a recycled pid)."""
    if not pid or not _pid_alive(pid):
        return False
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return True  # no procfs (macOS): the signal check is all there is
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and b"launch.local" in cmdline


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    return True


def _attempt_dirs(log_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for d in log_dir.glob("attempt-*"):
        suffix = d.name.removeprefix("attempt-")
        if suffix.isdigit():
            found.append((int(suffix), d))
    return sorted(found)


def _host_files(attempt_dir: Path, host: int | None) -> list[tuple[int, Path]]:
    found = []
    for f in attempt_dir.glob("host-*.log"):
        suffix = f.stem.removeprefix("host-")
        if suffix.isdigit() and (host is None or int(suffix) == host):
            found.append((int(suffix), f))
    return sorted(found)


class LocalBackend:
    name = "local"
    writes_run_files = True  # submit writes cfg.toml and job.yaml into the registry's run folder

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()

    # ---- render / submit -------------------------------------------------------------------

    def render(self, sub: Submission) -> list[RenderedFile]:
        plan = host_plan(sub, self.registry.run_dir(sub.run_id))
        return [
            RenderedFile("hosts.json", json.dumps(plan, indent=2) + "\n"),
            RenderedFile("cfg.toml", sub.run_toml),
            RenderedFile("job.yaml", sub.spec_yaml),
        ]

    def submit(self, sub: Submission) -> Handle:
        check_secrets(sub)
        run_dir = self.registry.run_dir(sub.run_id)
        previous = read_json(run_dir / STATE_FILE)
        if (
            previous
            and previous.get("state") not in TERMINAL
            and _is_supervisor(previous.get("pid"))
        ):
            raise JaxjobError(
                f"run {sub.run_id} is still running (supervisor pid {previous['pid']}); "
                f"`launch cancel {sub.run_id}` first, or submit under another run_id"
            )
        self.registry.prepare_run_dir(sub)
        (run_dir / CANCEL_FILE).unlink(missing_ok=True)
        write_json_atomic(run_dir / PLAN_FILE, host_plan(sub, run_dir))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCE_ROOT, env.get("PYTHONPATH")) if p)
        with open(run_dir / SUPERVISOR_LOG, "ab") as log:
            # A new session: the run outlives this shell and its Ctrl-C.
            proc = subprocess.Popen(
                [sys.executable, "-m", "launch.local", "supervise", str(run_dir)],
                cwd=Path.cwd(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return Handle(
            self.name,
            {"pid": proc.pid, "run_dir": str(run_dir), "log_dir": str(run_dir / "logs")},
        )

    # ---- status / cancel -------------------------------------------------------------------

    def _run_dir(self, handle: Handle) -> Path:
        return Path(handle.data["run_dir"])

    def status(self, handle: Handle) -> dict[str, Any]:
        run_dir = self._run_dir(handle)
        pid = handle.data.get("pid")
        st = read_json(run_dir / STATE_FILE)
        alive = _is_supervisor(pid)
        cancel_asked = (run_dir / CANCEL_FILE).exists()
        if st is None:
            if alive:
                return {"state": "pending", "detail": "the supervisor is starting", "pid": pid}
            state = "cancelled" if cancel_asked else "failed"
            return {
                "state": state,
                "detail": f"the supervisor (pid {pid}) exited before starting the hosts; "
                f"see {run_dir / SUPERVISOR_LOG}",
                "pid": pid,
            }
        out = {
            "state": st["state"],
            "detail": st["detail"],
            "pid": st["pid"],
            "attempt": st["attempt"],
            "restarts": st["restarts"],
            "max_restarts": st["max_restarts"],
            "hosts": st["hosts"],
            "log_dir": str(run_dir / "logs"),
            "supervisor_log": str(run_dir / SUPERVISOR_LOG),
        }
        if st["state"] in ("starting", "restarting"):
            out["state"] = "pending"
        elif st["state"] == "stopping":
            out["state"] = "running"
        if out["state"] not in TERMINAL and not _is_supervisor(st["pid"]):
            out["state"] = "cancelled" if cancel_asked else "failed"
            out["detail"] = (
                f"the supervisor (pid {st['pid']}) is gone while the run was {st['state']}; "
                f"see {run_dir / SUPERVISOR_LOG}"
            )
        return out

    def cancel(self, handle: Handle) -> None:
        run_dir = self._run_dir(handle)
        st = read_json(run_dir / STATE_FILE) or {}
        if st.get("state") in TERMINAL:
            return
        (run_dir / CANCEL_FILE).touch()
        pid = st.get("pid") or handle.data.get("pid")
        if _is_supervisor(pid):
            os.kill(pid, signal.SIGTERM)  # it forwards SIGTERM to every host and stops restarting
            return
        # The supervisor is gone but hosts may not be: stop them the same graceful way.
        for h in st.get("hosts", []):
            if h.get("returncode") is None and _pid_alive(h["pid"]):
                os.kill(h["pid"], signal.SIGTERM)

    # ---- logs ------------------------------------------------------------------------------

    def logs(
        self, handle: Handle, *, host: int | None, follow: bool, tail: int | None
    ) -> Iterator[str]:
        log_dir = self._run_dir(handle) / "logs"
        if not follow:
            yield from self._read_all(log_dir, host, tail)
            return
        yield from self._follow(handle, log_dir, host, tail)

    def _read_all(self, log_dir: Path, host: int | None, tail: int | None) -> Iterator[str]:
        lines: list[tuple[int, str]] = []  # (host, line) in attempt order
        for _, d in _attempt_dirs(log_dir):
            for i, f in _host_files(d, host):
                lines += [(i, ln) for ln in f.read_text(errors="replace").splitlines()]
        if tail is not None:
            # Like `kubectl logs --tail`: the last K lines of each host, in the order written.
            per_host: dict[int, list[int]] = {}
            for k, (i, _) in enumerate(lines):
                per_host.setdefault(i, []).append(k)
            keep = {k for ks in per_host.values() for k in tail_lines(ks, tail)}
            lines = [x for k, x in enumerate(lines) if k in keep]
        for i, ln in lines:
            yield f"[host {i}] {ln}"

    def _follow(
        self, handle: Handle, log_dir: Path, host: int | None, tail: int | None
    ) -> Iterator[str]:
        """Stream new lines of every attempt's host logs until the run has ended."""
        offsets: dict[Path, int] = {}
        partial: dict[Path, bytes] = {}
        if tail is not None:  # start from the last K lines, then follow
            yield from self._read_all(log_dir, host, tail)
            for _, d in _attempt_dirs(log_dir):
                for _, f in _host_files(d, host):
                    offsets[f] = f.stat().st_size
        while True:
            ended = self.status(handle)["state"] in TERMINAL  # before reading: no line is lost
            got = False
            for _, d in _attempt_dirs(log_dir):
                for i, f in _host_files(d, host):
                    with open(f, "rb") as fh:
                        fh.seek(offsets.get(f, 0))
                        data = fh.read()
                    if not data:
                        continue
                    got = True
                    offsets[f] = offsets.get(f, 0) + len(data)
                    *complete, rest = (partial.pop(f, b"") + data).split(b"\n")
                    if rest:
                        partial[f] = rest
                    for ln in complete:
                        yield f"[host {i}] {ln.decode(errors='replace')}"
            if ended and not got:
                for f, rest in partial.items():
                    yield f"[host {f.stem.removeprefix('host-')}] {rest.decode(errors='replace')}"
                return
            if not got:
                time.sleep(0.2)


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "supervise":
        print("usage: python -m launch.local supervise RUN_DIR", file=sys.stderr)
        return 2
    return supervise(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
