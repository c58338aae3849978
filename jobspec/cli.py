"""How both CLIs (`launch`, `runtime`) end: a user mistake is one sentence and exit 2; a
storage fault is one sentence and its restartable code (JaxjobError.exit_code)."""

from __future__ import annotations

import sys

import click

from jobspec.errors import JaxjobError
from jobspec.exit_codes import EXIT_BAD_INPUT, EXIT_INTERRUPTED


def run_group(group: click.Group, prog_name: str, argv: list[str] | None = None) -> None:
    """Run a click group; JaxjobError is caught once here, so no traceback reaches the user."""
    try:
        group.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_BAD_INPUT)
    except JaxjobError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
