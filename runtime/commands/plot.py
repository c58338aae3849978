"""`runtime plot`: training curves of runs as a PNG (or their series as JSON).

Only click is imported here; jax and matplotlib load when the command runs."""

from __future__ import annotations

import json
from typing import Literal

import click


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
