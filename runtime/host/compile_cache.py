"""JAX's persistent compilation cache, on by default: per user, on this machine.

A run's programs compile the same way each time a config is run again, so the second start of
a run (a resume, a rerun of the main job, `eval`/`sample` of its checkpoints) loads them from
disk instead of compiling. The cache is `$XDG_CACHE_HOME/jaxjob/xla` (`~/.cache/jaxjob/xla`),
capped at CACHE_BYTES with least-recently-used eviction; the cap's file lock also keeps the
hosts of a local job, which share the folder, from reading an entry another is writing.
`JAX_COMPILATION_CACHE_DIR` set by the user wins; `JAXJOB_COMPILATION_CACHE=0` turns it off.
Set before jax is imported (it reads these variables once).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from jobspec.extras import has_module

CACHE_BYTES = 4 << 30


def default_dir(env: MutableMapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxjob" / "xla"


def configure(env: MutableMapping[str, str] | None = None) -> str | None:
    """Point JAX at the cache unless the user chose one or turned it off; the folder in force."""
    env = os.environ if env is None else env
    if env.get("JAXJOB_COMPILATION_CACHE", "1") == "0":
        return None
    if "JAX_COMPILATION_CACHE_DIR" in env:
        return env["JAX_COMPILATION_CACHE_DIR"] or None
    # Without filelock (JAX's eviction needs it) no cache: unlocked entries could be read torn.
    if not has_module("filelock"):
        return None
    env["JAX_COMPILATION_CACHE_DIR"] = str(default_dir(env))
    env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(CACHE_BYTES))
    return env["JAX_COMPILATION_CACHE_DIR"]
