"""`--set KEY=VALUE` and `--env NAME=VALUE` as both CLIs parse them: `runtime --set` and
`launch submit/render/plan --set/--env`. jax-free (launch imports it)."""

from __future__ import annotations

from typing import Any

import tomli_w

from jobspec.errors import ConfigError
from jobspec.files.run_toml import toml_value


def parse_sets(pairs: tuple[str, ...] | list[str], option: str = "--set") -> dict:
    """`--set training.target_tokens=2000000` → nested dict; values parse as TOML literals (a
    bare word is a string). A pair without `=` or with an empty key part is a ConfigError."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise ConfigError(f"{option} {pair!r}: use {option} section.key=value")
        parts = [p.strip() for p in parts]
        value = toml_value(raw, f"{option} {key}")
        cur = out
        *parents, leaf = parts
        for i, p in enumerate(parents):
            nxt = cur.setdefault(p, {})
            if not isinstance(nxt, dict):
                above = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"{option} {pair!r}: another {option} gives {above} a value, so it has no "
                    f"key {parts[i + 1]}; give one of them"
                )
            cur = nxt
        if isinstance(cur.get(leaf), dict):
            raise ConfigError(
                f"{option} {pair!r}: another {option} sets keys inside {key.strip()}; give one "
                "of them"
            )
        cur[leaf] = value
    return out


def parse_envs(pairs: tuple[str, ...] | list[str], option: str = "--env") -> dict[str, str]:
    """`--env NAME=value` → {NAME: value} (the last of one NAME wins); the name is checked as a
    job spec's env names are."""
    from jobspec.job_spec import ENV_NAME, RESERVED_ENV

    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"{option} {pair!r}: use {option} NAME=value")
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(
                f"{option} {pair!r}: {name!r} is not an environment variable name "
                "(letters, digits and _, not starting with a digit)"
            )
        if name.startswith(RESERVED_ENV):
            raise ConfigError(f"{option} {pair!r}: {name} is set by jaxjob itself; remove it")
        out[name] = value
    return out


def flat_sets(sets: dict, prefix: str = "") -> dict[str, Any]:
    """A nested `parse_sets` dict as {dotted.key: value}."""
    out: dict[str, Any] = {}
    for k, v in sets.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_sets(v, f"{key}."))
        else:
            out[key] = v
    return out


def toml_literal(value: Any) -> str:
    """`value` as it would be written after `key = ` in TOML."""
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def sets_header(sets: dict) -> str:
    """TOML comment lines recording the `--set` overrides merged into a cfg.toml."""
    if not sets:
        return ""
    lines = [f"#   {k} = {toml_literal(v)}" for k, v in flat_sets(sets).items()]
    return "# overridden at submit (launch --set):\n" + "\n".join(lines) + "\n"
