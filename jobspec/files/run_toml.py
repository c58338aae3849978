"""The only code that parses run-config TOML: load, validate with field paths, serialise."""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from jobspec.errors import ConfigError
from jobspec.files.nesting import deepest_key, deepest_line
from jobspec.run_config import RunConfig

# A run config is a page of TOML; these bounds keep a broken or hostile file (or --set value)
# from taking minutes and gigabytes, or overflowing the stack of recursive readers.
MAX_RUN_CONFIG_BYTES = 1 << 20  # the same as a job spec; a ConfigMap holds 1 MiB in all
MAX_RUN_CONFIG_DEPTH = 100  # tables and arrays inside each other, the top-level table counting


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def union_models(ann: Any) -> list[type[BaseModel]]:
    """The models of a union of models (`RunConfig.model`: one per family), else []."""
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) is not typing.Union:
        return []
    members = [
        typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
        for a in typing.get_args(ann)
    ]
    return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]


def _models_at(model: type[BaseModel], loc: tuple) -> list[type[BaseModel]]:
    """The pydantic models that own the last key of `loc`, to list its allowed keys: one, or
    every member of a union of models."""
    cur: list[type[BaseModel]] = [model]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = next((m.model_fields[part] for m in cur if part in m.model_fields), None)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or ()
        nxt = next(
            (a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
        cur = [nxt] if nxt is not None else union_models(ann)
        if not cur:
            return []
    return cur


def describe_validation_error(err: ValidationError, model: type[BaseModel], source: str) -> str:
    """One sentence for the first problem, naming the field path and how to fix it."""
    # An unknown key usually explains a "missing" one beside it (a typo), so report it first.
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(first["loc"])
    path = _loc(loc)
    if first["type"] == "extra_forbidden":
        owners = _models_at(model, loc)
        allowed = sorted({f.alias or n for m in owners for n, f in m.model_fields.items()})
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"{source}: {path}: unknown key{hint} (allowed here: {', '.join(allowed)})"
    if first["type"] == "missing":
        return f"{source}: {path}: required key is missing"
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    got = first.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    more = len(errors) - 1
    tail = f" [and {more} more problem{'s' if more > 1 else ''}]" if more else ""
    where = f"{path}: " if loc else ""  # cross-field checks name their fields in the message
    return f"{source}: {where}{msg}{shown}{tail}"


def _fill_from_hf(data: dict, source: str) -> dict:
    """`model.init_from = "hf:PATH"`: missing model keys come from PATH/config.json."""
    model = data.get("model")
    init_from = model.get("init_from") if isinstance(model, dict) else None
    if not isinstance(init_from, str):
        return data
    from jobspec.hf_config import fills_nothing, hf_dir, model_fields_from_hf, read_hf_config

    what = f"{source}: model.init_from"
    path = hf_dir(init_from, what=what)
    if fills_nothing(model):  # e.g. a resolved.json: nothing to fill
        return data
    hf = model_fields_from_hf(read_hf_config(path, what=what), what=what)
    merged = {**hf, **model}  # explicit TOML keys win, inside sub-tables too ([model.gemma4])
    for key, value in hf.items():
        if isinstance(value, dict) and isinstance(model.get(key), dict):
            merged[key] = {**value, **model[key]}
    return {**data, "model": merged}


def check_depth(data: object, source: str) -> None:
    """A ConfigError when `data` nests tables and arrays more than MAX_RUN_CONFIG_DEPTH deep:
    what reads it next (pydantic, merge, the secret scan, tomli_w) recurses once per level."""
    loc = deepest_key(data, MAX_RUN_CONFIG_DEPTH)
    if loc is not None:
        where = _loc(loc[:4]) + ("…" if len(loc) > 4 else "")
        raise ConfigError(
            f"{source}: {where}: tables and arrays nest more than {MAX_RUN_CONFIG_DEPTH} levels "
            "deep here; a run config needs only a few levels"
        )


def parse_run_config(data: dict, source: str = "run config") -> RunConfig:
    check_depth(data, source)  # --set values and inline tables come here without a TOML file
    if "include" in data:
        raise ConfigError(
            f"{source}: include: only a run-config file can include others (its paths are "
            "relative to it); read it with read_toml or resolve_includes first"
        )
    data = _fill_from_hf(data, source)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e, RunConfig, source)) from None


def _read_bounded(p: Path) -> str:
    """The text of the file at `p`, refused before it is parsed when over MAX_RUN_CONFIG_BYTES."""
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    with p.open("rb") as f:
        raw = f.read(MAX_RUN_CONFIG_BYTES + 1)  # never more, even if the file grows meanwhile
    if len(raw) > MAX_RUN_CONFIG_BYTES:
        size = max(p.stat().st_size, len(raw))
        raise ConfigError(
            f"{p}: the run config is {size:,} bytes, more than the {MAX_RUN_CONFIG_BYTES:,} a run "
            "config may have; is this the right file? (lists of files belong in a data manifest)"
        )
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as read_text's universal newlines


def _too_deep(source: str) -> ConfigError:
    return ConfigError(
        f"{source}: tables and arrays nest more than {MAX_RUN_CONFIG_DEPTH} levels deep (too deep "
        "to read); a run config needs only a few levels"
    )


def toml_loads(text: str, source: str) -> dict:
    """`text` parsed as TOML, its nesting checked first (tomllib recurses per level, and a long
    dotted key costs it memory by the square): a ConfigError naming `source` and the line when
    it nests more than MAX_RUN_CONFIG_DEPTH deep. TOMLDecodeError passes through."""
    line = deepest_line(text, MAX_RUN_CONFIG_DEPTH)
    if line is not None:
        raise ConfigError(
            f"{source}: line {line}: tables and arrays (dotted keys, headers, [arrays], "
            f"{{inline tables}}) nest more than {MAX_RUN_CONFIG_DEPTH} levels deep; a run config "
            "needs only a few levels"
        )
    try:
        data = tomllib.loads(text)
    except RecursionError:  # deepest_line counts what tomllib recurses on; this is a backstop
        raise _too_deep(source) from None
    check_depth(data, source)
    return data


def toml_value(text: str, source: str) -> Any:
    """`text` as a TOML value (`2e6`, `"a b"`, `[1, 2]`), or `text` itself where it is not one
    (a bare word is a string); a ConfigError naming `source` when it nests too deep."""
    line = f"v = {text}"
    if deepest_line(line, MAX_RUN_CONFIG_DEPTH) is not None:
        raise _too_deep(source)
    try:
        return tomllib.loads(line)["v"]  # what it adds is checked with the whole config
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:  # a backstop, as in toml_loads
        raise _too_deep(source) from None


def _parse_toml_file(p: Path) -> dict:
    text = _read_bounded(p)
    try:
        return toml_loads(text, str(p))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            _duplicate_key(p, text, str(e)) or f"{p}: TOML syntax error: {e}"
        ) from None


_OVERWRITE = re.compile(r"Cannot overwrite a value \(at line (\d+), column \d+\)")
_HEADER = re.compile(r"\s*\[\[?\s*([^\]]+?)\s*\]\]?")


def _duplicate_key(p: Path, text: str, err: str) -> str | None:
    """tomllib's "Cannot overwrite a value" names no key: the sentence names it (under its
    table) from the line it points at. None when `err` is another error."""
    m = _OVERWRITE.fullmatch(err)
    lines = text.splitlines()
    if m is None or not 0 < int(m.group(1)) <= len(lines):
        return None
    n = int(m.group(1))
    header = _HEADER.match(lines[n - 1])
    key = header.group(1) if header else lines[n - 1].split("=", 1)[0].strip()
    table = next((h.group(1) for ln in reversed(lines[: n - 1]) if (h := _HEADER.match(ln))), None)
    name = f"{table}.{key}" if table and not header else key
    return (
        f"{p}: line {n}: the key {name} is given twice (TOML allows each key once); "
        "delete one of them"
    )


def resolve_includes(
    data: dict, base: Path, source: str, _chain: tuple[Path, ...] = ()
) -> tuple[dict, list[Path]]:
    """`data` with its top-level `include = [PATH, ...]` merged in: each PATH (relative to
    `base`, the including file's folder) is read and resolved the same way, the files are
    deep-merged in order and `data`'s own keys last (tables merge key by key; any other value,
    arrays of tables included, replaces). Returns the merged table, which has no `include` key,
    and every file read for it, in reading order. A missing file or a cycle is a ConfigError."""
    if "include" not in data:
        return data, []
    names = data["include"]
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"{source}: include: expected a list of TOML file paths relative to this file, "
            f"got {names!r}"
        )
    merged: dict = {}
    files: list[Path] = []
    for name in names:
        target = Path(name) if Path(name).is_absolute() else base / name
        if not target.is_file():
            raise ConfigError(f"{source}: include: {name!r} not found (looked at {target})")
        key = target.resolve()
        if key in _chain:
            cycle = " -> ".join(str(c) for c in (*_chain[_chain.index(key) :], key))
            raise ConfigError(f"{source}: include: {name!r} makes an include cycle ({cycle})")
        sub, deeper = resolve_includes(
            _parse_toml_file(target), target.parent, str(target), (*_chain, key)
        )
        merged = merge(merged, sub)
        files += [target, *deeper]
    return merge(merged, {k: v for k, v in data.items() if k != "include"}), files


def _read_run_toml(path: str | Path) -> tuple[dict, list[Path]]:
    p = Path(path)
    return resolve_includes(_parse_toml_file(p), p.parent, str(p), (p.resolve(),))


def read_toml(path: str | Path) -> dict:
    """The run-config table in the TOML file at `path`, its `include` files merged in."""
    return _read_run_toml(path)[0]


def load_run_config(path: str | Path, overrides: dict | None = None) -> tuple[RunConfig, str]:
    """(validated config, source TOML text). `overrides` is a nested dict merged over the file.

    The source text is the file as written, or, when it includes others, the merged table as
    TOML (self-contained: what a run records as config/source.toml)."""
    data, included = _read_run_toml(path)
    if included:
        names = ", ".join(os.path.normpath(f) for f in included)
        source = f"# {path} with its includes merged in ({names})\n" + tomli_w.dumps(data)
    else:
        source = _read_bounded(Path(path))
    if overrides:
        data = merge(data, overrides)
    return parse_run_config(data, str(path)), source


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolved_dict(cfg: RunConfig) -> dict:
    """JSON-ready dict with every default filled in, keyed by the documented names."""
    return json.loads(cfg.model_dump_json(by_alias=True))


def to_toml(cfg: RunConfig) -> str:
    def drop_none(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: drop_none(v) for k, v in x.items() if v is not None}
        if isinstance(x, list):
            return [drop_none(v) for v in x]
        return x

    return tomli_w.dumps(drop_none(resolved_dict(cfg)))


def run_config_schema() -> dict:
    return RunConfig.model_json_schema(by_alias=True)
