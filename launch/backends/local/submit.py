"""Start a local run's detached supervisor, and cancel a run by signalling it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError
from jobspec.job_spec import SecretRef
from launch.backend import TERMINAL, AlreadyRunningError, Handle, Submission
from launch.backends import source_pythonpath
from launch.backends.local.orphans import live_hosts
from launch.backends.local.render import host_plan, secret_names
from launch.backends.local.status import SUPERVISOR_MODULE, is_supervisor, own_state
from launch.backends.local.supervisor import (
    CANCEL_FILE,
    PLAN_FILE,
    STATE_FILE,
    SUPERVISOR_LOG,
    new_submission_id,
    pending_state,
)
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


def _refuse_if_running(sub: Submission, previous: dict[str, Any] | None) -> None:
    """A fixed run_id may be resubmitted only once its previous supervisor and hosts have ended
    (`launch submit` checks the registry's record first; this is what the folder itself says)."""
    if not previous or previous.get("state") in TERMINAL:
        return
    if is_supervisor(previous.get("pid")) or live_hosts(previous):
        # A dead supervisor's hosts still write to the run, too.
        raise AlreadyRunningError(
            sub.run_id, "running", previous.get("attempt"), previous.get("started")
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
    """Write the run's folder (cfg.toml, job.yaml, plan.json) and this submission's pending
    state, then start its supervisor."""
    check_secrets(sub)
    run_dir = registry.run_dir(sub.run_id)
    previous = read_json(run_dir / STATE_FILE)
    _refuse_if_running(sub, previous)
    registry.prepare_run_dir(sub)
    (run_dir / CANCEL_FILE).unlink(missing_ok=True)
    submission_id = new_submission_id()
    plan = {**host_plan(sub, run_dir), "submission_id": submission_id}
    write_json_atomic(run_dir / PLAN_FILE, plan)
    # Before the supervisor starts, which reads it and then writes its own.
    pending = pending_state(sub.run_id, sub.spec.max_restarts, submission_id, previous)
    write_json_atomic(run_dir / STATE_FILE, pending)
    try:
        proc = _start_detached(run_dir, "supervise")
    except BaseException:  # nothing started: the folder says what it said before
        if previous is None:
            (run_dir / STATE_FILE).unlink(missing_ok=True)
        else:
            write_json_atomic(run_dir / STATE_FILE, previous)
        raise
    return Handle("local", {"pid": proc.pid, "run_dir": str(run_dir),
                            "log_dir": str(run_dir / "logs"), "submission_id": submission_id,
                            "first_attempt": pending["attempt"]})  # fmt: skip


def cancel(handle: Handle) -> None:
    """SIGTERM to the supervisor (it forwards it to every host); without one, a detached
    `stop` does to the hosts it left what it would have done (orphans.stop)."""
    run_dir = Path(handle.data["run_dir"])
    st = own_state(handle) or {}  # never an earlier submission's state
    if st.get("state") in TERMINAL:
        return
    (run_dir / CANCEL_FILE).touch()
    pid = st.get("pid") or handle.data.get("pid")
    if is_supervisor(pid):
        os.kill(pid, signal.SIGTERM)  # it forwards SIGTERM to every host and stops restarting
        return
    if live_hosts(st):
        _start_detached(run_dir, "stop")
