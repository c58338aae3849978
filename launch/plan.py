"""`launch plan job.yaml`: the job's compiled plan, from `runtime plan` in a subprocess.

`launch` never imports jax: the job spec gives the run config, accelerator, hosts and slices,
and `python -m runtime plan` compiles the step for them. Its output and exit code are the
command's (0 fits, 1 does not fit, 2 bad input).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jobspec.files.job_yaml import load_job


def plan_command(
    job_path: str,
    as_json: bool,
    fit: bool = False,
    overlay: str | None = None,
    sets: tuple[str, ...] = (),
    envs: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, run-config TOML) of the `runtime plan` run for this job spec, with
    `launch plan --set/--env` applied (the `--env`s are the planning process's too)."""
    from launch.overrides import load_overridden

    job, overrides = load_overridden(job_path, None, sets, envs)
    spec = job.spec
    argv = [sys.executable, "-m", "runtime", "plan", "CFG", "--accelerator", spec.accelerator]
    env = {**os.environ, **overrides.get("env", {})}
    if spec.catalogue.kind == "cpu":
        # The cpu target is the planning process's own devices: as many as the job would use.
        devices = spec.host_processes("local") * spec.devices_per_host("local")
        flag = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    else:
        argv += ["--hosts", str(spec.hosts_per_slice), "--slices", str(spec.slices)]
    if as_json:
        argv.append("--json")
    if fit:
        argv.append("--fit")
    if overlay:
        argv += ["--out", overlay]
    return argv, env, job.run_toml


def run_plan(
    job_path: str,
    as_json: bool,
    fit: bool = False,
    overlay: str | None = None,
    sets: tuple[str, ...] = (),
    envs: tuple[str, ...] = (),
) -> int:
    """Run `runtime plan` for the job; its output goes straight to this process's own. A
    prepare job trains nothing: one sentence says so (exit 0). With `--fit --out OUT`, the job's
    run config is written beside OUT (`OUT`'s stem + `.run.toml`) and OUT includes it, so
    `runtime local OUT` trains the pick and a job.yaml can name OUT as its `run`."""
    if load_job(job_path).prepare is not None:
        note = (
            f"{job_path} is a prepare job: it tokenizes data and trains no model, so there is "
            "no train step to compile (launch submit runs it)"
        )
        print(json.dumps({"job": job_path, "kind": "prepare", "note": note}) if as_json else note)
        return 0
    argv, env, run_toml = plan_command(job_path, as_json, fit, overlay, sets, envs)
    if overlay:
        out = Path(overlay)
        cfg = out.with_name(out.stem + ".run.toml")
        cfg.write_text(run_toml)
        argv[argv.index("CFG")] = str(cfg)
        return subprocess.run(argv, env=env, check=False).returncode
    with tempfile.TemporaryDirectory(prefix="jaxjob-plan-") as tmp:
        cfg = Path(tmp) / "cfg.toml"
        cfg.write_text(run_toml)
        argv[argv.index("CFG")] = str(cfg)
        return subprocess.run(argv, env=env, check=False).returncode
