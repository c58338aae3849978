"""`runtime data prepare|tokenizer|merge|check`: the click commands of the dataset side.

Only click is imported here; the prepare side (runtime/data/prepare/) and the manifest checks
(runtime/data/manifest.py) load when a command runs.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

import click

from jobspec.errors import ConfigError
from runtime.commands.common import print_json

if TYPE_CHECKING:
    from runtime.data.manifest import Manifest
    from runtime.data.prepare.build import ShareReport


@click.group("data")
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
    paths: tuple[str, ...],
    inputs: tuple[str, ...],
    tokenizer: str,
    out: str,
    text_field: str,
    val_fraction: float,
    max_bytes: int | None,
    workers: int | None,
    share: str | None,
    part_size: str,
    fmt: Literal["text", "rollouts"],
    progress: bool | None,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Tokenize text/JSONL/parquet files (or rollout JSONL) into token shards and a manifest.json.

    The inputs are every --input and every PATH argument: `--input data/*.jsonl` unquoted works,
    as the shell's expansion arrives as one --input and the rest as PATHs.

    The dataset is the same for any --workers and any number of --shard hosts. With --shard I/N
    each host writes its share of the parts (a share run again skips what it finished), and
    `runtime data merge OUT` writes the manifest once every share is done.

    A non-empty --out that is not a jaxjob dataset is refused unless --overwrite. SIGTERM ends
    it with one line and exit 42 (run it again: the dataset there, if any, is whole).

    Rollout lines: {"prompt_ids" | "prompt", "completion_ids" | "completion",
    "advantage" | "advantages", "old_logprobs"}; see docs/data.md, "RL rollouts".
    """
    from runtime.data.prepare.stop import SigtermStop

    with SigtermStop() as stop:  # first: a SIGTERM from here on is one line and exit 42
        from runtime.data.prepare.build import prepare_dataset, prepare_share

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


def _report_share(rep: ShareReport, which: tuple[int, int], out: str, as_json: bool) -> None:
    if as_json:
        print_json(
            {"plan": rep.plan, "share": f"{which[0]}/{which[1]}", "parts": rep.parts,
             "written": rep.written, "skipped": rep.skipped}
        )  # fmt: skip
        return
    click.echo(
        f"share {which[0]}/{which[1]} of plan {rep.plan}: wrote {len(rep.written)} of its "
        f"parts, {len(rep.skipped)} were already done ({rep.parts} parts in all); when "
        f"every share is done: runtime data merge {out}"
    )


def _report_manifest(m: Manifest, out: str, as_json: bool) -> None:
    from runtime.data.manifest import manifest_uri

    if as_json:
        print_json(json.loads(m.model_dump_json()))
        return
    what = ""
    if m.layout == "rollouts":
        what = f", {m.total_documents} rollouts with {', '.join(m.field_names)}"
    click.echo(
        f"wrote {manifest_uri(out)} (tokenizer {m.tokenizer.id}, fingerprint "
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
def data_tokenizer(
    paths: tuple[str, ...],
    inputs: tuple[str, ...],
    vocab_size: int,
    out: str,
    text_field: str,
    max_bytes: int | None,
) -> None:
    """Train a byte-level BPE tokenizer on the inputs and save its tokenizer.json.

    The inputs are every --input and every PATH argument (an unquoted glob works as in `data
    prepare`). Its end-of-document token is <|endoftext|>; pass the file to `data prepare
    --tokenizer`."""
    from runfolder.storage import url_to_fs
    from runtime.data.prepare.bpe import train_bpe_on
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
    from runtime.data.prepare.build import merge_shares

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
        print_json(summary)
    else:
        click.echo(f"{manifest}: ok")
        for k, v in summary.items():
            click.echo(f"  {k:<16} {v}")
