"""JAX's persistent compilation cache, on by default: per user on one machine, on the run's
storage for a job of many hosts.

A run's programs compile the same way each time a config is run again, so the second start of
a run (a resume, a rerun of the main job, `eval`/`sample` of its checkpoints) loads them from
disk instead of compiling. On one machine the cache is `$XDG_CACHE_HOME/jaxjob/xla`
(`~/.cache/jaxjob/xla`), capped at CACHE_BYTES with least-recently-used eviction; the cap's file
lock also keeps the hosts of a local job, which share the folder, from reading an entry another
is writing. A job of many hosts (Kubernetes pods, SLURM nodes) keeps it in the run's own
directory instead, `<run>/compile-cache` (gs:// too): a restarted pod has an empty home, but it
finds the run. JAX writes entries from process 0 only and every host reads them; an object
store has no file lock, so that cache is not capped (it holds one run's programs and goes with
the run).

`JAX_COMPILATION_CACHE_DIR` set by the user wins. `JAXJOB_COMPILATION_CACHE` chooses: `0` off,
`user` the per-user folder, `run` the run's directory (also for one host); unset (or `1`) the
default above. `configure` runs before jax is imported (JAX reads these variables once);
`for_run` moves the cache to the run's directory once the run is known, before its first
compile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import MutableMapping
from pathlib import Path

from jobspec.extras import has_module
from jobspec.run_config import is_remote
from runfolder.storage import join

CACHE_BYTES = 4 << 30
ENV = "JAXJOB_COMPILATION_CACHE"
RUN_FOLDER = "compile-cache"  # under the run's directory
_CHOICES = ("0", "1", "user", "run")


def default_dir(env: MutableMapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxjob" / "xla"


def choice(env: MutableMapping[str, str] | None = None, *, strict: bool = True) -> str:
    """`0`, `1` (the default), `user` or `run`: what JAXJOB_COMPILATION_CACHE asks for. A value
    it does not know is refused in one sentence (`strict`, where a run starts) or taken as the
    default (before the CLI can say so)."""
    env = os.environ if env is None else env
    value = env.get(ENV, "1").strip().lower() or "1"
    if value not in _CHOICES:
        if not strict:
            return "1"
        from jobspec.errors import ConfigError

        raise ConfigError(
            f"{ENV}={env.get(ENV)!r} is not one of 0 (off), 1 (the default), user (the per-user "
            "folder) or run (the run's directory); set one of them, or unset it"
        )
    return value


def configure(env: MutableMapping[str, str] | None = None) -> str | None:
    """Point JAX at the per-user cache unless the user chose a folder or turned it off; the
    folder in force (a run's own comes later, from `for_run`)."""
    env = os.environ if env is None else env
    if choice(env, strict=False) == "0":
        return None
    if "JAX_COMPILATION_CACHE_DIR" in env:
        return env["JAX_COMPILATION_CACHE_DIR"] or None
    # Without filelock (JAX's eviction needs it) no cache: unlocked entries could be read torn.
    if not has_module("filelock"):
        return None
    env["JAX_COMPILATION_CACHE_DIR"] = str(default_dir(env))
    env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(CACHE_BYTES))
    return env["JAX_COMPILATION_CACHE_DIR"]


def run_dir_wanted(process_count: int, env: MutableMapping[str, str] | None = None) -> bool:
    """Whether this run's cache belongs in its own directory: asked for (`run`), or by default
    for a job of many hosts; never over a folder the user set or a cache turned off."""
    env = os.environ if env is None else env
    mode = choice(env)
    if mode in ("0", "user") or env.get("JAX_COMPILATION_CACHE_DIR", "") != str(default_dir(env)):
        return False  # off, per user, or the user's own folder (configure() set ours)
    return mode == "run" or process_count > 1


def for_run(
    run_root: str, process_count: int, env: MutableMapping[str, str] | None = None
) -> str | None:
    """Move JAX's cache to `<run_root>/compile-cache` when `run_dir_wanted`; the folder in
    force. Call it before the run's first compile (JAX opens its cache then)."""
    env = os.environ if env is None else env
    if not run_dir_wanted(process_count, env):
        return env.get("JAX_COMPILATION_CACHE_DIR") or None
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    folder = join(run_root, RUN_FOLDER)
    if is_remote(folder):
        # JAX's eviction locks a file beside the entries, which an object store cannot hold.
        jax.config.update("jax_compilation_cache_max_size", -1)
    cc.set_cache_dir(folder)
    cc.reset_cache()  # a cache opened by an earlier compile is opened again, here
    env["JAX_COMPILATION_CACHE_DIR"] = folder  # what this process's children inherit
    return folder


# Persistent-cache hits by thread, so a compile can tell whether XLA's program came from disk.
_hits: dict[int, int] = {}
_listening = False
_lock = threading.Lock()


def count_hits() -> None:
    """Count JAX's persistent-cache hits from now on (once per process)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    from jax import monitoring

    def on_event(event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            key = threading.get_ident()
            _hits[key] = _hits.get(key, 0) + 1

    monitoring.register_event_listener(on_event)


def hits_on_this_thread() -> int:
    return _hits.get(threading.get_ident(), 0)
