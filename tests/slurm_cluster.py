"""pytest plugin: a real SLURM cluster for the session, for the suites that submit jobs.

Registered in tests/conftest.py through `pytest_plugins`. The `slurm_cluster` fixture uses the
cluster `sinfo` already answers for (SLURM_CONF in the environment, as .ci/run sets it);
otherwise it starts the one-node dev cluster (scripts/slurm-dev-cluster.sh: munge, slurmctld,
slurmd on this machine), owned by this process: it is stopped at the end of the session, or by
the script's watcher when this process ends any other way. It skips, saying why, where SLURM is not installed or cannot be started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm-dev-cluster.sh"
INSTALL = "apt-get install -y slurm-wlm munge"


@dataclass(frozen=True)
class SlurmCluster:
    started: bool  # this session started the dev cluster (and stops it)
    conf: str | None  # SLURM_CONF the clients use; None: their default
    cpus: int  # CPUs of the first node, so a test can size its job


def _answers(env: dict[str, str] | None = None) -> bool:
    try:
        proc = subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _node_cpus() -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True)
    return int((out.stdout.split() or ["0"])[0].rstrip("+"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if shutil.which("sbatch") is None:
        pytest.skip(f"SLURM is not installed ({INSTALL})")
    if _answers():
        yield SlurmCluster(False, os.environ.get("SLURM_CONF"), _node_cpus())
        return
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip(f"no SLURM cluster answers and the daemons are not installed ({INSTALL})")
    if os.geteuid() != 0:
        pytest.skip("no SLURM cluster answers, and starting the dev cluster needs root")
    conf = str(Path(os.environ.get("JAXJOB_SLURM_DIR", "/tmp/jaxjob-slurm")) / "slurm.conf")
    # --owner: the daemons end with this process, even when the suite is killed (SIGTERM,
    # Ctrl-C, SIGKILL), so none serves jobs after the tests.
    proc = subprocess.run(
        ["bash", str(SCRIPT), "start", "--owner", str(os.getpid())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode != 0:
        # A start that failed partway may have left munged or a daemon running: stop them.
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)
        pytest.fail(f"scripts/slurm-dev-cluster.sh start failed:\n{proc.stderr}", pytrace=False)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", conf)  # sbatch/scontrol here and in subprocesses find it
            cpus = _node_cpus()
            yield SlurmCluster(True, conf, cpus)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)
