"""The `launch` command: submit a job spec to a backend, and follow, stop and list its runs.

Every check of the job spec (YAML, fields, accelerator, topology, mesh fit) happens before a
backend is asked to do anything. User mistakes end in one sentence on stderr and exit 2, never a
traceback. Backends are named in `launch.backends.BACKENDS` and imported on first use: `launch`
never imports jax; what differs between backends is asked of the backend or its job.yaml section.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from jobspec.cli import run_group
from jobspec.errors import ConfigError, JaxjobError
from jobspec.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED
from jobspec.files.job_yaml import job_schema
from jobspec.job_spec import JobSpec, check_mesh_fits
from jobspec.run_config import is_remote
from jobspec.version import version_option
from launch import logs_options
from launch.backend import TERMINAL, AlreadyRunningError, Backend, Submission, has_ended
from launch.backends import BACKENDS, backend_options, get_backend
from launch.completion import add_completion_command
from launch.overrides import describe as describe_overrides
from launch.overrides import override_options, refuse_incompatible_resubmit
from launch.registry import Registry, RunRecord
from launch.runid import new_run_id
from launch.state import utc_now
from launch.watch import Deadline, parse_duration
from runfolder.goodput import duration
from runfolder.outcome import closing_line

if TYPE_CHECKING:
    from launch.listing import RunRow
    from launch.registry import BrokenRecordError


def prepare_submission(
    job_path: str,
    backend: str,
    registry: Registry,
    sets: tuple[str, ...] = (),
    envs: tuple[str, ...] = (),
) -> Submission:
    """Load and check everything, in the order a user's mistakes are most likely found
    (`sets`, `envs`: `--set`/`--env`, launch/overrides.py)."""
    from launch.overrides import load_overridden

    def fresh_id(spec: JobSpec) -> str:  # a fresh id never reuses a run
        while registry.exists(run_id := new_run_id(spec.name)):
            pass
        return run_id

    job, overrides = load_overridden(job_path, fresh_id, sets, envs)
    spec, run, run_id, run_toml = job.spec, job.run, job.run_id, job.run_toml
    try:
        section = spec.backend_section(backend)
        if run is not None:
            check_mesh_fits(spec, run, backend)
        else:  # a prepare job uses no devices: only where its hosts can read and write
            assert spec.prepare is not None
            section.check_prepare(spec.prepare)
    except ConfigError as e:  # the sentence names the field; add the file it is in
        raise ConfigError(f"{job.path}: {e}") from None
    output_uri = job.output_uri
    # A relative path means "here" for hosts that see this machine's files; elsewhere (inside a
    # container) it is their own, so it stays as written.
    if not is_remote(output_uri) and section.hosts_see_this_filesystem:
        output_uri = str(Path(output_uri.removeprefix("file://")).resolve())
    return Submission(
        spec=spec,
        run_id=run_id,
        run_toml=run_toml,
        spec_yaml=job.spec_yaml,
        output_uri=output_uri,
        workdir=job.path.resolve().parent,
        overrides=overrides,
    )


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _fmt_progress(p: dict[str, Any]) -> str:
    if "error" in p:
        return p["error"]
    if p.get("note"):
        return p["note"]
    total = p.get("total_steps")
    loss = p.get("last_loss")
    out = f"step {p.get('step', 0)} / {total if total is not None else '?'}"
    out += f", loss {loss:.4f}" if isinstance(loss, int | float) else ""
    if p.get("diverged_at_step") is not None:
        out += f", diverged at step {p['diverged_at_step']}"
    return out


def _closing_line(info: dict[str, Any]) -> str:
    """`--wait`'s last line, in the form `runtime local` ends with (the backend's detail first;
    without progress from this submission, its note)."""
    p = info["progress"]
    fresh = "error" not in p and not p.get("note")
    detail = (
        info["detail"] if fresh else "; ".join(x for x in (info["detail"], _fmt_progress(p)) if x)
    )
    return closing_line(
        info["run_id"],
        info["state"],
        info["run_uri"],
        step=p.get("step") if fresh else None,
        total_steps=p.get("total_steps"),
        loss=p.get("last_loss") if fresh else None,
        best_eval=p.get("best_eval") if fresh else None,
        detail=detail,
    )


def _fmt_attempt(st: dict[str, Any]) -> str:
    """The attempt line from whichever restart counts the backend knows (local: restarts and
    max_restarts; slurm: the requeue count; k8s: the restarts counted against the maximum)."""
    if st.get("attempt") is None:
        return ""
    restarts, most = st.get("restarts"), st.get("max_restarts")
    if restarts is not None and most is not None:
        return f"{st['attempt']}  ({restarts} of {most} restarts)"
    if st.get("restarts_counted") is not None:
        return f"{st['attempt']}  ({st['restarts_counted']} restarts counted against max_restarts)"
    return str(st["attempt"])


def _status(rec: RunRecord, st: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's state (`st`: the backend's status when the caller already has it)."""
    from runfolder.view import read_progress

    if st is None:
        st = get_backend(rec.backend, rec.backend_options).status(rec.to_handle())
    return {
        "run_id": rec.run_id,
        "backend": rec.backend,
        "state": st.get("state", "unknown"),
        "detail": st.get("detail", ""),
        "backend_status": st,
        # Only what this submission wrote: a resubmitted run's folder has the earlier ones'.
        "progress": read_progress(rec.run_uri, since=rec.submitted),
        "run_uri": rec.run_uri,
        "submitted": rec.submitted,
        "job_path": rec.job_path,
        "overrides": rec.overrides,  # launch submit --set/--env
    }


def _wait(
    backend: Backend,
    rec: RunRecord,
    stream: bool,
    all_hosts: bool = False,
    hosts: int | None = None,
    deadline: Deadline | None = None,
) -> dict[str, Any]:
    """Stream the run's output (quiet view unless `all_hosts`; `hosts`: how many the job has)
    and return the backend's status once the run has ended (TimedOut, exit 124: not by
    `deadline`)."""
    from launch.quiet import QuietStream, follow_quiet
    from launch.watch import until

    handle = rec.to_handle()
    if stream:
        lines = backend.logs(handle, host=None, follow=True, tail=None, since_submission=True)
        lines = until(lines, deadline)
        if all_hosts:
            for line in lines:
                click.echo(line)
        else:
            view = QuietStream(hosts)
            for line in follow_quiet(lines, view):
                click.echo(line)
            if note := view.hidden.note():
                click.echo(note, err=True)
    while not has_ended(st := backend.status(handle)):
        if st.get("never_starts"):  # waiting would never end
            raise JaxjobError(
                f"run {rec.run_id} is queued but {st['hint']}; it stays queued "
                f"(launch cancel {rec.run_id} removes it)"
            )
        if deadline is not None and deadline.passed():
            raise deadline.timed_out(rec.run_id, st)
        time.sleep(1.0 if deadline is None else min(1.0, deadline.left()))
    return st


def _refuse_if_active(registry: Registry, run_id: str) -> None:
    """A run id whose previous submission has not ended (pending or running, as its own
    backend says) is not submitted again: both would train and write the run's state."""
    previous = registry.get(run_id)  # a broken record says so: it may name a run that runs
    if previous is None:
        return
    try:
        st = get_backend(previous.backend, previous.backend_options).status(previous.to_handle())
    except JaxjobError as e:
        raise JaxjobError(
            f"cannot tell whether run {run_id} (submitted {previous.submitted[:19]} to "
            f"{previous.backend}) still runs, so it is not submitted again: {e}"
        ) from None
    state = st.get("state")
    if state in ("pending", "running"):
        raise AlreadyRunningError(run_id, state, st.get("attempt"), previous.submitted)


def _submit(
    impl: Backend, sub: Submission, registry: Registry, options: dict[str, Any], job: str
) -> RunRecord:
    """Check that the run is not running, submit it and record it, under the run's submit lock:
    of two submits of one run id, the second sees the first's record and is refused."""
    run_dir = registry.run_dir(sub.run_id)
    fresh = not run_dir.exists()
    with registry.submit_lock(sub.run_id):
        _refuse_if_active(registry, sub.run_id)  # before anything is written or started
        fresh = fresh and not registry.exists(sub.run_id)
        submitted = utc_now()  # before the submit: whatever this submission writes is newer
        try:
            handle = impl.submit(sub)
            if not getattr(impl, "writes_run_files", False):  # local and slurm write their own
                registry.prepare_run_dir(sub)
        except BaseException:
            if fresh:  # nothing was submitted: leave no trace in the registry
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        rec = RunRecord(
            run_id=sub.run_id,
            backend=impl.name,
            handle=handle.data,
            output_uri=sub.output_uri,
            submitted=submitted,
            job_path=str(Path(job).resolve()),
            backend_options=options,
            overrides=sub.overrides,
        )
        registry.record(rec)
    return rec


BACKEND_OPTION = click.option(
    "--backend",
    type=click.Choice(list(BACKENDS)),
    default="local",
    show_default=True,
    help="local: host processes on this machine; slurm: sbatch; k8s: a JobSet.",
)
CONTEXT_OPTION = click.option("--context", default=None, help="kube context (k8s only).")
NAMESPACE_OPTION = click.option(
    "--namespace", default=None, help="Namespace, overriding k8s.namespace (k8s only)."
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _selection_options(fn):
    """--status/--name/--backend and the cluster's --context/--namespace/-A, shared by list,
    cancel and clean (applied in reverse: click lists them in this order)."""
    for opt in reversed([
        click.option("--status", "states", multiple=True, metavar="S",
                     help="Only runs in state S: pending, running, succeeded, failed, cancelled, "
                     "unknown, or active (pending+running), ended; repeat or comma-separate."),
        click.option("--name", "name", metavar="GLOB", default=None,
                     help="Only runs whose id matches GLOB ('sweep-*'; a job's runs are "
                     "'<name>-*')."),
        click.option("--backend", "backend", type=click.Choice(list(BACKENDS)), default=None,
                     help="Only this backend's runs; for k8s and slurm also the cluster's own: "
                     "the JobSets jaxjob made in the namespace, the user's jaxjob jobs in "
                     "squeue, from any machine."),
        CONTEXT_OPTION,
        click.option("--namespace", default=None,
                     help="With --backend k8s: the namespace to look in (default: default)."),
        click.option("-A", "--all-namespaces", "all_namespaces", is_flag=True,
                     help="With --backend k8s: every namespace."),
    ]):  # fmt: skip
        fn = opt(fn)
    return fn


def _selected(
    states: frozenset[str] | None,
    name: str | None,
    backend: str | None,
    context: str | None,
    namespace: str | None,
    all_namespaces: bool,
    newer_than_s: float | None = None,
    older_than_s: float | None = None,
) -> tuple[list[RunRow], list[BrokenRecordError], dict[str, Any]]:
    """(rows, broken records, the cluster options) of the runs the options select."""
    from launch.listing import RunFilter, collect

    given = {"context": context, "namespace": namespace}
    if (context or namespace or all_namespaces) and backend != "k8s":
        flag = "--context" if context else "--namespace" if namespace else "--all-namespaces"
        raise JaxjobError(f"{flag} applies only with --backend k8s")
    if namespace and all_namespaces:
        raise JaxjobError("--namespace and --all-namespaces exclude each other; give one")
    options = backend_options(backend, given) if backend else {}
    filt = RunFilter(states, name, newer_than_s, older_than_s, backend)
    rows, broken = collect(Registry(), filt, options=options, all_namespaces=all_namespaces)
    return rows, broken, options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@version_option("launch")
def cli() -> None:
    """jaxjob launch: run a job spec (job.yaml) on this machine, SLURM or Kubernetes."""


@cli.command("submit")
@click.argument("job")
@BACKEND_OPTION
@CONTEXT_OPTION
@NAMESPACE_OPTION
@click.option(
    "--wait",
    is_flag=True,
    help="Stream the run's output until it ends; exit 0 if it succeeded, 1 if not. Shows host "
    "0's lines and the other hosts' warnings and errors, each once with a count of the hosts "
    "that said it ([3 hosts: 0-2] ...).",
)
@click.option(
    "--all-hosts",
    is_flag=True,
    help="With --wait: every line of every host, each prefixed [host N].",
)
@click.option(
    "--timeout",
    metavar="D",
    default=None,
    help="With --wait: stop waiting after D (30s, 10m, 2h, 1h30m) and exit 124; the run goes "
    "on (launch wait RUN, launch cancel RUN).",
)
@JSON_OPTION
@override_options
def submit_cmd(
    job: str,
    backend: str,
    context: str | None,
    namespace: str | None,
    wait: bool,
    all_hosts: bool,
    timeout: str | None,
    as_json: bool,
    sets: tuple[str, ...],
    envs: tuple[str, ...],
) -> None:
    """Check JOB (a job.yaml) and submit it; prints the run id and how to follow it."""
    if all_hosts and not wait:
        raise JaxjobError("--all-hosts applies only with --wait (launch logs RUN --all-hosts)")
    if timeout is not None and not wait:
        raise JaxjobError(
            "--timeout applies only with --wait (launch submit JOB --wait --timeout D)"
        )
    deadline = Deadline.parse(timeout)  # a bad duration is said before anything is submitted
    options = backend_options(backend, {"context": context, "namespace": namespace})
    impl = get_backend(backend, options)  # a bad option is said before the job spec is read
    registry = Registry()
    sub = prepare_submission(job, backend, registry, sets, envs)
    refuse_incompatible_resubmit(registry, sub, sets)
    run_dir = registry.run_dir(sub.run_id)
    rec = _submit(impl, sub, registry, options, job)
    if not wait:
        if as_json:
            _print_json({"run_id": rec.run_id, "backend": backend, "handle": rec.handle,
                         "run_uri": rec.run_uri, "run_dir": str(run_dir)})  # fmt: skip
            return
        r = rec.run_id
        click.echo(f"submitted {r} to the {backend} backend (artifacts: {rec.run_uri})")
        click.echo(f"  follow:  launch logs {r} --follow")
        click.echo(f"  status:  launch status {r}")
        click.echo(f"  cancel:  launch cancel {r}")
        return
    if not as_json:
        click.echo(f"submitted {rec.run_id} to the {backend} backend; waiting for it", err=True)
    hosts = sub.spec.host_processes(backend)
    try:
        st = _wait(
            impl, rec, stream=not as_json, all_hosts=all_hosts, hosts=hosts, deadline=deadline
        )
    except KeyboardInterrupt:
        click.echo(
            f"stopped waiting; {rec.run_id} goes on (launch cancel {rec.run_id} stops it)", err=True
        )
        sys.exit(EXIT_INTERRUPTED)
    info = _status(rec, st)
    if as_json:
        _print_json(info)
    else:
        click.echo(_closing_line(info), err=True)
    sys.exit(0 if info["state"] == "succeeded" else EXIT_FAILED)


@cli.command("render")
@click.argument("job")
@BACKEND_OPTION
@CONTEXT_OPTION
@NAMESPACE_OPTION
@click.option(
    "-o",
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Write the files into this directory (default: print them).",
)
@override_options
def render_cmd(
    job: str,
    backend: str,
    context: str | None,
    namespace: str | None,
    out: str | None,
    sets: tuple[str, ...],
    envs: tuple[str, ...],
) -> None:
    """Show exactly what `submit` would send for JOB; nothing is submitted."""
    options = backend_options(backend, {"context": context, "namespace": namespace})
    impl = get_backend(backend, options)  # a bad option is said before the job spec is read
    files = impl.render(prepare_submission(job, backend, Registry(), sets, envs))
    if out is None:
        for f in files:
            if len(files) > 1:
                click.echo(f"# ==> {f.name} <==")
            click.echo(f.content.rstrip("\n"))
        return
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for f in files:
        (d / f.name).write_text(f.content)
        click.echo(str(d / f.name))


@cli.command("status")
@click.argument("run")
@JSON_OPTION
@click.option(
    "--watch",
    is_flag=True,
    help="Keep showing the status until the run ends (redrawn in place on a terminal; piped, "
    "each changed line once, with its UTC time); exit 0 if it succeeded, 1 if not.",
)
@click.option(
    "--interval",
    metavar="D",
    default=None,
    help="With --watch: how often to ask (2s, 1m, ...; default 5s).",
)
def status_cmd(run: str, as_json: bool, watch: bool, interval: str | None) -> None:
    """The backend's state of RUN and its progress (step, loss, evals, last event) from its
    artifacts."""
    from launch.watch import watch as watch_lines

    if interval is not None and not watch:
        raise JaxjobError("--interval applies only with --watch (launch status RUN --watch)")
    if watch and as_json:
        raise JaxjobError("--watch shows the status as text; --json is one snapshot, without it")
    every = parse_duration(interval, "--interval") if interval is not None else 5.0
    rec = Registry().lookup(run)
    if not watch:
        info = _status(rec)
        if as_json:
            _print_json(info)
            return
        for line in _status_lines(info):
            click.echo(line)
        return
    last: dict[str, Any] = {}

    def poll() -> tuple[list[str], bool]:
        last.update(_status(rec))
        st = last["backend_status"]
        return _status_lines(last), has_ended(st) or bool(st.get("never_starts"))

    watch_lines(poll, interval=every)
    if last["backend_status"].get("never_starts"):  # watching would never end
        raise JaxjobError(f"run {rec.run_id} is queued but {last['backend_status']['hint']}")
    sys.exit(0 if last["state"] == "succeeded" else EXIT_FAILED)


def _status_lines(info: dict[str, Any]) -> list[str]:
    """`launch status`'s text for `_status`'s `info`."""
    from runfolder.view import record_lines

    st = info["backend_status"]
    out = [f"run         {info['run_id']}  ({info['backend']})"]
    out.append(f"state       {info['state']}  {info['detail']}")
    attempt = _fmt_attempt(st)
    if attempt:
        out.append(f"attempt     {attempt}")
    if st.get("hint"):
        out.append(f"hint        {st['hint']}")
    progress = info["progress"]
    out.append(f"progress    {_fmt_progress(progress)}")
    if progress.get("eta_s") is not None and info["state"] == "running":
        out.append(f"eta         {duration(progress['eta_s'])} (at the recent step time)")
    out += record_lines(
        progress, ("latest_eval", "best_eval", "goodput", "last_event", "failure"), 12
    )
    if info.get("overrides"):
        out.append(f"overrides   {describe_overrides(info['overrides'])}")
    out.append(f"artifacts   {info['run_uri']}")
    return out


@cli.command("logs")
@click.argument("run")
@click.option("--host", type=click.IntRange(min=0), default=None, help="Only this host's output.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the run ends.")
@click.option(
    "--tail", type=click.IntRange(min=0), default=None, help="Only the last K lines of each host."
)
@click.option(
    "--all-hosts",
    is_flag=True,
    help="Every line of every host, each prefixed [host N] (default: the quiet view).",
)
@click.option(
    "--since",
    metavar="DURATION",
    default=None,
    help="Only lines written in the last DURATION (10s, 5m, 2h, 1h30m), as kubectl (--tail "
    "then keeps the last K of those). From the run folder's host logs, which record when each "
    "line was written (every attempt, or --attempt N); with --follow, k8s asks the API for "
    "live pods' lines (sinceSeconds), local and slurm follow the run folder.",
)
@click.option(
    "--timestamps",
    is_flag=True,
    help="Put the time each line was written first (RFC 3339 UTC, ms: "
    "2026-12-07T23:01:02.345Z [host 0] ...), as kubectl; a line shown once for several hosts "
    "has the earliest of their times. Read as --since says: the run folder's recorded times; "
    "with --follow on k8s the kubelet's, on local and slurm the run folder's as it grows.",
)
@click.option(
    "--attempt",
    type=click.IntRange(min=0),
    default=None,
    help="Attempt N's host logs (from the run folder) instead of every attempt's.",
)
def logs_cmd(
    run: str,
    host: int | None,
    follow: bool,
    tail: int | None,
    all_hosts: bool,
    since: str | None,
    timestamps: bool,
    attempt: int | None,
) -> None:
    """The output of RUN (all attempts). By default the quiet view: host 0's lines, each prefixed
    `[host 0] `, and the other hosts' warnings and errors; a line that several hosts said is
    shown once, prefixed with their count (`[64 hosts: 0-63] `). --all-hosts: every host's
    lines, each prefixed `[host N] `; --host N: that host's lines only. --since/--timestamps:
    the run folder's host logs, with the time each host's tee recorded for each line."""
    from launch.quiet import Hidden, QuietStream, follow_quiet, quiet_lines

    if host is not None and all_hosts:
        raise JaxjobError("--host and --all-hosts exclude each other; use one")
    if attempt is not None and follow:
        raise JaxjobError("--attempt and --follow exclude each other; follow the latest attempt")
    since_s = None if since is None else parse_duration(since, "--since")
    registry = Registry()
    rec = registry.lookup(run)
    hosts = _host_count(registry, rec)
    if host is not None and hosts is not None and host >= hosts:
        raise JaxjobError(
            f"--host {host}: run {rec.run_id} has hosts 0-{hosts - 1}"
            if hosts > 1
            else f"--host {host}: run {rec.run_id} has one host, host 0"
        )
    try:
        if since_s is not None or timestamps:  # read before any line is printed: errors first
            lines = logs_options.timed_logs(
                rec, host=host, follow=follow, tail=tail, attempt=attempt, since_s=since_s,
                timestamps=timestamps,
            )  # fmt: skip
        elif attempt is not None:
            lines = logs_options.attempt_lines(
                rec.run_uri, rec.run_id, attempt, host=host, tail=tail
            )
        else:
            backend = get_backend(rec.backend, rec.backend_options)
            lines = backend.logs(rec.to_handle(), host=host, follow=follow, tail=tail)
        if host is not None or all_hosts:
            for line in lines:
                click.echo(line)
            return
        hidden = Hidden()
        if follow:
            view = QuietStream(hosts)  # a line every host said is due at once
            hidden = view.hidden
            for line in follow_quiet(lines, view):
                click.echo(line)
        else:
            for line in quiet_lines(lines, hidden):
                click.echo(line)
        if note := hidden.note():
            click.echo(note, err=True)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


def _host_count(registry: Registry, rec: RunRecord) -> int | None:
    """How many hosts the run has, from the job.yaml its submit kept (None: unreadable)."""
    import yaml

    try:
        data = yaml.safe_load((registry.run_dir(rec.run_id) / "job.yaml").read_text())
        return JobSpec.model_validate(data).host_processes(rec.backend)
    except Exception:  # noqa: BLE001 - only a check and a shortcut; the logs still show
        return None


@cli.command("cancel")
@click.argument("run", required=False)
@click.option("--wait", is_flag=True, help="Return once the run (or every run) has stopped.")
@click.option("--all", "all_runs", is_flag=True,
              help="Every pending or running run the filters select (all of them without "
              "filters).")  # fmt: skip
@_selection_options
@click.option("-y", "--yes", is_flag=True, help="With --all/--name/--status: do not ask first.")
def cancel_cmd(
    run: str | None,
    wait: bool,
    all_runs: bool,
    states: tuple[str, ...],
    name: str | None,
    backend: str | None,
    context: str | None,
    namespace: str | None,
    all_namespaces: bool,
    yes: bool,
) -> None:
    """Stop RUN gracefully: every host gets SIGTERM, saves a checkpoint and exits. Or many runs:
    --all (every pending or running run), narrowed by --name/--status/--backend; they are shown
    and asked about first unless --yes."""
    from launch.bulk import cancel_rows, confirm
    from launch.listing import STATE_GROUPS, parse_states

    bulk = all_runs or name is not None or bool(states) or backend is not None
    if run is not None and bulk:
        raise JaxjobError("give RUN or a selection (--all, --name, --status, --backend), not both")
    if run is None:
        if not bulk:
            raise JaxjobError("give the run to cancel (launch cancel RUN), or --all")
        wanted = parse_states(states) or STATE_GROUPS["active"]
        if not wanted <= STATE_GROUPS["active"]:
            raise JaxjobError("--status: only pending or running runs can be cancelled")
        rows, _, options = _selected(wanted, name, backend, context, namespace, all_namespaces)
        if not rows:
            click.echo("no pending or running runs match; nothing to cancel")
            return
        if not confirm(f"Cancel these {len(rows)} run(s)?", rows, yes):
            click.echo("nothing cancelled", err=True)
            sys.exit(EXIT_FAILED)
        sys.exit(cancel_rows(rows, options, wait))
    if yes or context or namespace or all_namespaces:
        raise JaxjobError("-y/--context/--namespace/-A go with --all, --name or --status")
    rec = Registry().lookup(run)
    backend_impl = get_backend(rec.backend, rec.backend_options)
    handle = rec.to_handle()
    state = backend_impl.status(handle).get("state")
    if state in TERMINAL:
        click.echo(f"{rec.run_id} has already ended ({state}); nothing to cancel")
        return
    backend_impl.cancel(handle)
    if not wait:
        click.echo(f"cancel sent to {rec.run_id}: its hosts checkpoint and stop")
        return
    while not has_ended(st := backend_impl.status(handle)):
        time.sleep(0.5)
    click.echo(f"{rec.run_id} {st['state']}: {st.get('detail', '')}")


@cli.command("wait")
@click.argument("run")
@click.option(
    "--timeout",
    metavar="D",
    default=None,
    help="Stop waiting after D (30s, 10m, 2h, 1h30m) and exit 124; the run goes on.",
)
def wait_cmd(run: str, timeout: str | None) -> None:
    """Wait until RUN's latest submission ends and print how it ended; exit 0 if it succeeded, 1
    if it failed or was cancelled, 124 if it had not ended within --timeout."""
    deadline = Deadline.parse(timeout)
    rec = Registry().lookup(run)
    backend = get_backend(rec.backend, rec.backend_options)
    try:
        st = _wait(backend, rec, stream=False, deadline=deadline)
    except KeyboardInterrupt:
        click.echo(f"stopped waiting; {rec.run_id} goes on", err=True)
        sys.exit(EXIT_INTERRUPTED)
    info = _status(rec, st)
    click.echo(_closing_line(info))
    sys.exit(0 if info["state"] == "succeeded" else EXIT_FAILED)


@cli.command("list")
@_selection_options
@click.option("--since", metavar="D", default=None, help="Only runs submitted in the last D "
              "(30m, 2h, 7d).")  # fmt: skip
@JSON_OPTION
def list_cmd(
    states: tuple[str, ...],
    name: str | None,
    backend: str | None,
    context: str | None,
    namespace: str | None,
    all_namespaces: bool,
    since: str | None,
    as_json: bool,
) -> None:
    """Runs, newest first, with their state as each backend says: those submitted from this
    machine, and with --backend k8s|slurm also the cluster's own (WHERE says where they were
    found; `here` is this machine's record)."""
    from launch.listing import HEADER, parse_states, row_line

    wanted = parse_states(states)
    newer = parse_duration(since, "--since") if since is not None else None
    rows, broken, _ = _selected(wanted, name, backend, context, namespace, all_namespaces, newer)
    if as_json:
        _print_json([r.to_json() for r in rows])
        for b in broken:  # the JSON stays a list of runs; what could not be read goes aside
            click.echo(f"broken record: {b.path}: {b.why}", err=True)
        return
    filtered = any((wanted, name, backend, since))
    if not rows and not broken:
        click.echo("no runs match" if filtered else "no runs submitted from this machine yet")
        return
    if rows:
        click.echo(HEADER)
    for r in rows:
        click.echo(row_line(r))
    for b in broken:
        click.echo(f"broken record: {b.path}: {b.why}")


@cli.command("clean")
@_selection_options
@click.option("--older-than", "older_than", metavar="D", default=None,
              help="Only runs submitted longer ago than D (7d, 12h).")  # fmt: skip
@click.option("-y", "--yes", is_flag=True, help="Do not ask first.")
def clean_cmd(
    states: tuple[str, ...],
    name: str | None,
    backend: str | None,
    context: str | None,
    namespace: str | None,
    all_namespaces: bool,
    older_than: str | None,
    yes: bool,
) -> None:
    """Remove ended runs' records from this machine (`launch list` no longer shows them) and, on
    Kubernetes, their finished JobSets and ConfigMaps. Never a run's storage: its checkpoints,
    metrics and host logs stay. Asks first unless --yes."""
    from launch.bulk import clean_rows, confirm
    from launch.listing import STATE_GROUPS, parse_states

    wanted = parse_states(states) or STATE_GROUPS["ended"]
    if not wanted <= STATE_GROUPS["ended"]:
        raise JaxjobError(
            "--status: clean removes ended runs only; use succeeded, failed, cancelled or ended"
        )
    older = parse_duration(older_than, "--older-than") if older_than is not None else None
    rows, _, options = _selected(wanted, name, backend, context, namespace, all_namespaces,
                                 older_than_s=older)  # fmt: skip
    rows = [r for r in rows if r.ended]
    if not rows:
        click.echo("no ended runs match; nothing to clean")
        return
    if not confirm(f"Remove the records of these {len(rows)} ended run(s)?", rows, yes):
        click.echo("nothing removed", err=True)
        sys.exit(EXIT_FAILED)
    sys.exit(clean_rows(Registry(), rows, options))


@cli.command("plan")
@click.argument("job", type=click.Path(dir_okay=False))
@JSON_OPTION
@click.option(
    "--fit",
    is_flag=True,
    help="Choose remat, loss chunking, accumulation and attention (runtime plan --fit).",
)
@click.option(
    "-o",
    "--out",
    "overlay",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --fit: write the pick as a run config (and the job's run config beside it, "
    "OUT's stem + .run.toml, which it includes).",
)
@override_options
def plan_cmd(
    job: str,
    as_json: bool,
    fit: bool,
    overlay: str | None,
    sets: tuple[str, ...],
    envs: tuple[str, ...],
) -> None:
    """Compile JOB's train step for its accelerator, hosts and slices (`runtime plan`) and print
    memory per chip, predicted step time, FLOPs and collectives. Exits 0 fits, 1 does not fit,
    2 bad input."""
    from launch.plan import run_plan

    if overlay and not fit:
        raise JaxjobError("--out goes with --fit (launch plan JOB --fit --out pick.toml)")
    sys.exit(run_plan(job, as_json, fit, overlay, sets, envs))


@cli.command("schema")
def schema_cmd() -> None:
    """Print the JSON Schema of job.yaml (for editors and validators)."""
    _print_json(job_schema())


add_completion_command(cli)


def main(argv: list[str] | None = None) -> None:
    run_group(cli, "launch", argv)


if __name__ == "__main__":
    main()
