"""What a local run will execute: each host's command and environment, as plain data."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from jobspec.job_spec import SecretRef
from launch.backend import RenderedFile, Submission
from launch.backends import source_pythonpath
from launch.backends.local.supervisor import (
    ATTEMPT_PLACEHOLDER,
    COORDINATOR_PLACEHOLDER,
    SUBMISSION_PLACEHOLDER,
)

# Seconds between SIGTERM and SIGKILL: a cancel leaves time for the final checkpoint; after a
# host failure the others usually cannot checkpoint (a peer is gone), so they get less.
CANCEL_GRACE_S = 120.0
FAILURE_GRACE_S = 15.0
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _xla_flags(spec_value: str | None, devices: int) -> str:
    base = spec_value if spec_value is not None else os.environ.get("XLA_FLAGS", "")
    flags = [f for f in base.split() if not f.startswith(_DEVICE_FLAG)]
    return " ".join([*flags, f"{_DEVICE_FLAG}={devices}"])


def secret_names(sub: Submission) -> list[str]:
    """The env variables whose value comes from the submitting shell (secret references)."""
    return [k for k, v in sub.spec.env.items() if isinstance(v, SecretRef)]


def _common_env(sub: Submission, procs: int, devices: int) -> dict[str, str]:
    literals = {k: v for k, v in sub.spec.env.items() if isinstance(v, str)}
    return {
        **literals,
        "JAXJOB_RUN_ID": sub.run_id,
        "JAXJOB_COORDINATOR": COORDINATOR_PLACEHOLDER,
        "JAXJOB_NUM_PROCESSES": str(procs),
        "JAXJOB_OUTPUT_URI": sub.output_uri,
        "JAXJOB_ATTEMPT": ATTEMPT_PLACEHOLDER,
        "JAXJOB_SUBMISSION_ID": SUBMISSION_PLACEHOLDER,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": _xla_flags(literals.get("XLA_FLAGS"), devices),
        "PYTHONUNBUFFERED": "1",  # lines reach the log files as they are printed
        "PYTHONPATH": source_pythonpath(os.environ.get("PYTHONPATH")),
    }


def host_plan(sub: Submission, run_dir: Path) -> dict[str, Any]:
    """Each host's exact command and the environment jaxjob sets for it (the rest of the
    environment is inherited from the submitting shell)."""
    spec = sub.spec
    procs, devices = spec.host_processes("local"), spec.local.devices_per_process
    common = _common_env(sub, procs, devices)
    command = [sys.executable, "-m", "runtime", "worker", str(run_dir / "cfg.toml")]
    return {
        "run_id": sub.run_id,
        "cwd": str(Path.cwd()),  # relative paths in the run config resolve here
        "processes": procs,
        "devices_per_process": devices,
        "max_restarts": spec.max_restarts,
        "grace_s": {"cancel": CANCEL_GRACE_S, "failure": FAILURE_GRACE_S},
        "inherit": "the submitting shell's environment, less JAXJOB_* and *_proxy variables",
        "logs": str(run_dir / "logs" / "attempt-<n>" / "host-<i>.log"),
        "hosts": [
            {
                "index": i,
                "command": command,
                "env": {**common, "JAXJOB_PROCESS_ID": str(i)},
                "env_from_shell": secret_names(sub),
            }
            for i in range(procs)
        ],
    }


def render_files(sub: Submission, run_dir: Path) -> list[RenderedFile]:
    """hosts.json (the plan), cfg.toml and job.yaml, for a run whose folder is `run_dir`."""
    plan = host_plan(sub, run_dir)
    return [
        RenderedFile("hosts.json", json.dumps(plan, indent=2) + "\n"),
        RenderedFile("cfg.toml", sub.run_toml),
        RenderedFile("job.yaml", sub.spec_yaml),  # validated, no comments
    ]
