"""What the `runtime` command modules share: loading a run config with `--set` overrides, and
printing JSON. Only click and jobspec are imported here (the CLI starts without jax)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from jobspec.run_config import RunConfig


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def overrides(pairs: tuple[str, ...]) -> dict:
    """`--set training.target_tokens=2000000` → nested dict; values parse as TOML literals."""
    from jobspec.files.overrides import parse_sets

    return parse_sets(pairs)


def load_config(path: str, sets: tuple[str, ...] = ()) -> tuple[RunConfig, str]:
    """(validated config, source TOML text) of the run config at `path` with the `--set`s."""
    from jobspec.files.run_toml import load_run_config

    return load_run_config(path, overrides(sets))


SET_OPTION = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key, e.g. training.target_tokens=2e6.",
)
