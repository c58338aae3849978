"""Which optional extra of the jaxjob package a command needs, said in one sentence when it is missing."""

from __future__ import annotations

import importlib.util

from jobspec.errors import ConfigError


def has_module(name: str) -> bool:
    """Whether `name` can be imported, without importing it (a module blocked with
    `sys.modules[name] = None` counts as missing, as `import` would find it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not there, or a blocked module
        return False


def require(modules: dict[str, str], extra: str, purpose: str) -> None:
    """A ConfigError (exit 2) naming the extra to install when any of `modules` (import name ->
    the package that provides it) is missing; `purpose` says what needs them, e.g. "runtime
    plan for tpu-v5p-8"."""
    missing = [pkg for mod, pkg in modules.items() if not has_module(mod)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(
            f"{purpose} needs {' and '.join(dict.fromkeys(missing))}, which {verb} not installed; "
            f"install the {extra} extra: pip install 'jaxjob[{extra}]'"
        )
