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

A lost host is the one blamed: when the first failure comes while another host's process is
stopped (SIGSTOP), or a host's watchdog named a peer that stopped responding or advancing (its
`error:` line, runtime/host/coordination.py), the attempt ends as that host's loss (exit 43,
restartable) in the supervisor's sentence, its attempt record and a `failure` event in the run's
events.jsonl (the hosts end by os._exit then and record none). Each host gets SIGTERM from the
kernel if the supervisor dies (even by SIGKILL), so hosts never train on unsupervised; what does
not stop is found from supervisor.json by `launch status` and stopped by `launch cancel`
(orphans.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobspec.exit_codes import EXIT_HOST_LOST, is_restartable
from launch.backend import TERMINAL
from launch.backends.local.procs import is_stopped, start_time
from launch.state import read_json, utc_now, write_json_atomic
from runfolder.layout import EVENTS, Event, EventKind

PLAN_FILE = "plan.json"
STATE_FILE = "supervisor.json"
CANCEL_FILE = "cancel-requested"  # written before the SIGTERM, so a cancel is never lost
SUPERVISOR_LOG = "supervisor.log"
COORDINATOR_PLACEHOLDER = "127.0.0.1:<free port chosen at each attempt>"
ATTEMPT_PLACEHOLDER = "<attempt>"
SUBMISSION_PLACEHOLDER = "local-<chosen at each submit>"
POLL_S = 0.1

# Variables of the submitting shell the hosts must not inherit: an outer job's contract would
# confuse boot, and gRPC to 127.0.0.1 must not go through a proxy.
_DROP_PREFIXES = ("JAXJOB_",)
_DROP_SUFFIXES = ("_proxy",)

# A host watchdog's last words (runtime/host/coordination.py): "host 1 of 2 stopped responding
# (no heartbeat for 5 s); exiting", "this host (host 0 of 2) stopped advancing: ...", "hosts
# 0, 1 of 2 stopped advancing together at step 8 (...); exiting".
_WATCHDOG_LINE = re.compile(
    r"^error: (?:this host \()?hosts? (?P<host>\d+)(?:, \d+)* of \d+\)? "
    r"stopped (?P<verb>responding|advancing)(?P<why>.*?)(?:; exiting)?$"
)
_LOG_TAIL_BYTES = 64 * 1024
_PR_SET_PDEATHSIG = 1


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
    start: int | None = None  # the process's start time (procs.start_time): tells a reused pid


@dataclass
class Lost:
    """The host an attempt's failure is blamed on, and why."""

    host: int
    verb: str  # "responding" or "advancing"
    why: str

    @property
    def sentence(self) -> str:
        return f"host {self.host} stopped {self.verb} (exit {EXIT_HOST_LOST}: {self.why})"


@dataclass
class State:
    run_id: str
    pid: int | None  # None: the state submit wrote before it started the supervisor
    max_restarts: int
    # The submission this state is of (submit chooses it; the handle keeps it): a resubmitted
    # run's status must never read an earlier submission's state as its own.
    submission_id: str | None = None
    pgid: int | None = None  # the process group of the supervisor, its hosts and their children
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


def new_submission_id() -> str:
    """JAXJOB_SUBMISSION_ID of a local submission: every attempt of it has the same."""
    return f"local-{uuid.uuid4().hex[:12]}"


def next_attempt(past: list[dict[str, Any]]) -> int:
    """The first attempt of a submission, after the run's earlier attempts `past`."""
    return past[-1]["attempt"] + 1 if past else 0


def pending_state(
    run_id: str, max_restarts: int, submission_id: str, previous: dict[str, Any] | None
) -> dict[str, Any]:
    """The state submit writes for its own submission before it starts the supervisor, so
    `launch status` and `--wait` never read the earlier submission's end as this one's. The
    earlier attempts stay listed: attempt numbers (and log folders) go on from them."""
    past = (previous or {}).get("attempts") or []
    state = State(
        run_id=run_id,
        pid=None,
        max_restarts=max_restarts,
        submission_id=submission_id,
        detail="submitted; the supervisor is starting",
        attempt=next_attempt(past),
        attempts=list(past),
    )
    state.updated = state.started
    return asdict(state)


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


def _end_with_supervisor(supervisor: int) -> Callable[[], None] | None:
    """For Popen's preexec_fn (Linux): the host gets SIGTERM when the supervisor dies, even by
    SIGKILL, and stops as on a cancel (a checkpoint, exit 42) rather than train on unsupervised.
    The supervisor is single-threaded, as preexec_fn needs."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != supervisor:  # it died before the request was in place
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def watchdog_said(log: str) -> Lost | None:
    """The lost host a host's watchdog named in the last lines of its log `log`, if it did."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - _LOG_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        m = _WATCHDOG_LINE.match(line.strip())
        if m:
            why = m["why"].strip().removeprefix(":").strip()
            if why.startswith("(") and why.endswith(")"):
                why = why[1:-1]
            return Lost(int(m["host"]), m["verb"], why)
    return None


class Supervisor:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        plan = read_json(run_dir / PLAN_FILE)
        if plan is None:
            raise SystemExit(f"{run_dir / PLAN_FILE} is missing")
        self.plan: dict[str, Any] = plan
        previous = read_json(run_dir / STATE_FILE) or {}
        # Submit chose the id and wrote it with its pending state; a plan without one (written
        # by hand, by tests) gets a fresh one.
        self.submission_id = plan.get("submission_id") or new_submission_id()
        self.state = State(
            run_id=plan["run_id"],
            pid=os.getpid(),
            max_restarts=plan["max_restarts"],
            submission_id=self.submission_id,
            # Only a group it leads (submit starts it in a session of its own) is the run's.
            pgid=os.getpgrp() if os.getpgrp() == os.getpid() else None,
        )
        # A resubmitted run (fixed run_id) continues the attempt count, so logs never collide.
        past = previous.get("attempts") or []
        self.first_attempt = next_attempt(past)
        self.state.attempt, self.state.attempts = self.first_attempt, list(past)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopped: list[int] = []  # hosts whose process was stopped at the first failure
        self.preexec = _end_with_supervisor(os.getpid())

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
                    preexec_fn=self.preexec,
                )
            self.procs.append(proc)
            self.state.hosts.append(HostState(i, proc.pid, str(path), start=start_time(proc.pid)))
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
        self.stopped = []
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
                    # Before anything is signalled: a stopped peer is what the others lost.
                    self.stopped = [
                        o.index
                        for o, q in zip(self.state.hosts, self.procs, strict=True)
                        if q.poll() is None and is_stopped(o.pid)
                    ]
                    self.signal_running(signal.SIGTERM)
                    for i in self.stopped:  # it would never act on the SIGTERM
                        self.procs[i].send_signal(signal.SIGKILL)
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
                lost = self.lost(failure)
                outcome, detail = self.outcome(failure, codes, lost)
                record: dict[str, Any] = {
                    "attempt": attempt, "started": started, "ended": utc_now(),
                    "returncodes": codes, "outcome": outcome, "detail": detail,
                }  # fmt: skip
                if lost is not None:
                    record["failure"] = {"host": lost.host, "exit_code": EXIT_HOST_LOST,
                                         "reason": lost.why}  # fmt: skip
                    self.record_failure(attempt, lost)
                self.state.attempts.append(record)
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

    def lost(self, failure: tuple[int, int] | None) -> Lost | None:
        """The host the first failure is blamed on: one whose process was stopped then, else
        the peer a host's watchdog named on its way out (exit 43)."""
        if failure is None or self.state.cancel_requested:
            return None
        host, rc = failure
        first = f"host {host} {describe_exit(rc)}"
        # Only a failure a lost peer causes (a watchdog's 43, JAX's abort) is blamed on it.
        if self.stopped and (rc == EXIT_HOST_LOST or rc < 0):
            i = self.stopped[0]
            pid = self.state.hosts[i].pid
            return Lost(i, "responding", f"its process (pid {pid}) is stopped; {first}")
        # The first failure's own words first, then the other hosts'.
        for h in sorted(self.state.hosts, key=lambda h: h.index != host):
            if h.returncode == EXIT_HOST_LOST and (said := watchdog_said(h.log)):
                if said.host == host and rc != EXIT_HOST_LOST:
                    return None  # it died first (killed, say): that is the clearer sentence
                extra = "" if h.index == host else f"; {first}"
                return Lost(said.host, said.verb, f"host {h.index}: {said.why}{extra}")
        return None

    def record_failure(self, attempt: int, lost: Lost) -> None:
        """A `failure` event in the run's events.jsonl naming the lost host: the hosts ended by
        os._exit and recorded none. Through the runtime's artifact store (jsonl parts on gs://),
        after every host has exited, with a short retry: a storage outage only costs the event."""
        output_uri = (self.plan["hosts"][0].get("env") or {}).get("JAXJOB_OUTPUT_URI")
        if not output_uri:
            return
        try:
            from runfolder.storage import RetryPolicy, join
            from runfolder.store import ArtifactStore

            if "://" not in output_uri:  # a relative path is the hosts', from their cwd
                output_uri = os.path.join(self.plan["cwd"], output_uri)
            store = ArtifactStore(
                join(output_uri, self.state.run_id), retry=RetryPolicy(total_s=30, call_s=10)
            )
            event = Event(EventKind.FAILURE, {
                "error": lost.sentence, "type": "HostLost", "exit_code": EXIT_HOST_LOST,
                "host": lost.host, "attempt": attempt, "recorded_by": "the local supervisor",
            })  # fmt: skip
            store.append_jsonl(EVENTS, [event.to_json()])
        except Exception as e:  # noqa: BLE001 - the run goes on; the log says what was missed
            self.say(f"warning: could not record the failure event in {output_uri}: {e}")

    def outcome(
        self, failure: tuple[int, int] | None, codes: list[int | None], lost: Lost | None = None
    ) -> tuple[str, str]:
        n = len(codes)
        if all(c == 0 for c in codes):
            return "succeeded", f"all {n} hosts exited 0"
        if self.state.cancel_requested:
            ends = ", ".join(f"host {i} {describe_exit(c)}" for i, c in enumerate(codes))
            return "cancelled", f"cancelled ({ends})"
        host, rc = failure if failure is not None else (0, codes[0] or 1)
        what = f"host {host} {describe_exit(rc)}"
        if lost is not None:  # a lost host is exit 43 whichever timeout fired first
            host, rc, what = lost.host, EXIT_HOST_LOST, lost.sentence
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
