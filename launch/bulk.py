"""`launch cancel --all|--name|--status` and `launch clean`: many runs at once, after a yes.

Both show what they will do and ask first (`--yes` skips the question; with no answer, e.g.
stdin closed, nothing is done). Cancel is the graceful one of `launch cancel RUN` (every host
checkpoints and stops); clean removes only what bookkeeping an ended run leaves: its folder in
this machine's registry and, on Kubernetes, its finished JobSet and ConfigMap. A run's storage
(checkpoints, metrics, host logs) is never touched.
"""

from __future__ import annotations

import time

import click

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_FAILED
from launch.backend import has_ended
from launch.backends import get_backend
from launch.listing import HEADER, RunRow, row_line
from launch.registry import Registry


def confirm(question: str, rows: list[RunRow], yes: bool) -> bool:
    """Show `rows` and ask `question`; True with --yes or a yes. Without an answer (stdin
    closed or not a terminal with nothing on it), nothing is done: False."""
    click.echo(HEADER)
    for r in rows:
        click.echo(row_line(r))
    if yes:
        return True
    try:
        return click.confirm(question, default=False, err=True)
    except click.Abort:  # EOF: nobody to answer
        click.echo("", err=True)
        return False


def cancel_rows(rows: list[RunRow], options: dict, wait: bool, poll_s: float = 0.5) -> int:
    """Cancel each run (gracefully); with `wait`, return once every one has ended. The exit
    code: 0, or 1 when any could not be cancelled."""
    failed = 0
    sent = []
    for r in rows:
        try:
            backend = get_backend(r.backend, r.record.backend_options if r.record else options)
            backend.cancel(r.handle)
        except JaxjobError as e:
            failed += 1
            click.echo(f"error: cancelling {r.run_id}: {e}", err=True)
            continue
        sent.append((r, backend))
        click.echo(f"cancel sent to {r.run_id}: its hosts checkpoint and stop")
    if wait:
        for r, backend in sent:
            while not has_ended(st := backend.status(r.handle)):
                time.sleep(poll_s)
            click.echo(f"{r.run_id} {st['state']}: {st.get('detail', '')}")
    return EXIT_FAILED if failed else 0


def clean_rows(registry: Registry, rows: list[RunRow], options: dict) -> int:
    """Remove each ended run's registry folder and what its cluster keeps of it (k8s: the
    JobSet and its ConfigMap). The exit code: 0, or 1 when any could not be removed."""
    failed = records = objects = 0
    for r in rows:
        try:
            backend = get_backend(r.backend, r.record.backend_options if r.record else options)
            if hasattr(backend, "forget") and (removed := backend.forget(r.handle)):
                objects += 1
                click.echo(f"deleted {removed} ({r.run_id})")
            if r.record is not None and registry.remove(r.record):
                records += 1
                click.echo(f"removed {r.run_id}'s record ({registry.run_dir(r.run_id)})")
        except (JaxjobError, OSError) as e:
            failed += 1
            click.echo(f"error: cleaning {r.run_id}: {e}", err=True)
    said = f"removed {records} record(s) from this machine"
    if objects:
        said += f" and {objects} finished JobSet(s) from the cluster"
    click.echo(f"{said}; the runs' artifacts stay in their storage", err=True)
    return EXIT_FAILED if failed else 0
