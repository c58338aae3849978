"""The local supervisor's entry point, `python -m launch.backends.local supervise RUN_DIR`, and
the cancel of the hosts a dead supervisor left, `... stop RUN_DIR` (orphans.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from jobspec.exit_codes import EXIT_BAD_INPUT
from launch.backends.local.orphans import stop
from launch.backends.local.supervisor import supervise


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("supervise", "stop"):
        print("usage: python -m launch.backends.local supervise|stop RUN_DIR", file=sys.stderr)
        return EXIT_BAD_INPUT
    return (supervise if argv[0] == "supervise" else stop)(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
