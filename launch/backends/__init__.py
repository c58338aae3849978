"""The backends that run a job spec on this machine (local) or a SLURM cluster (slurm).

Each backend is a package of `render` (spec -> files, no side effects), `submit` (start and
stop) and `status` (state and logs), joined by the backend class in its `__init__`. The k8s
backend lives in the top-level `k8s` package. Nothing here imports jax.
"""

from __future__ import annotations

import os
from pathlib import Path

# The checkout `launch` runs from: detached helpers (the local supervisor and hosts, the slurm
# escalation) import the same code through PYTHONPATH.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


def source_pythonpath(current: str | None) -> str:
    """PYTHONPATH with this checkout first, then `current` (the caller's PYTHONPATH, if any)."""
    return os.pathsep.join(p for p in (SOURCE_ROOT, current) if p)
