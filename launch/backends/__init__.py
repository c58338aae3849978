"""The backends that run a job spec: on this machine (local), a SLURM cluster (slurm) or
Kubernetes (k8s), and the table that names them.

Each backend is a package here of `render` (spec -> files, no side effects), `submit` (start and
stop) and `status` (state and logs), joined by a class that implements `launch.backend.Backend`;
its job.yaml section is in `jobspec/backends/<name>.py`. Backends are imported by name on first
use, so a backend whose module or client library is missing is an error naming it, not an
ImportError. Nothing here imports jax.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from jobspec.errors import JaxjobError
from launch.backend import Backend

# name: (module, class, pip extra that brings its client library)
BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "local": ("launch.backends.local", "LocalBackend", None),
    "slurm": ("launch.backends.slurm", "SlurmBackend", None),
    "k8s": ("launch.backends.k8s.backend", "K8sBackend", "k8s"),
}

# The checkout `launch` runs from: detached helpers (the local supervisor and hosts, the slurm
# escalation) import the same code through PYTHONPATH.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


def source_pythonpath(current: str | None) -> str:
    """PYTHONPATH with this checkout first, then `current` (the caller's PYTHONPATH, if any)."""
    return os.pathsep.join(p for p in (SOURCE_ROOT, current) if p)


def backend_class(name: str) -> type[Backend]:
    """The class of backend `name`, imported now."""
    if name not in BACKENDS:
        raise JaxjobError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")
    module, cls, extra = BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or "?"
        if module == missing or module.startswith(f"{missing}."):
            raise JaxjobError(
                f"the {name} backend is not available in this installation ({module} is missing)"
            ) from None
        hint = f"; install it with pip install 'jaxjob[{extra}]'" if extra else ""
        raise JaxjobError(
            f"the {name} backend needs the Python package {missing!r}, which is not installed{hint}"
        ) from None
    factory = getattr(mod, cls, None)
    if factory is None:
        raise JaxjobError(f"the {name} backend is not available: {module} has no {cls}")
    return factory


def get_backend(name: str, options: dict[str, Any] | None = None) -> Backend:
    return backend_class(name)(**(options or {}))


def backend_options(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """The options of `launch submit/render` (`given`: name -> value, None when not given) that
    backend `name` takes; one given to a backend that does not take it is an error."""
    takes = backend_class(name).cli_options
    wrong = [k for k, v in given.items() if v is not None and k not in takes]
    if wrong:
        flags = [f"--{k}" for k in wrong]
        takers = [n for n in BACKENDS if set(wrong) <= set(backend_class(n).cli_options)]
        verb = "applies" if len(flags) == 1 else "apply"
        raise JaxjobError(
            f"{' and '.join(flags)} {verb} only to --backend {' or '.join(takers)}, not {name}"
        )
    return {k: given.get(k) for k in takes}
