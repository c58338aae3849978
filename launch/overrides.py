"""`launch submit/render/plan --set KEY=VALUE --env NAME=VALUE`: one setting changed at submit
time without editing the job's files. `--set` overrides keys of the run config the job names
(parsed as `runtime --set` parses them), `--env` adds or overrides the hosts' environment. Both
are recorded: in the cfg.toml the hosts read (a comment lists the `--set`s), in the job.yaml
the backends embed (its env), and in the run's record (`launch status`)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from jobspec.compat import config_fingerprint
from jobspec.errors import ConfigError
from jobspec.files.job_yaml import LoadedJob, load_job
from jobspec.files.overrides import flat_sets, parse_envs, parse_sets, toml_literal
from jobspec.files.run_toml import describe_validation_error, parse_run_config
from jobspec.job_spec import JobSpec, spec_yaml

if TYPE_CHECKING:
    from launch.backend import Submission
    from launch.registry import Registry


def override_options(f: Callable) -> Callable:
    """The `--set` and `--env` options of submit, render and plan."""
    f = click.option(
        "--env",
        "envs",
        multiple=True,
        metavar="NAME=VALUE",
        help="Add or override an environment variable of every host (repeatable).",
    )(f)
    return click.option(
        "--set",
        "sets",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a key of the job's run config, e.g. training.target_tokens=2e6 "
        "(repeatable; values are TOML literals, as `runtime --set`).",
    )(f)


def load_overridden(
    job_path: str,
    new_run_id: Callable[[JobSpec], str] | None,
    sets: tuple[str, ...] = (),
    envs: tuple[str, ...] = (),
) -> tuple[LoadedJob, dict[str, Any]]:
    """The job with its `--set`s and `--env`s applied, and the record of them ({} for none).
    Their syntax is checked before the job spec is read."""
    set_tree, env = parse_sets(sets), parse_envs(envs)
    job = load_job(job_path, new_run_id, set_tree or None)
    if env:
        data = job.spec.model_dump(mode="json", exclude_unset=True)
        data["env"] = {**data.get("env", {}), **env}
        try:
            spec = JobSpec.model_validate(data)
        except ValidationError as e:
            raise ConfigError(
                describe_validation_error(e, JobSpec, f"{job.path} with --env")
            ) from None
        job = dataclasses.replace(job, spec=spec, spec_yaml=spec_yaml(spec))
    record: dict[str, Any] = {}
    if set_tree:
        record["set"] = {k: toml_literal(v) for k, v in flat_sets(set_tree).items()}
    if env:
        record["env"] = env
    return job, record


def describe(overrides: dict[str, Any]) -> str:
    """The record as options: `--set training.seq_len=64 --env NAME=value`."""
    words = [f"--set {k}={v}" for k, v in overrides.get("set", {}).items()]
    words += [f"--env {k}={v}" for k, v in overrides.get("env", {}).items()]
    return " ".join(words)


def refuse_incompatible_resubmit(
    registry: Registry, sub: Submission, sets: tuple[str, ...]
) -> None:
    """A resubmit of a fixed run id with `--set`s whose config changes a key resume must keep
    (the checkpoint compatibility keys, jobspec.compat) is refused here, before anything
    starts, rather than by every host at resume."""
    if not sets or sub.spec.run_id is None or not registry.exists(sub.run_id):
        return
    previous = registry.run_dir(sub.run_id) / "cfg.toml"
    try:
        before = config_fingerprint(parse_run_config(tomllib.loads(previous.read_text())))
    except (OSError, ValueError, ConfigError):  # no or an older config: resume will tell
        return
    new = config_fingerprint(parse_run_config(tomllib.loads(sub.run_toml)))
    for key, value in new.items():
        old = before.get(key, value)
        if value != old:
            raise ConfigError(
                f"--set: run {sub.run_id} ran with {key} = {old!r} and this submit makes it "
                f"{value!r}, which resuming its checkpoints refuses; use a new run.id (run_id "
                "in the job spec) to train with it"
            )
