"""The `runtime` command. User mistakes end in one sentence on stderr and exit 2, never a traceback.

This module assembles the command groups, each in its own module: run.py (local, worker, inspect,
plot), plan.py (config, preflight, plan), data.py (data), checkpoint_commands.py (checkpoints,
eval, sample, export, import); common.py holds what they share. Those import only click, and
jax lazily, so `config schema|check` and `data check` answer quickly.
"""

from __future__ import annotations

import sys

import click

from jobspec.cli import run_group
from jobspec.version import version_option
from runtime.commands.checkpoint_commands import (
    checkpoints_group,
    eval_group,
    export_group,
    import_group,
    sample_group,
)
from runtime.commands.data import data_group
from runtime.commands.plan import config_group, plan_cmd, preflight_cmd
from runtime.commands.run import inspect_cmd, local_cmd, plot_cmd, worker_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@version_option("runtime")
def cli() -> None:
    """jaxjob runtime: the program every host of a job runs."""


for command in (
    local_cmd,
    worker_cmd,
    config_group,
    data_group,
    preflight_cmd,
    plan_cmd,
    inspect_cmd,
    plot_cmd,
    checkpoints_group,
    eval_group,
    sample_group,
    export_group,
    import_group,
):
    cli.add_command(command)


def _quiet_library_logs() -> None:
    # Orbax's notices, and its error lines for what it raises to us too (one sentence).
    from runtime.host import library_logs

    library_logs.quiet()


def main(argv: list[str] | None = None) -> None:
    from runtime.host import compile_cache, platform

    platform.choose()  # before jax is imported: no probing of plugins this machine cannot use
    compile_cache.configure()  # before jax is imported, too
    _quiet_library_logs()
    try:
        run_group(cli, "runtime", argv)
    except SystemExit as e:
        from jobspec.exit_codes import EXIT_STORAGE_FAULT
        from runtime.host import startup

        code = e.code if isinstance(e.code, int) else 1
        # Every `finally` has run (a failure recorded, the claim released); skip only the
        # interpreter's shutdown (see stopped()). After a storage fault that shutdown would join
        # Orbax's threads, which may still be retrying a dead upload (up to storage_retry_s).
        if startup.stopped() or code == EXIT_STORAGE_FAULT:
            from runtime.host import hostlog

            sys.stdout.flush()
            sys.stderr.flush()
            hostlog.hard_exit(code)
        raise


if __name__ == "__main__":
    main()
