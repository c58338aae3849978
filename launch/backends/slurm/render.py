"""Render a run's sbatch script (and its run files) from the job spec, without touching SLURM.

The script is `SCRIPT_TEMPLATE` filled by `string.Template` with `@` as its delimiter
(`@{name}` placeholders), so the bash in it keeps its own `$` unescaped. The script, in order:

* `#SBATCH` directives: one task per host (`--nodes`, `--ntasks-per-node`), GPUs by `--gres`,
  `--signal=TERM@<grace>` and `--requeue` when restarts are allowed;
* the job spec's setup lines, verbatim (they are shell code by intent);
* the env contract (docs/jobs-and-backends.md, "Multi-host"); every host runs `runtime worker cfg.toml` under srun;
* the verdict: each host's own exit code decides between success, a requeue and failure.

Why the signal goes to the steps (`TERM@`) and not to the batch shell (`B:TERM@`): the hosts
must checkpoint before the time limit, and only the runtime does that; SIGTERM to the batch shell
would leave the hosts unaware. The batch shell is never signalled, so it lives on to
requeue the job once the hosts have exited 42.

Why each host records its exit code in `exit/attempt-<A>/host-<N>`: srun returns only the highest
code over all tasks, and `--kill-on-bad-exit` SIGTERMs the others once one fails, so a user error
(exit 2) on one host would read as a signal death (143) on another.
"""

from __future__ import annotations

import os
import shlex
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jobspec.errors import ConfigError
from jobspec.exit_codes import RESTARTABLE_EXIT_CODES, SIGNAL_EXIT_CODES
from jobspec.job_spec import JobSpec, SecretRef
from launch.backend import RenderedFile, Submission
from launch.state import RunFolders

SCRIPT, CONFIG, SPEC = "job.sbatch", "cfg.toml", "job.yaml"
CANCEL_MARK = "cancel-requested"  # written by cancel(); the batch shell then never requeues
RESULT = "result"  # "<exit code> <attempt>", written by the batch shell when it ends the job
EXITS = "exit"  # exit/attempt-<A>/host-<N>: each host's own exit code
# Coordinator port = base + job id % 4096: the range JAX's own SLURM detection uses, and every
# host computes the same port without talking to the others.
PORT_BASE = 61440
# JAX_PLATFORMS per accelerator kind: a GPU job must fail, not silently train on the CPU.
PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}


def default_rundir(run_id: str) -> Path:
    """Where a run's files go when the caller names no directory: its folder in the run registry
    (the submitting user's state dir; it must be on a filesystem the nodes share)."""
    return RunFolders().run_dir(run_id)


@dataclass(frozen=True)
class RunDir:
    """The files of one run, on a filesystem every node and the submitting host share."""

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


# The `--comment` of every job the backend submits: this prefix, then the run id.
JOB_COMMENT_PREFIX = "jaxjob:"


class ScriptTemplate(string.Template):
    """`@{name}` placeholders; `$` stays the shell's."""

    delimiter = "@"


# Each task: its process id and world size from srun, then the runtime. `trap : TERM` keeps this
# shell alive (the runtime gets the same SIGTERM and checkpoints) to record the runtime's code.
HOST_WRAPPER = """\
export JAXJOB_PROCESS_ID="$SLURM_PROCID" JAXJOB_NUM_PROCESSES="$SLURM_NTASKS"
trap : TERM
"${@:2}"
rc=$?
echo "$rc" >"$1/host-$SLURM_PROCID"
exit "$rc"\
"""

# The whole batch script. The verdict (at the end) goes over every host's code, by the table in
# jobspec/exit_codes.py (is_restartable): any other code (2 bad input, 1 a bug, 128 or above
# 159) fails the job with it; otherwise a restartable one (42 checkpointed on SIGTERM, 43 a peer
# was lost, 44 the cluster did not form, 45 a storage fault) or a death by signal (129-159,
# e.g. 137 OOM-killed, or 143 SIGTERMed by --kill-on-bad-exit after another host failed)
# requeues it while restarts remain.
SCRIPT_TEMPLATE = ScriptTemplate(
    r"""#!/bin/bash
# jaxjob run @{run_id}, rendered by the slurm backend; submit with: sbatch @{script}
# Files of this run (cfg.toml, job.yaml, logs/host-N.log, logs/batch.log) are in
# @{rundir_path}
@{directives}
rundir=@{rundir}
say() { echo "jaxjob: attempt $JAXJOB_ATTEMPT: $*"; }
finish() { echo "$1 $JAXJOB_ATTEMPT" >"$rundir/@{result}"; exit "$1"; }

# ---- setup (slurm.setup in the job spec)
@{setup}

# -u only after the setup lines (activate scripts often trip it); no -e: the hosts' exit
# codes are handled below
set -uo pipefail

# ---- the env contract; process id and world size are set per task, below
@{env}

exits="$rundir/@{exits}/attempt-$JAXJOB_ATTEMPT"
mkdir -p "$exits" && rm -f "$exits"/host-*
if [ -e "$rundir/@{cancel_mark}" ]; then say "launch cancel came before the hosts started"; finish 1; fi
say "on $SLURM_JOB_NODELIST, coordinator $JAXJOB_COORDINATOR"
host_wrapper=@{host_wrapper}
@{srun}
rc=$?

# ---- the verdict
codes=$(cat "$exits"/host-* 2>/dev/null | tr '\n' ' ')
codes=${codes% }
fatal=0 restart=0
for code in ${codes:-$rc}; do
    case $code in
    0) ;;
    @{restartable}) [ "$restart" != 0 ] || restart=$code ;;
    *) if [[ $code =~ ^[0-9]+$ ]] && ((code >= @{signal_min} && code <= @{signal_max})); then
           [ "$restart" != 0 ] || restart=$code
       else
           [ "$fatal" != 0 ] || fatal=$code
       fi ;;
    esac
done
if ((fatal == 0 && restart == 0 && rc != 0)); then fatal=$rc; fi  # srun itself failed
if ((fatal != 0)); then say "a host exited $fatal (hosts: $codes): not restartable"; finish "$fatal"; fi
if ((restart == 0)); then say "every host finished"; finish 0; fi
if [ -e "$rundir/@{cancel_mark}" ]; then say "hosts exited $codes after launch cancel"; finish "$restart"; fi
if ((JAXJOB_ATTEMPT < @{max_restarts})); then
    say "hosts exited $codes: requeueing (restart $((JAXJOB_ATTEMPT + 1)) of @{max_restarts})"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    say "scontrol requeue failed"
else
    say "hosts exited $codes: no restarts left (max_restarts @{max_restarts})"
fi
finish "$restart"
"""
)


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


def _directive_values(
    spec: JobSpec, sub: Submission, rd: RunDir, cwd: str, nodes: int, per_node: int
) -> list[tuple[str, str | int | None, str]]:
    """(option, value or None for a flag, the spec field to blame for a bad value)."""
    s = spec.slurm
    acc = spec.catalogue
    out: list[tuple[str, str | int | None, str]] = [
        ("job-name", sub.run_id, "run_id"),
        # How `launch list --backend slurm` tells jaxjob's jobs in squeue from the user's others.
        ("comment", f"{JOB_COMMENT_PREFIX}{sub.run_id}", "run_id"),
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
    return out


def _directives(
    spec: JobSpec, sub: Submission, rd: RunDir, cwd: str, nodes: int, per_node: int
) -> list[str]:
    return [
        f"#SBATCH --{opt}" if val is None else f"#SBATCH --{opt}={_value(str(val), field)}"
        for opt, val, field in _directive_values(spec, sub, rd, cwd, nodes, per_node)
    ]


def _env_lines(spec: JobSpec, sub: Submission) -> list[str]:
    lines = [
        f"export JAXJOB_RUN_ID={_word(sub.run_id, 'run_id')}",
        # Already absolute (or remote): prepare_submission resolved it where launch runs.
        f"export JAXJOB_OUTPUT_URI={_word(sub.output_uri, 'output_uri')}",
        'export JAXJOB_ATTEMPT="${SLURM_RESTART_COUNT:-0}"',
        "# A requeued job keeps its id: its next attempt succeeds this one as the run's owner.",
        'export JAXJOB_SUBMISSION_ID="slurm-${SLURM_CLUSTER_NAME:-cluster}-$SLURM_JOB_ID"',
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


def _container_args(spec: JobSpec, rd: RunDir, workdir: str) -> list[str]:
    c = spec.slurm.container
    if c is None:
        return []
    # The run directory (cfg.toml, exit codes) and the workdir must exist inside the container.
    mounts = list(dict.fromkeys([*c.mounts, f"{rd.root}:{rd.root}", f"{workdir}:{workdir}"]))
    return [
        f"--container-image={_word(c.image, 'slurm.container.image')}",
        f"--container-mounts={_word(','.join(mounts), 'slurm.container.mounts')}",
        f"--container-workdir={_word(workdir, 'workdir')}",
    ]


def _srun(
    spec: JobSpec, rd: RunDir, workdir: str, nodes: int, per_node: int, runtime: Sequence[str]
) -> list[str]:
    """The srun command line, one argument per element, that starts every host."""
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes * per_node}",
            f"--ntasks-per-node={per_node}"]  # fmt: skip
    if spec.slurm.cpus_per_task is not None:
        srun.append(f"--cpus-per-task={spec.slurm.cpus_per_task}")  # 22.05+ srun doesn't inherit it
    srun += [
        "--kill-on-bad-exit=1",  # a failed host ends the step instead of leaving peers to time out
        f"--output={_value(_pattern(rd.logs) + '/host-%t.log', 'rundir')}",  # %t = process id
    ]
    if spec.max_restarts > 0:
        srun.append("--open-mode=append")  # one log per host across attempts
    srun += _container_args(spec, rd, workdir)
    command = [*runtime, "worker", str(rd.config)]
    words = " ".join(_word(w, "runtime_command") for w in command)
    srun.append(f'bash -c "$host_wrapper" jaxjob-host "$exits" {words}')
    return srun


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
    return SCRIPT_TEMPLATE.substitute(
        run_id=sub.run_id,
        script=SCRIPT,
        rundir_path=str(rd.root),
        directives="\n".join(_directives(spec, sub, rd, workdir, nodes, per_node)),
        rundir=_word(str(rd.root), "rundir"),
        result=RESULT,
        setup="\n".join(spec.slurm.setup or ["# (none)"]),
        env="\n".join(_env_lines(spec, sub)),
        exits=EXITS,
        cancel_mark=CANCEL_MARK,
        host_wrapper=shlex.quote(HOST_WRAPPER),
        srun=" \\\n    ".join(_srun(spec, rd, workdir, nodes, per_node, runtime_command)),
        restartable="|".join(map(str, RESTARTABLE_EXIT_CODES)),
        signal_min=min(SIGNAL_EXIT_CODES),
        signal_max=max(SIGNAL_EXIT_CODES),
        max_restarts=spec.max_restarts,
    )


def render_files(
    sub: Submission,
    rundir: Path,
    *,
    cwd: Path | None,
    hosts_per_node: int,
    runtime_command: Sequence[str],
) -> list[RenderedFile]:
    """job.sbatch, cfg.toml and job.yaml, as submit writes them into `rundir`."""
    script = render_script(sub, rundir, cwd=cwd, hosts_per_node=hosts_per_node,
                           runtime_command=runtime_command)  # fmt: skip
    return [RenderedFile(SCRIPT, script), RenderedFile(CONFIG, sub.run_toml),
            RenderedFile(SPEC, sub.spec_yaml)]  # fmt: skip
