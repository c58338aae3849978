"""The `runtime` commands on one run: train it (`local` on this node, `worker` as one host of a
job) and read what it recorded (`inspect`, `plot`).

Only click is imported here; jax, the trainer and matplotlib load when a command runs.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Literal

import click

from jobspec.errors import ConfigError
from runtime.commands.common import SET_OPTION, load_config, overrides, print_json

if TYPE_CHECKING:
    from jobspec.run_config import RunConfig
    from runtime.host.boot import BootContract, BootInfo


def _profile_sets(spec: str | None) -> tuple[str, ...]:
    """`--profile-steps N:K` → the [profile] keys it stands for (K defaults to 2)."""
    if spec is None:
        return ()
    first, _, count = spec.partition(":")
    try:
        start, steps = int(first), int(count or 2)
    except ValueError:
        raise ConfigError(
            f"--profile-steps {spec!r}: use START:COUNT, e.g. --profile-steps 10:3"
        ) from None
    return (f"profile.start_step={start}", f"profile.steps={steps}")


PROFILE_OPTION = click.option(
    "--profile-steps",
    "profile_steps",
    metavar="N:K",
    default=None,
    help="Trace steps N..N+K-1 with jax.profiler on every host into <run>/profile/host-<i>/ "
    "(the same as [profile] start_step = N, steps = K).",
)


@click.command("local")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--resume", is_flag=True, help="Continue the run from its latest committed checkpoint."
)
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many steps of this attempt, with a checkpoint (resume later with --resume).",
)
@click.option(
    "--from-step",
    type=click.IntRange(min=0),
    default=None,
    help="With --resume: continue from this committed checkpoint instead of the latest; the "
    "later checkpoints are discarded (each one printed).",
)
@PROFILE_OPTION
@SET_OPTION
def local_cmd(
    config: str,
    resume: bool,
    max_steps: int | None,
    from_step: int | None,
    profile_steps: str | None,
    sets: tuple[str, ...],
) -> None:
    """Train CONFIG on this node's devices, with no launcher.

    Exits 0 when done (or stopped by --max-steps), 42 when stopped by SIGTERM/SIGINT (after a
    final checkpoint, or during start-up; restartable: run again with --resume), 2 on a bad
    config or input or a checkpoint that cannot be read (resume from an older one with
    --resume --from-step N), 45 on a storage fault (restartable), 46 when training diverged (a
    NaN/inf loss or gradient; not restartable).
    """
    from runtime.host import startup

    startup.install()  # a SIGTERM before the first step is restartable (42), not 143
    if from_step is not None and not resume:
        raise ConfigError(
            f"--from-step {from_step} continues a run: pass it with --resume "
            f"(runtime local CONFIG --resume --from-step {from_step})"
        )
    cfg, source = load_config(config, (*sets, *_profile_sets(profile_steps)))
    from runtime.host import platform

    platform.start_backend()  # beside the imports below (one process: no cluster to form first)
    from runfolder.storage import join

    if resume:  # the checksum comparison beside the imports and the backend's start
        from runtime.run import early_check

        early_check.start(join(cfg.run.output_uri, cfg.run.id), from_step)
    from runtime.train.loop import train

    result = train(cfg, source, resume=resume, max_steps=max_steps, from_step=from_step)
    run_dir = join(cfg.run.output_uri, cfg.run.id)
    click.echo(closing_line(result.summary, run_dir, cfg.training.total_steps), err=True)
    sys.exit(result.exit_code)


def closing_line(summary: dict, run_dir: str, total_steps: int | None = None) -> str:
    """`runtime local`'s last line: how the run ended, where it got to, and where it is (the
    form `launch submit --wait` ends with too)."""
    from runfolder.outcome import closing_line as line

    return line(
        str(summary.get("run_id")),
        str(summary.get("status")),
        run_dir,
        step=summary.get("steps", 0),
        total_steps=total_steps,
        loss=summary.get("final_loss"),
        best_eval=summary.get("best_eval"),
    )


@click.command("worker")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--reshard",
    is_flag=True,
    help="Allow resuming onto a different process count or mesh (Orbax reshards the state).",
)
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many steps of this attempt, with a checkpoint.",
)
@SET_OPTION
def worker_cmd(config: str, reshard: bool, max_steps: int | None, sets: tuple[str, ...]) -> None:
    """Run CONFIG as one host of a multi-host job: the entrypoint every backend starts.

    Reads the env contract (JAXJOB_RUN_ID, JAXJOB_COORDINATOR, JAXJOB_NUM_PROCESSES,
    JAXJOB_PROCESS_ID, JAXJOB_OUTPUT_URI, JAXJOB_ATTEMPT; JAX's SLURM/GKE detection where it is
    absent), joins the cluster, agrees on the writer host, and trains; resumes from the latest
    committed checkpoint when the run has one. Exit codes: 0 done, 2 bad config or input,
    42 stopped by SIGTERM/SIGINT (after a checkpoint, or during start-up: restart it), 43 a peer
    host was lost, 44 the cluster did not form, 45 a storage fault (restart it), 46 training
    diverged (NaN/inf; not restarted).

    A prepare job's config (a top-level [prepare] table) writes this host's share of the
    dataset instead, and host 0 its manifest (docs/data.md, "Preparing on many hosts").
    """
    from runtime.host import boot, startup, writer

    startup.install()  # a SIGTERM before the first step is restartable (42), not 143
    from jobspec.prepare_job import is_prepare_config

    if is_prepare_config(config):  # a job.yaml with `prepare:`: each host tokenizes its share
        from runtime.commands.prepare_job import run_host

        sys.exit(run_host(config, overrides(sets)))
    cfg, source = load_config(config, (*sets, *_identity_sets(boot.BootContract.from_env())))
    from runfolder.storage import join
    from runtime.run import early_check

    # A restarted attempt resumes from the newest step: its checksums compared while the hosts
    # form the cluster (nothing is read when the run has no checkpoint, or lives on gs://).
    early_check.start(join(cfg.run.output_uri, cfg.run.id), None)
    info = boot.boot(
        timeout_s=cfg.runtime.boot_timeout_s,
        # JAX's own abort must come after our watchdog's clearer exit.
        heartbeat_timeout_s=cfg.runtime.host_loss_timeout_s + 30,
    )
    writer_index = writer.elect_writer(
        info.attempt, run_id=cfg.run.id, timeout_s=cfg.runtime.boot_timeout_s
    )
    _claim_run_and_tee_logs(cfg, info, writer_index)
    from runtime.train.loop import train

    click.echo(
        f"host {info.process_index} of {info.process_count} ({info.mode}, attempt {info.attempt}, "
        f"{info.local_device_count} local / {info.global_device_count} devices); writer is host {writer_index}"
    )
    result = train(
        cfg, source, resume="auto", max_steps=max_steps, writer_index=writer_index, reshard=reshard
    )
    boot.shutdown()
    sys.exit(result.exit_code)


def _identity_sets(contract: BootContract) -> tuple[str, ...]:
    """The `--set`s that give the run the id and output the backend set (JAXJOB_RUN_ID,
    JAXJOB_OUTPUT_URI), over the config's own."""
    identity = []
    if contract.run_id:
        identity.append(f"run.id={json.dumps(contract.run_id)}")
    if contract.output_uri:
        identity.append(f"run.output_uri={json.dumps(contract.output_uri)}")
    return tuple(identity)


def _claim_run_and_tee_logs(cfg: RunConfig, info: BootInfo, writer_index: int) -> None:
    """Claim the run for this job, then copy this host's output into the run's storage."""
    from runfolder.storage import RetryPolicy, join
    from runtime.host.hostlog import HostLogTee, log_uri
    from runtime.run import owner

    # Before the host logs go into the run: a job refused as a second owner writes nothing there.
    run_root = join(cfg.run.output_uri, cfg.run.id)
    owner.claim_run(
        run_root,
        run_id=cfg.run.id,
        is_writer=info.process_index == writer_index,
        lease_s=cfg.runtime.owner_lease_s,
        timeout_s=cfg.runtime.boot_timeout_s,
        retry=RetryPolicy(total_s=cfg.runtime.storage_retry_s),
    )
    # Logs that outlive pods: every host's output goes to the run's own storage too.
    # (an unwritable output was said by the claim already; the log itself never fails a host)
    HostLogTee(log_uri(run_root, info.attempt, info.process_index)).start()


@click.command("inspect")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(run: str, as_json: bool) -> None:
    """Summarise a run directory or gs:// URI: status, progress, losses, checkpoints."""
    from runtime.run.inspect import inspect_run, render

    report = inspect_run(run)
    if as_json:
        print_json(report)
    else:
        click.echo(render(report))


@click.command("plot")
@click.argument("runs", metavar="RUN...", nargs=-1, required=True)
@click.option(
    "-o",
    "--out",
    default=None,
    help="PNG to write: a local path (folders created) or gs://… (default: plots/curves.png in "
    "the first RUN's folder).",
)
@click.option(
    "--x",
    "x",
    type=click.Choice(["step", "tokens"]),
    default="step",
    show_default=True,
    help="The x axis: optimizer steps or training tokens.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the series as JSON; draw nothing.")
def plot_cmd(
    runs: tuple[str, ...], out: str | None, x: Literal["step", "tokens"], as_json: bool
) -> None:
    """Draw the training curves of one or several RUNs (run directories or gs:// URIs),
    overlaid in one PNG, one colour per run: train loss with the eval points as markers, eval
    loss, learning rate and tokens/s, each restart (resume) a dashed vertical line on every
    panel. Prints the path written."""
    from runtime.observe.plot import PLOT_FILE, draw, plot_series

    series = plot_series(list(runs), x)
    if as_json:
        click.echo(json.dumps(series, indent=2))
        return
    if out is None:  # beside the run's own records, not in whatever folder this shell is in
        out = f"{series['runs'][0]['run'].rstrip('/')}/{PLOT_FILE}"
    click.echo(draw(series, out))
