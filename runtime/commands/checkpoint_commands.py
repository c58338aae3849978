"""The `runtime` commands on a run's saved checkpoints: `checkpoints list|verify|rollback`,
`eval checkpoint`, `sample checkpoint`, `export hf` and `import hf`.

Only click is imported here; the code of each (checkpoints.py, offline.py, hf.py: Orbax, jax)
loads when its command runs.
"""

from __future__ import annotations

import sys

import click

from jobspec.errors import ConfigError
from jobspec.exit_codes import EXIT_FAILED
from runtime.commands.common import print_json

CHECKPOINT_OPTION = click.option(
    "--checkpoint", "selector", default="latest", show_default=True, help="latest, best or a step."
)


@click.group("checkpoints")
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
        print_json(out)
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
        print_json(report)
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
        print_json(out)
        return
    for s in out["discarded"]:
        click.echo(f"discarded checkpoint {s} (newer than --to-step {out['step']})")
    click.echo(f"{out['run']}: latest checkpoint is now {out['step']}")


@click.group("eval")
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
        print_json(out)
    else:
        for r in out["results"]:
            click.echo(
                f"step {out['step']} | {r['name']} | loss: {r['loss']:.4f} | tokens: {r['token_count']:,.0f}"
            )
        click.echo(f"wrote {out['path']}")


@click.group("sample")
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
    run: str,
    selector: str,
    prompt_ids: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    as_json: bool,
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
        print_json(out)
    else:
        click.echo(",".join(str(t) for t in out["new_ids"]))
        if out.get("text") is not None:
            click.echo(repr(out["text"]))
        click.echo(f"wrote {out['path']}")


@click.group("export")
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
        print_json(result)
    else:
        click.echo(f"exported step {result['step']} of {result['run_id']} to {out}")


@click.group("import")
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
        print_json(result)
    else:
        click.echo(f"imported {path} as checkpoint 0 of {result['out']}")
