"""`--version` of both CLIs (`launch`, `runtime`): one line with the jaxjob version, the git
commit when running from a checkout, and the installed JAX version, read from package metadata
without importing jax (so `launch` stays jax-free and fast)."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

import click

_CHECKOUT = Path(__file__).resolve().parent.parent  # the folder holding jobspec/, launch/, ...


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit(root: Path = _CHECKOUT) -> str | None:
    """The short commit of the checkout `root` is in, or None if it is not one (an installed
    wheel) or git is missing or slow."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def version_line(prog: str) -> str:
    """`launch 0.1.0 (git abc1234), jax 0.10.2`; parts that are unknown are left out or said."""
    line = f"{prog} {_dist_version('jaxjob') or 'unknown'}"
    if commit := git_commit():
        line += f" (git {commit})"
    jax = _dist_version("jax")
    return line + (f", jax {jax}" if jax else ", jax not installed")


def version_option(prog: str):  # noqa: ANN201 - a click decorator
    """`--version` for a click group: print version_line(prog) and exit 0."""

    def show(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if not value or ctx.resilient_parsing:
            return
        click.echo(version_line(prog))
        ctx.exit(0)

    return click.option(
        "--version",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=show,
        help="Print the jaxjob version, its git commit (from a checkout) and JAX's, then exit.",
    )
