"""Loading job.yaml: safe YAML only, field-path errors, and the run config it names (or, for a
`prepare:` job, the prepare config its hosts read)."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomli_w
import yaml
from pydantic import ValidationError

from jobspec.errors import ConfigError
from jobspec.files.overrides import sets_header
from jobspec.files.run_toml import (
    MAX_RUN_CONFIG_BYTES,
    describe_validation_error,
    merge,
    parse_run_config,
    read_toml,
    resolve_includes,
)
from jobspec.files.secrets import find_secrets, refusal
from jobspec.job_spec import JobSpec, spec_yaml
from jobspec.prepare_job import PrepareJobConfig, parse_prepare_config, prepare_toml
from jobspec.run_config import RunConfig


@dataclass(frozen=True)
class LoadedJob:
    spec: JobSpec
    run: RunConfig | None  # with the spec's output_uri and run.id = run_id applied; None: prepare
    run_toml: str  # the config as the hosts will read it (cfg.toml): includes merged in
    spec_yaml: str  # the validated spec re-serialised (no comments): what backends embed
    path: Path
    run_id: str  # the run id every host will use
    prepare: PrepareJobConfig | None = None  # a `prepare:` job's host config (paths absolute)

    @property
    def output_uri(self) -> str:
        """run.output_uri of the hosts' config: where `<run_id>/` with the run's records goes."""
        cfg = self.run if self.run is not None else self.prepare
        assert cfg is not None
        return cfg.run.output_uri


# A job spec is a page of YAML; these bounds keep a hostile or broken file from taking minutes
# and gigabytes (an "alias bomb": nine aliases of nine aliases of ... expand to 9^N nodes).
MAX_SPEC_BYTES = 1 << 20
MAX_ALIAS_NODES = 10_000  # nodes that aliases may add in all, counted as fully expanded
MAX_DEPTH = 100  # nesting of mappings and lists (PyYAML's composer recurses per level)


class _RefusedError(yaml.MarkedYAMLError):
    """An alias pushed the document past MAX_ALIAS_NODES, a recursive alias, too deep a nesting,
    or a key given twice in one mapping."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts what every alias expands to and refuses a document whose
    aliases would add more than MAX_ALIAS_NODES nodes, an alias inside its own anchor (a cycle),
    a nesting deeper than MAX_DEPTH or a mapping that gives a key twice, naming the line."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> nodes once expanded, for finished nodes
        self._alias_nodes = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:  # an undefined alias is the composer's own error
                size = self._sizes.get(id(target))
                if size is None:
                    raise _RefusedError(
                        None, None, f"the alias *{event.anchor} refers to its own anchor "
                        "(a recursive structure), which a job spec cannot hold", event.start_mark
                    )  # fmt: skip
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise _RefusedError(
                        None, None, f"the alias *{event.anchor} makes the aliases expand to more "
                        f"than {MAX_ALIAS_NODES:,} values (an alias bomb?); write the values out "
                        "or use fewer aliases", event.start_mark
                    )  # fmt: skip
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _RefusedError(
                None, None, f"the document nests more than {MAX_DEPTH} levels deep", mark
            )
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            _refuse_duplicate_keys(node)
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        self._sizes[id(node)] = 1 + sum(self._sizes.get(id(c), 1) for c in children)
        return node


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicate_keys(node: yaml.MappingNode) -> None:
    """PyYAML keeps the last of two equal keys without a word (`max_restarts: 3` … `max_restarts:
    0` would silently mean 0). Checked on the mapping as written: a key that overrides what a
    `<<: *anchor` merge brings in is YAML's own override, not a duplicate."""
    seen: dict[tuple[str, str], yaml.Node] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
            continue
        first = seen.setdefault((key.tag, key.value), key)
        if first is not key:
            raise _RefusedError(
                None, None, f"the key {key.value!r} is given twice in one mapping (first at line "
                f"{first.start_mark.line + 1}); YAML would keep only the last, so delete one",
                key.start_mark,
            )  # fmt: skip


def _safe_load(text: str) -> object:
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: no such job spec file")
    size = path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise ConfigError(
            f"{path}: the job spec is {size:,} bytes, more than the {MAX_SPEC_BYTES:,} a job spec "
            "may have; is this the right file?"
        )
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    try:
        data = _safe_load(text)
    except _RefusedError as e:
        mark = e.problem_mark
        raise ConfigError(f"{path}: line {mark.line + 1}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a job spec is a mapping of keys (name, run, accelerator, …)")
    return data


def load_job(
    path: str | Path,
    new_run_id: Callable[[JobSpec], str] | None = None,
    overrides: dict | None = None,
) -> LoadedJob:
    """The job spec at `path` and its run config, validated once with the run id the hosts use:
    the spec's run_id, else `new_run_id(spec)` (a fresh one), else the job's name (to check a
    job without submitting it). A run config need not carry a run.id of its own. Its `include`
    files are merged in here, so `run_toml` is self-contained: hosts never see a relative path.
    A `prepare:` job has no run config: `prepare` is its hosts' config and `run_toml` that.
    `overrides` (`launch --set`, a nested dict) are merged over the run config last, and
    `run_toml` opens with a comment that lists them."""
    p = Path(path)
    text_data = _read_yaml(p)
    try:
        spec = JobSpec.model_validate(text_data)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e, JobSpec, str(p))) from None
    run_id = spec.run_id or (new_run_id(spec) if new_run_id is not None else spec.name)
    if overrides and spec.prepare is not None:
        raise ConfigError(
            f"--set: {p} is a prepare job, which has no run config to override (its settings "
            "are the job spec's prepare: section)"
        )
    if overrides and "id" in overrides.get("run", {}):
        raise ConfigError(
            "--set run.id: the run id comes from the job spec (run_id: in it, else a fresh one); "
            "set run_id there instead"
        )
    if spec.prepare is not None:
        # Relative paths are the job.yaml's, like a run config's path; the hosts get them whole.
        section = spec.prepare.resolved(p.parent)
        raw = prepare_toml(section, run_id, spec.output_uri)
        prepare = parse_prepare_config(raw, f"{p}: prepare")
        return LoadedJob(spec, None, tomli_w.dumps(raw), spec_yaml(spec), p, run_id, prepare)
    if isinstance(spec.run, str):
        run_path = (p.parent / spec.run) if not Path(spec.run).is_absolute() else Path(spec.run)
        if not run_path.is_file():
            raise ConfigError(f"{p}: run: run config {spec.run!r} not found (looked at {run_path})")
        raw = read_toml(run_path)
        source = str(run_path)
    else:
        source = f"{p}: run"
        raw, _ = resolve_includes(dict(spec.run), p.parent, source)  # relative to the job spec
    if spec.output_uri is not None:
        raw = merge(raw, {"run": {"output_uri": spec.output_uri}})
    if overrides:
        raw = merge(raw, overrides)
        source = f"{source} with --set"
    raw = merge(raw, {"run": {"id": run_id}})
    for where, what in find_secrets(raw):  # cfg.toml goes verbatim to every backend's hosts
        raise ConfigError(f"{source}: {refusal(where, what)}")
    run = parse_run_config(raw, source)
    toml = sets_header(overrides or {}) + _hosts_toml(raw, source)
    return LoadedJob(spec, run, toml, spec_yaml(spec), p, run_id)


def _hosts_toml(raw: dict, source: str) -> str:
    """cfg.toml as every host reads it, refused here when over the size a host will read (its
    includes, each within bounds, may add up to more)."""
    text = tomli_w.dumps(raw)
    size = len(text.encode())
    if size > MAX_RUN_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: the run config with its includes merged in is {size:,} bytes, more than "
            f"the {MAX_RUN_CONFIG_BYTES:,} a run config may have (every host reads it whole); "
            "move large values, such as lists of files, into the data manifest"
        )
    return text


def run_with_id(job: LoadedJob, run_id: str) -> tuple[RunConfig | PrepareJobConfig, str]:
    """The hosts' config (and its TOML) with another run id than the one `job` was loaded with."""
    raw = merge(tomllib.loads(job.run_toml), {"run": {"id": run_id}})
    if job.prepare is not None:
        return parse_prepare_config(raw, "prepare config"), tomli_w.dumps(raw)
    return parse_run_config(raw, "run config"), tomli_w.dumps(raw)


def job_schema() -> dict:
    return JobSpec.model_json_schema()


__all__ = ["LoadedJob", "load_job", "run_with_id", "job_schema", "read_toml"]
