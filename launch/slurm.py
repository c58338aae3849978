"""The SLURM backend: one sbatch script per run, status without accounting, logs per host.

A run directory (`rundir`, on a filesystem every node and the submitting host share) holds
`job.sbatch`, `cfg.toml`, `job.yaml`, `logs/host-<N>.log` (one per host, from srun) and
`logs/batch.log` (the batch shell: what it decided and why). The script, in order:

* `#SBATCH` directives: one task per host (`--nodes`, `--ntasks-per-node`), GPUs by `--gres`,
  `--signal=TERM@<grace>` and `--requeue` when restarts are allowed;
* the job spec's setup lines, verbatim (they are shell code by intent);
* the env contract (DESIGN.md, "The seam"); every host runs `runtime worker cfg.toml` under srun;
* the verdict: each host's own exit code decides between success, a requeue and failure.

Why the signal goes to the steps (`TERM@`) and not to the batch shell (`B:TERM@`): the hosts
must checkpoint before the time limit, and only the runtime does that; SIGTERM to the batch shell
would leave the hosts unaware (FACTS.md). The batch shell is never signalled, so it lives on to
requeue the job once the hosts have exited 42.

Why each host records its exit code in `exit/attempt-<A>/host-<N>`: srun returns only the highest
code over all tasks, and `--kill-on-bad-exit` SIGTERMs the others once one fails, so a user error
(exit 2) on one host would read as a signal death (143) on another.

`launch` never imports jax; nothing here reads SLURM accounting (`sacct`), which is often off.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.errors import ConfigError, JaxjobError
from jobspec.job_spec import JobSpec, SecretRef
from launch.backend import RESTARTABLE_EXIT_CODES, Handle, RenderedFile, Submission, tail_lines
from launch.registry import Registry

# The checkout `launch` runs from: a detached escalation (cancel) imports the same code.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)
SCRIPT, CONFIG, SPEC = "job.sbatch", "cfg.toml", "job.yaml"
CANCEL_MARK = "cancel-requested"  # written by cancel(); the batch shell then never requeues
RESULT = "result"  # "<exit code> <attempt>", written by the batch shell when it ends the job
EXITS = "exit"  # exit/attempt-<A>/host-<N>: each host's own exit code
# Coordinator port = base + job id % 4096: the range JAX's own SLURM detection uses, and every
# host computes the same port without talking to the others.
PORT_BASE = 61440
# JAX_PLATFORMS per accelerator kind: a GPU job must fail, not silently train on the CPU.
PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}

PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
           "SUSPENDED", "STOPPED"}  # fmt: skip
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"}
FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SlurmError(JaxjobError):
    """A SLURM command failed or the cluster cannot be reached."""


def default_rundir(run_id: str) -> Path:
    """Where a run's files go when the caller names no directory: its folder in the run registry
    (the submitting user's state dir; it must be on a filesystem the nodes share)."""
    return Registry().run_dir(run_id)


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def script(self) -> Path:
        return self.root / SCRIPT

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def exits(self) -> Path:
        return self.root / EXITS

    @property
    def cancel_mark(self) -> Path:
        return self.root / CANCEL_MARK

    @property
    def result(self) -> Path:
        return self.root / RESULT

    def host_log(self, host: int) -> Path:
        return self.logs / f"host-{host}.log"


# ---- rendering --------------------------------------------------------------------------------


def _value(text: str, field: str) -> str:
    """A value for a `#SBATCH` line. sbatch's own parser (not a shell) reads directives: it
    honours '…' and "…" as shlex.quote writes them, but treats a backslash as an escape even
    inside quotes and ends a directive at a line break, so those are refused."""
    if any(c in text for c in "\\\n\r\0"):
        raise ConfigError(f"{field}: {text!r} contains a backslash or a line break; remove it")
    return shlex.quote(text)


def _word(text: str, field: str) -> str:
    """A shell word: single-quoted by shlex.quote, so nothing in it is expanded or run."""
    if "\0" in text:
        raise ConfigError(f"{field}: {text!r} contains a NUL character; remove it")
    return shlex.quote(text)


def _pattern(path: Path) -> str:
    """A path as an sbatch/srun filename pattern, where % starts a replacement symbol."""
    return str(path).replace("%", "%%")


def _layout(spec: JobSpec, hosts_per_node: int) -> tuple[int, int]:
    """(nodes, tasks per node). One task is one host of the job."""
    acc = spec.catalogue
    if acc.kind not in PLATFORMS:
        raise ConfigError(
            f"accelerator: {acc.name} is a TPU; the slurm backend runs cpu and GPU accelerators "
            "(submit TPU slices with --backend k8s)"
        )
    hosts = spec.host_processes("slurm")
    if hosts_per_node > 1 and acc.kind != "cpu":
        raise ConfigError(
            f"hosts_per_node={hosts_per_node} packs hosts onto shared nodes, which only CPU jobs "
            f"may do; {acc.name} hosts each need a whole node's GPUs"
        )
    if hosts % hosts_per_node:
        raise ConfigError(
            f"hosts: {hosts} hosts do not divide into nodes of {hosts_per_node}; "
            f"use a multiple of {hosts_per_node}"
        )
    return hosts // hosts_per_node, hosts_per_node


def _directives(
    spec: JobSpec, sub: Submission, rd: RunDir, cwd: str, nodes: int, per_node: int
) -> list[str]:
    s = spec.slurm
    acc = spec.catalogue
    out: list[tuple[str, str | int | None, str]] = [
        ("job-name", sub.run_id, "run_id"),
        ("nodes", nodes, "hosts"),
        ("ntasks-per-node", per_node, "hosts"),
    ]
    if acc.kind == "gpu":
        # --gres works with select/cons_res and cons_tres alike; --gpus-per-node needs cons_tres.
        out.append(("gres", f"gpu:{acc.chips_per_host}", "accelerator"))
    if s.cpus_per_task is not None:
        out.append(("cpus-per-task", s.cpus_per_task, "slurm.cpus_per_task"))
    out.append(("time", s.time, "slurm.time"))
    for opt in ("partition", "account", "qos", "constraint"):
        if getattr(s, opt) is not None:
            out.append((opt, getattr(s, opt), f"slurm.{opt}"))
    # To the steps, not the batch shell (module docstring).
    out.append(("signal", f"TERM@{s.signal_grace_s}", "slurm.signal_grace_s"))
    if spec.max_restarts > 0:
        out += [("requeue", None, ""), ("open-mode", "append", "")]
    else:
        out.append(("no-requeue", None, ""))  # also when the cluster requeues by default
    out += [
        ("output", _pattern(rd.logs / "batch.log"), "rundir"),
        ("chdir", cwd, "cwd"),  # where cfg.toml's relative paths resolve, as on the local backend
    ]
    lines = []
    for opt, val, field in out:
        lines.append(
            f"#SBATCH --{opt}" if val is None else f"#SBATCH --{opt}={_value(str(val), field)}"
        )
    return lines


def _env_lines(spec: JobSpec, sub: Submission) -> list[str]:
    lines = [
        f"export JAXJOB_RUN_ID={_word(sub.run_id, 'run_id')}",
        # Already absolute (or remote): prepare_submission resolved it where launch runs.
        f"export JAXJOB_OUTPUT_URI={_word(sub.output_uri, 'output_uri')}",
        'export JAXJOB_ATTEMPT="${SLURM_RESTART_COUNT:-0}"',
        "# Process 0 runs on the first host of the allocation (srun's block distribution); the",
        "# port comes from the job id, so every host computes the same address on its own.",
        'coordinator_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f'export JAXJOB_COORDINATOR="$coordinator_host:$(({PORT_BASE} + SLURM_JOB_ID % 4096))"',
        f"export JAX_PLATFORMS={PLATFORMS[spec.catalogue.kind]}",
        "export PYTHONUNBUFFERED=1  # host logs as they happen, for `launch logs --follow`",
    ]
    for name, value in spec.env.items():
        if isinstance(value, SecretRef):
            # On SLURM a secret comes from the submitting shell (sbatch exports it), never the script.
            lines.append(f': "${{{name}:?{name} must be set in the shell that submits the job}}"')
        else:
            lines.append(f"export {name}={_word(value, f'env.{name}')}")
    return lines


# Each task: its process id and world size from srun, then the runtime. `trap : TERM` keeps this
# shell alive (the runtime gets the same SIGTERM and checkpoints) to record the runtime's code.
HOST_WRAPPER = """\
export JAXJOB_PROCESS_ID="$SLURM_PROCID" JAXJOB_NUM_PROCESSES="$SLURM_NTASKS"
trap : TERM
"${@:2}"
rc=$?
echo "$rc" >"$1/host-$SLURM_PROCID"
exit "$rc"
""".rstrip()

# The verdict over every host's code. A plain code (1-41, 45-127: bad input, a bug) fails the job
# with it; otherwise a restartable one (42 checkpointed on SIGTERM, 43 a peer was lost, 44 the
# cluster did not form) or a death by signal (128+N, e.g. SIGTERMed by --kill-on-bad-exit after
# another host failed) requeues it while restarts remain.
VERDICT = """\
codes=$(cat "$exits"/host-* 2>/dev/null | tr '\\n' ' ')
codes=${codes% }
fatal=0 restart=0
for code in ${codes:-$rc}; do
    case $code in
    0) ;;
    RESTARTABLE) [ "$restart" != 0 ] || restart=$code ;;
    *) if [[ $code =~ ^[0-9]+$ ]] && ((code >= 128)); then
           [ "$restart" != 0 ] || restart=$code
       else
           [ "$fatal" != 0 ] || fatal=$code
       fi ;;
    esac
done
if ((fatal == 0 && restart == 0 && rc != 0)); then fatal=$rc; fi  # srun itself failed
if ((fatal != 0)); then say "a host exited $fatal (hosts: $codes): not restartable"; finish "$fatal"; fi
if ((restart == 0)); then say "every host finished"; finish 0; fi
if [ -e "$rundir/CANCEL_MARK" ]; then say "hosts exited $codes after launch cancel"; finish "$restart"; fi
if ((JAXJOB_ATTEMPT < MAX_RESTARTS)); then
    say "hosts exited $codes: requeueing (restart $((JAXJOB_ATTEMPT + 1)) of MAX_RESTARTS)"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    say "scontrol requeue failed"
else
    say "hosts exited $codes: no restarts left (max_restarts MAX_RESTARTS)"
fi
finish "$restart"
""".rstrip()


def render_script(
    sub: Submission,
    rundir: Path,
    *,
    cwd: Path | str | None = None,
    hosts_per_node: int = 1,
    runtime_command: Sequence[str] = ("runtime",),
) -> str:
    """The sbatch script for `sub`, whose files live in `rundir`. The hosts start in `cwd`
    (default: this process's working directory, like the local backend's hosts)."""
    spec = sub.spec
    rd = RunDir(Path(os.path.abspath(rundir)))
    workdir = os.path.abspath(cwd if cwd is not None else os.getcwd())
    nodes, per_node = _layout(spec, hosts_per_node)
    srun = [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes * per_node}",
        f"--ntasks-per-node={per_node}",
    ]
    if spec.slurm.cpus_per_task is not None:
        srun.append(f"--cpus-per-task={spec.slurm.cpus_per_task}")  # 22.05+ srun doesn't inherit it
    srun += [
        "--kill-on-bad-exit=1",  # a failed host ends the step instead of leaving peers to time out
        f"--output={_value(_pattern(rd.logs) + '/host-%t.log', 'rundir')}",  # %t = process id
    ]
    if spec.max_restarts > 0:
        srun.append("--open-mode=append")  # one log per host across attempts
    if spec.slurm.container is not None:
        c = spec.slurm.container
        # The run directory (cfg.toml, exit codes) and the workdir must exist inside the container.
        mounts = list(dict.fromkeys([*c.mounts, f"{rd.root}:{rd.root}", f"{workdir}:{workdir}"]))
        srun += [
            f"--container-image={_word(c.image, 'slurm.container.image')}",
            f"--container-mounts={_word(','.join(mounts), 'slurm.container.mounts')}",
            f"--container-workdir={_word(workdir, 'workdir')}",
        ]
    command = [*runtime_command, "worker", str(rd.config)]
    words = " ".join(_word(w, "runtime_command") for w in command)
    srun.append(f'bash -c "$host_wrapper" jaxjob-host "$exits" {words}')

    verdict = VERDICT.replace("RESTARTABLE", "|".join(map(str, RESTARTABLE_EXIT_CODES)))
    verdict = verdict.replace("MAX_RESTARTS", str(spec.max_restarts))
    verdict = verdict.replace("CANCEL_MARK", CANCEL_MARK)
    lines = [
        "#!/bin/bash",
        f"# jaxjob run {sub.run_id}, rendered by the slurm backend; submit with: sbatch {SCRIPT}",
        "# Files of this run (cfg.toml, job.yaml, logs/host-N.log, logs/batch.log) are in",
        f"# {rd.root}",
        *_directives(spec, sub, rd, workdir, nodes, per_node),
        f"rundir={_word(str(rd.root), 'rundir')}",
        'say() { echo "jaxjob: attempt $JAXJOB_ATTEMPT: $*"; }',
        f'finish() {{ echo "$1 $JAXJOB_ATTEMPT" >"$rundir/{RESULT}"; exit "$1"; }}',
        "",
        "# ---- setup (slurm.setup in the job spec)",
        *(spec.slurm.setup or ["# (none)"]),
        "",
        "# -u only after the setup lines (activate scripts often trip it); no -e: the hosts' exit",
        "# codes are handled below",
        "set -uo pipefail",
        "",
        "# ---- the env contract; process id and world size are set per task, below",
        *_env_lines(spec, sub),
        "",
        f'exits="$rundir/{EXITS}/attempt-$JAXJOB_ATTEMPT"',
        'mkdir -p "$exits" && rm -f "$exits"/host-*',
        f'if [ -e "$rundir/{CANCEL_MARK}" ]; then say "launch cancel came before the hosts started"; finish 1; fi',
        'say "on $SLURM_JOB_NODELIST, coordinator $JAXJOB_COORDINATOR"',
        f"host_wrapper={shlex.quote(HOST_WRAPPER)}",
        " \\\n    ".join(srun),
        "rc=$?",
        "",
        "# ---- the verdict",
        verdict,
        "",
    ]
    return "\n".join(lines)


# ---- talking to SLURM ------------------------------------------------------------------------


def _run(cmd: list[str], *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(
            f"{cmd[0]} is not installed here; run launch on a host of the SLURM cluster "
            "(or start the dev cluster: scripts/slurm-dev-cluster.sh start)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{' '.join(cmd)} did not answer in {timeout:.0f} s; is slurmctld up?"
        ) from None
    if check and proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(cmd)} failed: {why[-1] if why else f'exit {proc.returncode}'}")
    return proc


@dataclass(frozen=True)
class JobRecord:
    """What `scontrol show job` says; accounting (sacct) is not needed."""

    state: str  # e.g. RUNNING, COMPLETED, FAILED (without flags such as +)
    reason: str
    exit_code: int
    signal: int
    restarts: int
    nodes: str


def _parse_scontrol(text: str) -> JobRecord:
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(?:^|\s)([A-Za-z:/_]+)=(\S*)", text):
        fields.setdefault(key, value)
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobRecord(
        state=fields.get("JobState", "UNKNOWN").split("+")[0],
        reason=fields.get("Reason", ""),
        exit_code=int(code or 0),
        signal=int(sig or 0),
        restarts=int(fields.get("Restarts", "0") or 0),
        nodes=fields.get("NodeList", ""),
    )


# ---- the backend -----------------------------------------------------------------------------


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

    def _cmd(self, name: str, *args: str, cluster: str | None = None) -> list[str]:
        return [name, *([f"--clusters={cluster}"] if cluster else []), *args]

    # -- render / submit

    def render(
        self, sub: Submission, *, rundir: Path | None = None, cwd: Path | None = None
    ) -> list[RenderedFile]:
        """job.sbatch, cfg.toml and job.yaml, as submit writes them into `rundir` (default: the
        run's registry folder); the hosts start in `cwd` (default: this working directory)."""
        rd = Path(os.path.abspath(rundir or default_rundir(sub.run_id)))
        script = render_script(
            sub,
            rd,
            cwd=cwd,
            hosts_per_node=self.hosts_per_node or sub.spec.slurm.hosts_per_node,
            runtime_command=self.runtime_command,
        )
        return [RenderedFile(SCRIPT, script), RenderedFile(CONFIG, sub.run_toml),
                RenderedFile(SPEC, sub.spec_yaml)]  # fmt: skip

    def submit(
        self, sub: Submission, *, rundir: Path | None = None, cwd: Path | None = None
    ) -> Handle:
        rd = RunDir(Path(os.path.abspath(rundir or default_rundir(sub.run_id))))
        cwd = Path(os.path.abspath(cwd if cwd is not None else os.getcwd()))
        files = self.render(sub, rundir=rd.root, cwd=cwd)
        missing = [
            n for n, v in sub.spec.env.items() if isinstance(v, SecretRef) and n not in os.environ
        ]
        if missing:
            raise ConfigError(
                f"env: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} secret "
                "references; on SLURM they come from this shell's environment, so export them first"
            )
        rd.logs.mkdir(parents=True, exist_ok=True)  # slurmd does not create the output directory
        # A resubmission into the same directory starts clean: no old cancel, result or codes.
        rd.cancel_mark.unlink(missing_ok=True)
        rd.result.unlink(missing_ok=True)
        shutil.rmtree(rd.exits, ignore_errors=True)
        for f in files:
            (rd.root / f.name).write_text(f.content)
        out = _run(self._cmd("sbatch", "--parsable", str(rd.script))).stdout.strip()
        job_id, _, cluster = out.splitlines()[-1].partition(";")  # "id" or "id;cluster"
        data: dict[str, Any] = {
            "job_id": job_id,
            "workdir": str(rd.root),
            "output_uri": sub.output_uri,
            "run_id": sub.run_id,
            "hosts": sub.spec.host_processes("slurm"),
            "grace_s": sub.spec.slurm.signal_grace_s,
        }
        if cluster:
            data["cluster"] = cluster
        return Handle(self.name, data)

    # -- status

    def _record(self, handle: Handle) -> JobRecord | None:
        """The job as slurmctld knows it, or None once it forgot (MinJobAge after the end)."""
        cmd = self._cmd("scontrol", "show", "job", "-o", str(handle.data["job_id"]),
                        cluster=handle.data.get("cluster"))  # fmt: skip
        proc = _run(cmd, check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            raise SlurmError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
        return _parse_scontrol(proc.stdout)

    def status(self, handle: Handle) -> dict[str, Any]:
        rd = RunDir(Path(handle.data["workdir"]))
        job = self._record(handle)
        cancelled = rd.cancel_mark.exists()
        base = {"job_id": handle.data["job_id"], "workdir": str(rd.root), "logs": str(rd.logs)}
        if job is None:
            return {**base, **_from_result(rd, cancelled, handle.data["job_id"])}
        info = {**base, "slurm_state": job.state, "reason": job.reason, "attempt": job.restarts,
                "exit_code": job.exit_code}  # fmt: skip
        last = _last_batch_line(rd)
        if job.state in PENDING:
            why = f"requeued, attempt {job.restarts}" if job.restarts else "waiting"
            return {
                **info,
                "state": "pending",
                "detail": f"{job.state.lower()} ({why}; reason {job.reason})",
            }
        if job.state in RUNNING:
            detail = f"{job.state.lower()} on {job.nodes}, attempt {job.restarts}"
            if cancelled:
                detail += "; cancel requested, hosts are checkpointing"
            return {**info, "state": "running", "detail": detail}
        if job.state == "COMPLETED":
            return {**info, "state": "succeeded", "detail": last or "every host finished"}
        code = f"exit code {job.exit_code}" + (f", signal {job.signal}" if job.signal else "")
        if job.state == "CANCELLED" or cancelled:
            return {
                **info,
                "state": "cancelled",
                "detail": f"cancelled ({code}); {last}".rstrip("; "),
            }
        if job.state in FAILED:
            return {
                **info,
                "state": "failed",
                "detail": f"{job.state.lower()} ({code}); {last}".rstrip("; "),
            }
        return {**info, "state": "unknown", "detail": f"SLURM state {job.state}"}

    # -- logs

    def logs(
        self,
        handle: Handle,
        *,
        host: int | None = None,
        follow: bool = False,
        tail: int | None = None,
    ) -> Iterator[str]:
        """Each host's log lines, prefixed `[host N] ` (no trailing newline). Without follow, host
        by host; with follow, as they are written, until the job has ended."""
        rd = RunDir(Path(handle.data["workdir"]))
        if host is not None:
            hosts = [host]
        elif "hosts" in handle.data:
            hosts = list(range(int(handle.data["hosts"])))
        else:
            found = (p.stem.removeprefix("host-") for p in rd.logs.glob("host-*.log"))
            hosts = sorted(int(n) for n in found if n.isdigit())
        readers = {h: _LineReader(rd.host_log(h)) for h in hosts}
        for h, r in readers.items():
            lines = r.read_lines(final=not follow)
            for line in tail_lines(lines, tail):
                yield f"[host {h}] {line}"
        while follow:
            done = self.status(handle)["state"] not in ("pending", "running")
            got = False
            for h, r in readers.items():
                for line in r.read_lines(final=done):
                    got = True
                    yield f"[host {h}] {line}"
            if done:
                return
            if not got:
                time.sleep(self.poll_s)

    # -- cancel

    def cancel(self, handle: Handle, *, grace_s: float | None = None, wait: bool = False) -> None:
        """SIGTERM to every host (the runtime checkpoints and exits 42; the batch shell, seeing
        the cancel mark, does not requeue); after `grace_s` (default slurm.signal_grace_s)
        whatever still runs is cancelled outright. Returns once SIGTERM is sent, leaving that
        escalation to a detached process; `wait=True` escalates here and returns once the job
        has ended."""
        rd = RunDir(Path(handle.data["workdir"]))
        job_id, cluster = str(handle.data["job_id"]), handle.data.get("cluster")
        job = self._record(handle)
        if job is None or job.state not in PENDING | RUNNING:
            return  # already over: its outcome stays what it was
        rd.cancel_mark.write_text(f"{time.time():.0f}\n")
        if job.state in PENDING:
            _run(self._cmd("scancel", job_id, cluster=cluster))
            return
        # --signal without --batch/--full signals the job steps only: the hosts, not the shell.
        _run(self._cmd("scancel", "--signal=TERM", job_id, cluster=cluster), check=False)
        grace = float(grace_s if grace_s is not None else handle.data.get("grace_s", 120))
        if wait or grace <= 0:
            self.escalate(handle, grace)
            return
        # Detached (a new session, no terminal): it outlives `launch cancel` and its Ctrl-C.
        subprocess.Popen(
            [sys.executable, "-m", "launch.slurm", "escalate", json.dumps(handle.data), str(grace)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (_SOURCE_ROOT, os.environ.get("PYTHONPATH")) if p)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def escalate(self, handle: Handle, grace_s: float) -> None:
        """Wait up to `grace_s` for the job to end after its SIGTERM, then scancel it outright."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            job = self._record(handle)
            if job is None or job.state not in PENDING | RUNNING:
                return
            time.sleep(self.poll_s)
        cmd = self._cmd("scancel", str(handle.data["job_id"]), cluster=handle.data.get("cluster"))
        _run(cmd, check=False)


def _last_batch_line(rd: RunDir) -> str:
    """The batch shell's last `jaxjob:` line: why the job ended as it did."""
    try:
        lines = (rd.logs / "batch.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next(
        (ln.removeprefix("jaxjob: ") for ln in reversed(lines) if ln.startswith("jaxjob: ")), ""
    )


def _from_result(rd: RunDir, cancelled: bool, job_id: str) -> dict[str, Any]:
    """State after slurmctld forgot the job: the batch shell's own record of how it ended."""
    try:
        code, attempt = (int(x) for x in rd.result.read_text().split()[:2])
    except (OSError, ValueError):
        return {"state": "unknown", "detail": f"SLURM no longer knows job {job_id} and it left no "
                f"result in {rd.root}; see {rd.logs / 'batch.log'}"}  # fmt: skip
    last = _last_batch_line(rd)
    info = {"exit_code": code, "attempt": attempt}
    if code == 0:
        return {**info, "state": "succeeded", "detail": last or "every host finished"}
    state = "cancelled" if cancelled else "failed"
    return {**info, "state": state, "detail": f"exit code {code}; {last}".rstrip("; ")}


class _LineReader:
    """Complete lines appended to a file since the last read (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read_lines(self, *, final: bool = True) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [ln.decode(errors="replace").rstrip("\r") for ln in lines]


def _main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "escalate":
        print("usage: python -m launch.slurm escalate HANDLE_JSON GRACE_S", file=sys.stderr)
        return 2
    SlurmBackend(poll_s=5.0).escalate(Handle("slurm", json.loads(argv[1])), float(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
