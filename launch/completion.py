"""`launch completion bash|zsh|fish`: the shell completion script of the `launch` command, from
click's own completion support (the same script `_LAUNCH_COMPLETE=bash_source launch` prints)."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

from jobspec.errors import JaxjobError

SHELLS = ("bash", "zsh", "fish")
PROG = "launch"  # the console script name ([project.scripts] in pyproject.toml)


def completion_script(group: click.Command, shell: str, prog: str = PROG) -> str:
    """The completion script for `shell`; JaxjobError (exit 2) for any other shell."""
    cls = get_completion_class(shell) if shell in SHELLS else None
    if cls is None:
        raise JaxjobError(f"completion: unknown shell {shell!r}; use one of {', '.join(SHELLS)}")
    complete_var = f"_{prog.replace('-', '_').upper()}_COMPLETE"
    return cls(group, {}, prog, complete_var).source()


def add_completion_command(group: click.Group) -> None:
    """Register `completion SHELL` on `group` (the `launch` CLI)."""

    @group.command("completion")
    @click.argument("shell", metavar="bash|zsh|fish")
    def completion_cmd(shell: str) -> None:
        """Print the shell completion script for SHELL (bash, zsh or fish). Load it with, e.g.,
        `eval "$(launch completion bash)"` in ~/.bashrc, or save it where the shell looks for
        completions (fish: ~/.config/fish/completions/launch.fish)."""
        click.echo(completion_script(group, shell), nl=False)
