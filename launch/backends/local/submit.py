"""Start a local run's detached supervisor, and cancel a run by signalling it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from jobspec.errors import ConfigError, JaxjobError
from jobspec.job_spec import SecretRef
from launch.backend import TERMINAL, Handle, Submission
from launch.backends import source_pythonpath
from launch.backends.local.orphans import describe, live_hosts
from launch.backends.local.render import host_plan, secret_names
from launch.backends.local.status import SUPERVISOR_MODULE, is_supervisor
from launch.backends.local.supervisor import CANCEL_FILE, PLAN_FILE, STATE_FILE, SUPERVISOR_LOG
from launch.state import RunFolders, read_json, write_json_atomic


def check_secrets(sub: Submission) -> None:
    """Secret references take their value from this shell's variable of the same name."""
    for name in secret_names(sub):
        if name not in os.environ:
            ref = sub.spec.env[name]
            assert isinstance(ref, SecretRef)
            raise ConfigError(
                f"env.{name} references secret {ref.secret}/{ref.key}; on the local backend its "
                f"value comes from this shell's ${name}, which is not set: export {name}=... and "
                "submit again"
            )


def _refuse_if_running(sub: Submission, run_dir: Path) -> None:
    """A fixed run_id may be resubmitted only once its previous supervisor has ended."""
    previous = read_json(run_dir / STATE_FILE)
    if not previous or previous.get("state") in TERMINAL:
        return
    if is_supervisor(previous.get("pid")):
        raise JaxjobError(
            f"run {sub.run_id} is still running (supervisor pid {previous['pid']}); "
            f"`launch cancel {sub.run_id}` first, or submit under another run_id"
        )
    if alive := live_hosts(previous):  # a dead supervisor's hosts still write to the run
        raise JaxjobError(
            f"run {sub.run_id} still has {describe(alive)} running, left by a supervisor that "
            f"is gone; `launch cancel {sub.run_id}` first, or submit under another run_id"
        )


def _start_detached(run_dir: Path, command: str) -> subprocess.Popen[bytes]:
    """`python -m launch.backends.local <command> RUN_DIR`, its output in supervisor.log."""
    env = dict(os.environ)
    env["PYTHONPATH"] = source_pythonpath(env.get("PYTHONPATH"))
    with open(run_dir / SUPERVISOR_LOG, "ab") as log:
        # A new session: the run outlives this shell and its Ctrl-C.
        return subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, command, str(run_dir)],
            cwd=Path.cwd(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def submit(registry: RunFolders, sub: Submission) -> Handle:
    """Write the run's folder (cfg.toml, job.yaml, plan.json) and start its supervisor."""
    check_secrets(sub)
    run_dir = registry.run_dir(sub.run_id)
    _refuse_if_running(sub, run_dir)
    registry.prepare_run_dir(sub)
    (run_dir / CANCEL_FILE).unlink(missing_ok=True)
    write_json_atomic(run_dir / PLAN_FILE, host_plan(sub, run_dir))
    proc = _start_detached(run_dir, "supervise")
    return Handle(
        "local", {"pid": proc.pid, "run_dir": str(run_dir), "log_dir": str(run_dir / "logs")}
    )


def cancel(handle: Handle) -> None:
    """SIGTERM to the supervisor (it forwards it to every host); without one, a detached
    `stop` does to the hosts it left what it would have done (orphans.stop)."""
    run_dir = Path(handle.data["run_dir"])
    st = read_json(run_dir / STATE_FILE) or {}
    if st.get("state") in TERMINAL:
        return
    (run_dir / CANCEL_FILE).touch()
    pid = st.get("pid") or handle.data.get("pid")
    if is_supervisor(pid):
        os.kill(pid, signal.SIGTERM)  # it forwards SIGTERM to every host and stops restarting
        return
    if live_hosts(st):
        _start_detached(run_dir, "stop")
