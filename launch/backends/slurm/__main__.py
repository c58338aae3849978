"""The detached cancel escalation: `python -m launch.backends.slurm escalate HANDLE GRACE_S`."""

from __future__ import annotations

import json
import sys

from jobspec.exit_codes import EXIT_BAD_INPUT
from launch.backend import Handle
from launch.backends.slurm.submit import escalate


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "escalate":
        print(
            "usage: python -m launch.backends.slurm escalate HANDLE_JSON GRACE_S", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    escalate(Handle("slurm", json.loads(argv[1])), float(argv[2]), poll_s=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
