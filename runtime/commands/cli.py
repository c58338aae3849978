"""The `runtime` command. User mistakes end in one sentence on stderr and exit 2, never a traceback.

jax is imported lazily, so `config schema|check` and `data check` answer quickly.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from jobspec.cli import run_group
from jobspec.errors import ConfigError
from jobspec.exit_codes import EXIT_FAILED

if TYPE_CHECKING:
    from jobspec.run_config import RunConfig
    from runtime.host.boot import BootContract, BootInfo


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _overrides(pairs: tuple[str, ...]) -> dict:
    """`--set training.target_tokens=2000000` → nested dict; values parse as TOML literals."""
    from jobspec.load import toml_value

    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: use --set section.key=value")
        value = toml_value(raw, f"--set {key}")  # a bare word is a string
        cur = out
        *parents, leaf = key.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[leaf] = value
    return out


def _load(path: str, sets: tuple[str, ...] = ()):
    from jobspec.load import load_run_config

    return load_run_config(path, _overrides(sets))


SET_OPTION = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key, e.g. training.target_tokens=2e6.",
)


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
CHECKPOINT_OPTION = click.option(
    "--checkpoint", "selector", default="latest", show_default=True, help="latest, best or a step."
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """jaxjob runtime: the program every host of a job runs."""


@cli.command("local")
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
    cfg, source = _load(config, (*sets, *_profile_sets(profile_steps)))
    from runtime.host import platform

    platform.start_backend()  # beside the imports below (one process: no cluster to form first)
    from jobspec.storage import join

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
    from jobspec.run_status import closing_line as line

    return line(
        str(summary.get("run_id")),
        str(summary.get("status")),
        run_dir,
        step=summary.get("steps", 0),
        total_steps=total_steps,
        loss=summary.get("final_loss"),
        best_eval=summary.get("best_eval"),
    )


@cli.command("worker")
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
    dataset instead, and host 0 its manifest (README "Preparing on many hosts").
    """
    from runtime.host import boot, startup, writer

    startup.install()  # a SIGTERM before the first step is restartable (42), not 143
    from jobspec.prepare_job import is_prepare_config

    if is_prepare_config(config):  # a job.yaml with `prepare:`: each host tokenizes its share
        from runtime.commands.prepare_job import run_host

        sys.exit(run_host(config, _overrides(sets)))
    cfg, source = _load(config, (*sets, *_identity_sets(boot.BootContract.from_env())))
    from jobspec.storage import join
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
    from jobspec.storage import RetryPolicy, join
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


@cli.group("config")
def config_group() -> None:
    """Check run configs and print their schema."""


@config_group.command("check")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@SET_OPTION
def config_check(config: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Validate CONFIG and show what it resolves to: sizes, FLOPs, tokens per step."""
    from jobspec.load import resolved_dict
    from runtime.model.flops import flops_per_token, parameter_counts

    cfg, _ = _load(config, sets)
    from runtime.data.eval_rows import check_evals_of_config

    # An eval whose split gives no row is an error (exit 2) when a local manifest says so.
    for small in check_evals_of_config(cfg, remote=False) or []:
        click.echo(f"warning: {small['message']}", err=True)
    t = cfg.training
    info = {
        "config": config,
        "resolved": resolved_dict(cfg),
        "parameters": parameter_counts(cfg.model),
        "flops_per_token": flops_per_token(cfg.model, t.seq_len),
        "tokens_per_step": t.tokens_per_step,
        "total_steps": t.total_steps,
        "mesh_devices": cfg.mesh.size,
        "run_dir": f"{cfg.run.output_uri.rstrip('/')}/{cfg.run.id}",
    }
    if as_json:
        _print_json(info)
        return
    p = info["parameters"]
    click.echo(f"{config}: valid")
    click.echo(f"  run dir          {info['run_dir']}")
    click.echo(f"  parameters       {p['total']:,} ({p['non_embedding']:,} without the embedding)")
    click.echo(
        f"  FLOPs/token      {info['flops_per_token']['total']:,.0f} (6N + attention, no causal halving)"
    )
    click.echo(
        f"  tokens/step      {t.tokens_per_step:,} = {t.global_batch_size} x {t.gradient_accumulation_steps} x {t.seq_len}"
        " (global_batch_size x gradient_accumulation_steps x seq_len)"
    )
    click.echo(f"  steps            {t.total_steps:,} to reach {t.target_tokens:,} tokens")
    click.echo(
        f"  mesh             slices={cfg.mesh.slices} data={cfg.mesh.data} expert={cfg.mesh.expert} fsdp={cfg.mesh.fsdp} context={cfg.mesh.context} tensor={cfg.mesh.tensor} ({cfg.mesh.size} device{'' if cfg.mesh.size == 1 else 's'})"
    )


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the run config (for editors)."""
    from jobspec.load import run_config_schema

    _print_json(run_config_schema())


@cli.group("data")
def data_group() -> None:
    """Prepare and check token manifests."""


def _size(value: str | None) -> int | None:
    """'128M', '64K', '1G' or a byte count (read as job.yaml's prepare.part_size is)."""
    from jobspec.prepare_job import size_bytes

    if value is None:
        return None
    try:
        return size_bytes(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a size; use e.g. 64M, 512K or 1G") from None


def _share(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not I/N; give this host's share as e.g. 3/8 (0 <= I < N)"
        ) from None
    if not (n >= 1 and 0 <= i < n):
        raise click.BadParameter(f"share {value} does not exist; use I/N with 0 <= I < N")
    return i, n


def _inputs(inputs: tuple[str, ...], paths: tuple[str, ...]) -> list[str]:
    """--input values, then the paths given as arguments (what the shell expands an unquoted
    glob into: `--input pq/*.parquet` arrives as `--input pq/a.parquet pq/b.parquet …`)."""
    given = [*inputs, *paths]
    if not given:
        raise click.UsageError(
            "no input given; pass files or globs with --input, e.g. --input 'data/*.jsonl'"
        )
    return given


INPUT_PATHS = click.argument("paths", nargs=-1, metavar="[PATH]...")
INPUT_HELP = (
    "Repeatable; the paths that follow it are inputs too, so an unquoted glob the shell "
    "expanded works (quote a glob to expand it here, as gs:// and '**' globs need). PATH "
    "arguments are inputs with or without --input."
)


@data_group.command("prepare")
@INPUT_PATHS
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="PATH",
    help="File or glob, local or gs:// ('{stdlib}' = Python's stdlib): *.parquet, "
    f"*.jsonl[.gz|.zst], or any other file as one document. {INPUT_HELP}",
)
@click.option(
    "--tokenizer", default="byte", show_default=True, help="'byte' or a path/URI of tokenizer.json."
)
@click.option("--out", required=True, help="Output directory (local or gs://).")
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="The JSONL key or parquet column holding each document's text.",
)
@click.option("--val-fraction", default=0.05, show_default=True, type=float)
@click.option(
    "--max-bytes", default=None, type=int, help="Stop reading inputs after this many bytes."
)
@click.option(
    "--workers",
    default=None,
    type=click.IntRange(min=1),
    help="Processes tokenizing parts at once. [default: the cores]",
)
@click.option(
    "--shard",
    "share",
    default=None,
    help="I/N: write only this host's share of the parts (then `runtime data merge OUT`).",
)
@click.option(
    "--part-size",
    default="128M",
    show_default=True,
    help="Input bytes per part, the unit of parallel work (part of the dataset's identity).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "rollouts"]),
    default="text",
    show_default=True,
    help="text: documents into a token stream; rollouts: RL/SFT rollout JSONL, one per row.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bar on stderr (bytes, documents, tokens/s, ETA). [default: on a terminal]",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Prepare into a folder that holds other files than a jaxjob dataset: they are kept, "
    "a manifest.json there is replaced.",
)
@click.option("--json", "as_json", is_flag=True)
def data_prepare(
    paths, inputs, tokenizer, out, text_field, val_fraction, max_bytes, workers, share, part_size,
    fmt, progress, overwrite, as_json,
) -> None:  # fmt: skip
    """Tokenize text/JSONL/parquet files (or rollout JSONL) into token shards and a manifest.json.

    The inputs are every --input and every PATH argument: `--input data/*.jsonl` unquoted works,
    as the shell's expansion arrives as one --input and the rest as PATHs.

    The dataset is the same for any --workers and any number of --shard hosts. With --shard I/N
    each host writes its share of the parts (a share run again skips what it finished), and
    `runtime data merge OUT` writes the manifest once every share is done.

    A non-empty --out that is not a jaxjob dataset is refused unless --overwrite. SIGTERM ends
    it with one line and exit 42 (run it again: the dataset there, if any, is whole).

    Rollout lines: {"prompt_ids" | "prompt", "completion_ids" | "completion",
    "advantage" | "advantages", "old_logprobs"}; see the README's "RL rollouts".
    """
    from runtime.data.stop import SigtermStop

    with SigtermStop() as stop:  # first: a SIGTERM from here on is one line and exit 42
        from runtime.data.prepare import prepare_dataset, prepare_share

        inputs = _inputs(inputs, paths)
        common = dict(
            val_fraction=val_fraction, format=fmt, progress=progress, text_field=text_field,
            workers=workers, part_bytes=_size(part_size), overwrite=overwrite,
        )  # fmt: skip
        which = _share(share)
        if which is None:
            stop.arm(
                f"preparing {out}; run it again (a dataset is swapped in only once complete, so "
                "the one there, if any, is whole)"
            )
            m = prepare_dataset(inputs, tokenizer, out, max_bytes=max_bytes, **common)
        else:
            if max_bytes is not None:
                raise click.BadParameter(
                    "--max-bytes takes documents in input order until the budget is spent, which "
                    "one host cannot know for its share; prepare a sample on one host without "
                    "--shard",
                    param_hint="--max-bytes",
                )
            stop.arm(
                f"preparing share {which[0]}/{which[1]} of {out}; run it again to write the "
                "parts it had not committed (those it had are kept)"
            )
            rep = prepare_share(inputs, tokenizer, out, which, **common)
    if which is None:
        _report_manifest(m, out, as_json)
    else:
        _report_share(rep, which, out, as_json)


def _report_share(rep, which: tuple[int, int], out: str, as_json: bool) -> None:
    if as_json:
        _print_json(
            {"plan": rep.plan, "share": f"{which[0]}/{which[1]}", "parts": rep.parts,
             "written": rep.written, "skipped": rep.skipped}
        )  # fmt: skip
        return
    click.echo(
        f"share {which[0]}/{which[1]} of plan {rep.plan}: wrote {len(rep.written)} of its "
        f"parts, {len(rep.skipped)} were already done ({rep.parts} parts in all); when "
        f"every share is done: runtime data merge {out}"
    )


def _report_manifest(m, out: str, as_json: bool) -> None:
    if as_json:
        _print_json(json.loads(m.model_dump_json()))
        return
    what = ""
    if m.layout == "rollouts":
        what = f", {m.total_documents} rollouts with {', '.join(m.field_names)}"
    click.echo(
        f"wrote {out.rstrip('/')}/manifest.json (tokenizer {m.tokenizer.id}, fingerprint "
        f"{m.fingerprint}, {m.total_tokens} tokens in {m.total_documents} documents{what})"
    )


@data_group.command("tokenizer")
@INPUT_PATHS
@click.option(
    "--input", "inputs", multiple=True, metavar="PATH", help=f"File or glob. {INPUT_HELP}"
)
@click.option("--vocab-size", default=8192, show_default=True, type=click.IntRange(min=257))
@click.option("--out", required=True, help="Where to write tokenizer.json (local or gs://).")
@click.option("--text-field", default="text", show_default=True)
@click.option("--max-bytes", default=None, type=int, help="Train on at most this many bytes.")
def data_tokenizer(paths, inputs, vocab_size, out, text_field, max_bytes) -> None:
    """Train a byte-level BPE tokenizer on the inputs and save its tokenizer.json.

    The inputs are every --input and every PATH argument (an unquoted glob works as in `data
    prepare`). Its end-of-document token is <|endoftext|>; pass the file to `data prepare
    --tokenizer`."""
    from jobspec.storage import url_to_fs
    from runtime.data.bpe import train_bpe_on
    from runtime.data.tokenizer import load_tokenizer

    inputs = _inputs(inputs, paths)
    fs, path = url_to_fs(out)
    if fs.isdir(path):  # said before the training, not after it
        raise ConfigError(
            f"--out {out} is a folder; --out names the file to write, e.g. "
            f"--out {out.rstrip('/')}/tokenizer.json"
        )
    train_bpe_on(inputs, vocab_size, out, text_field=text_field, max_bytes=max_bytes)
    # A small corpus stops merging before the asked size: say what was made.
    made = load_tokenizer(out).vocab_size
    click.echo(
        f"wrote {out} (byte-level BPE, vocab {made} of {vocab_size} asked, eos <|endoftext|>)"
    )


@data_group.command("merge")
@click.argument("out")
@click.option("--plan", default=None, help="The plan id to merge when OUT holds several.")
@click.option("--json", "as_json", is_flag=True)
def data_merge(out: str, plan: str | None, as_json: bool) -> None:
    """Write OUT/manifest.json over the parts every `data prepare --shard I/N` host wrote.

    Refused, naming the missing parts, until every share is complete."""
    from runtime.data.prepare import merge_shares

    _report_manifest(merge_shares(out, plan), out, as_json)


@data_group.command("check")
@click.argument("manifest")
@click.option("--deep", is_flag=True, help="Also verify every file's sha256 and token ids.")
@click.option("--json", "as_json", is_flag=True)
def data_check(manifest: str, deep: bool, as_json: bool) -> None:
    """Validate a manifest, its files' sizes and sampled checksums, and its document offsets."""
    from runtime.data.manifest import check_manifest

    summary = check_manifest(manifest, deep=deep)
    if as_json:
        _print_json(summary)
    else:
        click.echo(f"{manifest}: ok")
        for k, v in summary.items():
            click.echo(f"  {k:<16} {v}")


@cli.command("preflight")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@SET_OPTION
def preflight_cmd(config: str, as_json: bool, sets: tuple[str, ...]) -> None:
    """Check devices, mesh fit, data, output and memory before a run."""
    from runtime.commands.preflight import preflight

    cfg, _ = _load(config, sets)
    report = preflight(cfg)
    if as_json:
        _print_json(report)
    else:
        for check in report["checks"]:
            mark = "ok  " if check["ok"] else "FAIL"
            click.echo(f"{mark} {check['name']:<10} {check['detail']}")
    if not all(c["ok"] for c in report["checks"]):
        sys.exit(EXIT_FAILED)


@cli.command("plan")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--accelerator", required=True, help="Catalogue name, e.g. tpu-v5p-256, h100-80gb.")
@click.option("--hosts", type=int, default=None, help="Hosts (GPU nodes); TPU: fixed by the slice.")
@click.option("--slices", type=int, default=1, show_default=True, help="TPU slices.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--fit",
    is_flag=True,
    help="Search remat, loss_chunk_size, gradient accumulation (within the step's global batch) "
    "and attention: compile the candidates, keep those that fit with 5% headroom, pick the best "
    "predicted tokens/s.",
)
@click.option(
    "-o",
    "--out",
    "overlay",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --fit: write the pick as a run config that includes CONFIG (runtime local OUT).",
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=None, help="With --fit: compiles at once."
)
@SET_OPTION
def plan_cmd(config, accelerator, hosts, slices, as_json, fit, overlay, jobs, sets) -> None:
    """Compile CONFIG's train step for an accelerator this machine need not have; report memory
    per chip, predicted step time, FLOPs and collectives. Exits 0 fits, 1 does not fit (report
    printed; with --fit: no candidate fits), 2 bad input."""
    from runtime.commands.plan import run_fit, run_plan
    from runtime.plan.environment import prepare_environment

    if (overlay or jobs) and not fit:
        raise ConfigError("--out and --jobs go with --fit (runtime plan CFG --accelerator A --fit)")
    prepare_environment(accelerator)
    cfg, _ = _load(config, sets)
    if fit:
        run_fit(cfg, config, accelerator, hosts, slices, as_json, overlay, jobs)
    else:
        run_plan(cfg, accelerator, hosts, slices, as_json)


@cli.command("inspect")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(run: str, as_json: bool) -> None:
    """Summarise a run directory or gs:// URI: status, progress, losses, checkpoints."""
    from runtime.run.inspect import inspect_run, render

    report = inspect_run(run)
    if as_json:
        _print_json(report)
    else:
        click.echo(render(report))


from runtime.commands.plot import plot_cmd  # noqa: E402  (click only; matplotlib loads on use)

cli.add_command(plot_cmd)


@cli.group("checkpoints")
def checkpoints_group() -> None:
    """List, verify and roll back a run's checkpoints (local path or gs://)."""


@checkpoints_group.command("list")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True)
def checkpoints_list_cmd(run: str, as_json: bool) -> None:
    """The committed checkpoints of RUN, as its index has them (no array is read)."""
    from runtime.commands.checkpoints import list_checkpoints

    out = list_checkpoints(run)
    if as_json:
        _print_json(out)
        return
    for e in out["checkpoints"]:
        tags = [t for t, s in (("latest", out["latest"]), ("best", out["best"])) if s == e["step"]]
        metrics = " ".join(f"{k} {v:.4f}" for k, v in (e.get("metrics") or {}).items())
        bad = f"  UNREADABLE: {e['unreadable']}" if e.get("unreadable") else ""
        click.echo(
            f"step {e['step']}  {e.get('time', '-')}  {metrics}".rstrip()
            + (f"  ({', '.join(tags)})" if tags else "")
            + bad
        )
    if not out["checkpoints"]:
        click.echo(f"{out['run']}: no committed checkpoint")


@checkpoints_group.command("verify")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True)
def checkpoints_verify_cmd(run: str, as_json: bool) -> None:
    """Compare every indexed checkpoint of RUN with the checksums recorded when it was saved,
    and read it in full (params, optimizer state, meta), with no config needed. Exits 0 all
    intact and readable, 1 some missing, damaged or unreadable, 2 bad input."""
    from runtime.commands.checkpoints import describe, verify_checkpoints

    report = verify_checkpoints(run)
    if as_json:
        _print_json(report)
    else:
        for line in describe(report):
            click.echo(line)
    if not report["ok"]:
        sys.exit(EXIT_FAILED)


@checkpoints_group.command("rollback")
@click.argument("run")
@click.option(
    "--to-step", "step", type=click.IntRange(min=0), required=True, help="A committed step."
)
@click.option("--json", "as_json", is_flag=True)
def checkpoints_rollback_cmd(run: str, step: int, as_json: bool) -> None:
    """Discard RUN's checkpoints after --to-step (read in full first), so the next resume, a
    launched job's included, continues from it. Only while nothing is running on RUN."""
    from runtime.commands.checkpoints import rollback

    out = rollback(run, step)
    if as_json:
        _print_json(out)
        return
    for s in out["discarded"]:
        click.echo(f"discarded checkpoint {s} (newer than --to-step {out['step']})")
    click.echo(f"{out['run']}: latest checkpoint is now {out['step']}")


@cli.group("eval")
def eval_group() -> None:
    """Evaluate a checkpoint."""


@eval_group.command("checkpoint")
@click.argument("run")
@CHECKPOINT_OPTION
@click.option("--json", "as_json", is_flag=True)
def eval_checkpoint_cmd(run: str, selector: str, as_json: bool) -> None:
    """Run the configured evals on one checkpoint of RUN; writes evals/<step>.json."""
    from runtime.commands.offline import eval_checkpoint

    out = eval_checkpoint(run, selector)
    if as_json:
        _print_json(out)
    else:
        for r in out["results"]:
            click.echo(
                f"step {out['step']} | {r['name']} | loss: {r['loss']:.4f} | tokens: {r['token_count']:,.0f}"
            )
        click.echo(f"wrote {out['path']}")


@cli.group("sample")
def sample_group() -> None:
    """Generate tokens from a checkpoint."""


@sample_group.command("checkpoint")
@click.argument("run")
@CHECKPOINT_OPTION
@click.option("--prompt-ids", required=True, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", default=16, show_default=True, type=int)
@click.option("--temperature", default=1.0, show_default=True, type=float)
@click.option(
    "--top-k", default=None, type=int, help="Sample among the k most likely tokens; 1 = greedy."
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True)
def sample_checkpoint_cmd(
    run, selector, prompt_ids, max_new_tokens, temperature, top_k, seed, as_json
) -> None:
    """KV-cache decode from one checkpoint of RUN; writes samples/<step>-<n>.json."""
    try:
        ids = [int(x) for x in prompt_ids.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(
            f"--prompt-ids {prompt_ids!r}: use comma-separated integers, e.g. 1,2,3"
        ) from None
    # Imported once the arguments are good: a mistyped --prompt-ids is refused before JAX loads.
    from runtime.commands.offline import sample_checkpoint

    out = sample_checkpoint(
        run,
        selector,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )
    if as_json:
        _print_json(out)
    else:
        click.echo(",".join(str(t) for t in out["new_ids"]))
        if out.get("text") is not None:
            click.echo(repr(out["text"]))
        click.echo(f"wrote {out['path']}")


@cli.group("export")
def export_group() -> None:
    """Write a checkpoint in another format."""


@export_group.command("hf")
@click.argument("run")
@CHECKPOINT_OPTION
@click.option("--out", required=True, help="Directory for config.json and *.safetensors.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Export into a folder jaxjob did not export to: its config.json and model*.safetensors "
    "(shards, index) are replaced, its other files kept.",
)
@click.option("--json", "as_json", is_flag=True)
def export_hf_cmd(run: str, selector: str, out: str, overwrite: bool, as_json: bool) -> None:
    """Export one checkpoint of RUN as a Hugging Face model dir (transformers loads it).

    The folder is written beside --out and swapped in whole: a kill at any moment leaves the old
    folder or the new one. A non-empty --out that is not an earlier export is refused unless
    --overwrite."""
    from runtime.commands.hf import export_checkpoint

    result = export_checkpoint(run, selector, out, overwrite=overwrite)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"exported step {result['step']} of {result['run_id']} to {out}")


@cli.group("import")
def import_group() -> None:
    """Turn another format into a run directory."""


@import_group.command("hf")
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--out", "out", required=True, help="New run directory (its name is the run id).")
@click.option(
    "--config",
    default=None,
    type=click.Path(dir_okay=False),
    help="Run TOML for the other sections (and --resume training); model keys default to PATH's.",
)
@click.option("--json", "as_json", is_flag=True)
def import_hf_cmd(path: str, out: str, config: str | None, as_json: bool) -> None:
    """Import the HF model dir PATH as checkpoint 0 of a run that eval/sample/export read."""
    from runtime.commands.hf import import_to_run

    result = import_to_run(path, out, config=config)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"imported {path} as checkpoint 0 of {result['out']}")


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
