"""The local backend's supervisor: runs one job's host processes and restarts the group.

Started detached by `LocalBackend.submit` as `python -m launch.backends.local supervise <run
dir>`. It reads `plan.json` (what render shows as hosts.json), and for each attempt n starts every
host with the env contract (a fresh coordinator port, JAXJOB_ATTEMPT=n), each writing
`logs/attempt-<n>/host-<i>.log`. It keeps `supervisor.json` current (atomic rewrites), which
`launch status` reads.

Restart policy (what JobSet's failurePolicy does on a cluster): the first host to fail decides.
A restartable exit (42-45, `jobspec.exit_codes.is_restartable`) or a death by signal stops the others (SIGTERM, then SIGKILL
after a grace) and starts the whole group again, up to max_restarts times; the runtime resumes
from the last committed checkpoint by itself. Any other non-zero exit (2: user error) fails the
run. SIGTERM/SIGINT to the supervisor is a cancel: it forwards SIGTERM to every host (they
checkpoint, write `interrupted` and exit 42) and does not restart.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobspec.exit_codes import is_restartable
from launch.backend import TERMINAL
from launch.registry import read_json, utc_now, write_json_atomic

PLAN_FILE = "plan.json"
STATE_FILE = "supervisor.json"
CANCEL_FILE = "cancel-requested"  # written before the SIGTERM, so a cancel is never lost
SUPERVISOR_LOG = "supervisor.log"
COORDINATOR_PLACEHOLDER = "127.0.0.1:<free port chosen at each attempt>"
ATTEMPT_PLACEHOLDER = "<attempt>"
SUBMISSION_PLACEHOLDER = "local-<chosen by the supervisor at submit>"
POLL_S = 0.1

# Variables of the submitting shell the hosts must not inherit: an outer job's contract would
# confuse boot, and gRPC to 127.0.0.1 must not go through a proxy.
_DROP_PREFIXES = ("JAXJOB_",)
_DROP_SUFFIXES = ("_proxy",)


def log_path(run_dir: Path, attempt: int, host: int) -> Path:
    return run_dir / "logs" / f"attempt-{attempt}" / f"host-{host}.log"


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class HostState:
    index: int
    pid: int
    log: str
    returncode: int | None = None


@dataclass
class State:
    run_id: str
    pid: int
    max_restarts: int
    state: str = (
        "starting"  # starting | running | stopping | restarting | succeeded | failed | cancelled
    )
    detail: str = ""
    attempt: int = 0
    restarts: int = 0
    cancel_requested: bool = False
    hosts: list[HostState] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    started: str = field(default_factory=utc_now)
    updated: str = ""
    ended: str | None = None


def host_env(host: dict[str, Any], attempt: int, port: int, submission_id: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_DROP_PREFIXES) and not k.lower().endswith(_DROP_SUFFIXES)
    }
    env.update(host["env"])
    for name in host.get("env_from_shell", []):
        env[name] = os.environ[name]  # checked at submit; the supervisor inherited that shell
    env["JAXJOB_COORDINATOR"] = f"127.0.0.1:{port}"
    env["JAXJOB_ATTEMPT"] = str(attempt)
    # One id for every attempt this supervisor starts: attempt n+1 succeeds n as the run's owner.
    env["JAXJOB_SUBMISSION_ID"] = submission_id
    return env


class Supervisor:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        plan = read_json(run_dir / PLAN_FILE)
        if plan is None:
            raise SystemExit(f"{run_dir / PLAN_FILE} is missing")
        self.plan: dict[str, Any] = plan
        previous = read_json(run_dir / STATE_FILE) or {}
        self.state = State(
            run_id=plan["run_id"], pid=os.getpid(), max_restarts=plan["max_restarts"]
        )
        # A resubmitted run (fixed run_id) continues the attempt count, so logs never collide.
        past = previous.get("attempts") or []
        self.first_attempt = past[-1]["attempt"] + 1 if past else 0
        self.state.attempts = list(past)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.submission_id = f"local-{uuid.uuid4().hex[:12]}"

    # ---- state -----------------------------------------------------------------------------

    def save(self) -> None:
        self.state.updated = utc_now()
        write_json_atomic(self.run_dir / STATE_FILE, asdict(self.state))

    def say(self, msg: str) -> None:
        print(f"{utc_now()} {msg}", flush=True)

    def set(self, state: str, detail: str) -> None:
        self.state.state, self.state.detail = state, detail
        if state in TERMINAL:
            self.state.ended = utc_now()
        self.save()
        self.say(f"{state}: {detail}")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.state.cancel_requested = True  # acted on by the loop, not inside the handler

    @property
    def cancelled(self) -> bool:
        return self.state.cancel_requested or (self.run_dir / CANCEL_FILE).exists()

    # ---- hosts -----------------------------------------------------------------------------

    def start_hosts(self, attempt: int) -> None:
        port = free_port()
        self.procs, self.state.hosts = [], []
        n = len(self.plan["hosts"])
        for host in self.plan["hosts"]:
            i = host["index"]
            path = log_path(self.run_dir, attempt, i)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as log:
                # The header marks where each attempt starts when logs of attempts are joined.
                log.write(
                    f"launch.local: run {self.state.run_id} attempt {attempt} "
                    f"(JAXJOB_ATTEMPT={attempt}), host {i} of {n}, coordinator 127.0.0.1:{port}\n".encode()
                )
                log.flush()
                proc = subprocess.Popen(
                    host["command"],
                    cwd=self.plan["cwd"],
                    env=host_env(host, attempt, port, self.submission_id),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.procs.append(proc)
            self.state.hosts.append(HostState(i, proc.pid, str(path)))
        self.say(
            f"attempt {attempt}: started {n} hosts {[p.pid for p in self.procs]} on port {port}"
        )

    def signal_running(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def watch(self) -> tuple[int, int] | None:
        """Wait for every host to exit; the first failure (host, code) if there was one."""
        first_failure: tuple[int, int] | None = None
        kill_at: float | None = None
        forwarded = False
        grace = self.plan["grace_s"]
        while any(p.poll() is None for p in self.procs) or any(
            h.returncode is None for h in self.state.hosts
        ):
            if self.cancelled and not forwarded:
                forwarded = True
                self.state.cancel_requested = True
                self.signal_running(signal.SIGTERM)
                kill_at = time.monotonic() + grace["cancel"]
                self.set("stopping", "cancel requested: SIGTERM sent to every host")
            changed = False
            for h, p in zip(self.state.hosts, self.procs, strict=True):
                rc = p.poll()
                if rc is None or h.returncode is not None:
                    continue
                h.returncode, changed = rc, True
                self.say(f"host {h.index} (pid {h.pid}) {describe_exit(rc)}")
                if rc != 0 and first_failure is None and not forwarded:
                    first_failure = (h.index, rc)
                    self.signal_running(signal.SIGTERM)
                    kill_at = time.monotonic() + grace["failure"]
                    self.set(
                        "stopping",
                        f"host {h.index} {describe_exit(rc)}: stopping the other hosts",
                    )
            if changed:
                self.save()
            if kill_at is not None and time.monotonic() > kill_at:
                self.say("grace period over: SIGKILL to the hosts still running")
                self.signal_running(signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_S)
        return first_failure

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # detached: no terminal to hang up
        self.save()
        attempt = self.first_attempt
        try:
            while True:
                if self.cancelled:
                    self.set("cancelled", "cancelled before the hosts started")
                    return 3
                self.state.attempt = attempt
                started = utc_now()
                self.start_hosts(attempt)
                self.set("running", f"attempt {attempt}: {len(self.procs)} hosts running")
                failure = self.watch()
                codes = [h.returncode for h in self.state.hosts]
                outcome, detail = self.outcome(failure, codes)
                self.state.attempts.append(
                    {"attempt": attempt, "started": started, "ended": utc_now(),
                     "returncodes": codes, "outcome": outcome, "detail": detail}
                )  # fmt: skip
                if outcome != "restart":
                    self.set(outcome, detail)
                    return {"succeeded": 0, "cancelled": 3}.get(outcome, 1)
                self.state.restarts += 1
                attempt += 1
                self.set("restarting", detail)
        except BaseException as e:  # a bug here must not leave hosts running unsupervised
            self.signal_running(signal.SIGKILL)
            self.set("failed", f"the supervisor failed: {type(e).__name__}: {e}")
            raise

    def outcome(self, failure: tuple[int, int] | None, codes: list[int | None]) -> tuple[str, str]:
        n = len(codes)
        if all(c == 0 for c in codes):
            return "succeeded", f"all {n} hosts exited 0"
        if self.state.cancel_requested:
            ends = ", ".join(f"host {i} {describe_exit(c)}" for i, c in enumerate(codes))
            return "cancelled", f"cancelled ({ends})"
        host, rc = failure if failure is not None else (0, codes[0] or 1)
        what = f"host {host} {describe_exit(rc)}"
        if not is_restartable(rc):
            return (
                "failed",
                f"{what} (not restartable); see `launch logs {self.state.run_id} --host {host}`",
            )
        if self.state.restarts >= self.state.max_restarts:
            return "failed", f"{what} and all {self.state.max_restarts} restarts are used up"
        return "restart", (
            f"{what}: restarting the group ({self.state.restarts + 1} of {self.state.max_restarts})"
        )


def supervise(run_dir: Path) -> int:
    return Supervisor(run_dir).run()
