"""`python -m runtime`: the `runtime` CLI."""

from runtime.commands.cli import main

if __name__ == "__main__":
    main()
