"""scripts/slurm-dev-cluster.sh `start --owner PID`: the daemons end when their owner does, however
it ends, and nothing global (/etc/slurm/slurm.conf) points other clients at the cluster.

The SLURM and munge programs are stand-ins on PATH (each daemon a `sleep` that writes the pid file
its config names), so this runs beside the real dev cluster the SLURM suites use; what is under
test is the script's own start, watch and stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm-dev-cluster.sh"

# A daemon: reads its pid-file setting from the config after -f, detaches, writes its pid there.
DAEMON = """#!/usr/bin/env bash
conf=""; while [[ $# -gt 0 ]]; do [[ $1 == -f ]] && conf=$2; shift; done
pidfile=$(sed -n 's/^{key}=//p' "$conf")
setsid sleep 100000 </dev/null >/dev/null 2>&1 &
echo $! >"$pidfile"
"""
STANDINS = {
    "slurmctld": DAEMON.format(key="SlurmctldPidFile"),
    "slurmd": DAEMON.format(key="SlurmdPidFile"),
    "munged": "#!/bin/sh\nexit 0\n",
    "munge": "#!/bin/sh\nexit 0\n",
    "unmunge": "#!/bin/sh\nexit 0\n",  # munge answers: the script starts no munged of its own
    "sinfo": "#!/bin/sh\necho idle\n",
    "scancel": "#!/bin/sh\nexit 0\n",
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still alive after waiting up to `timeout_s` for them to end."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def standins(tmp_path: Path) -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("the script starts daemons only as root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "JAXJOB_SLURM_DIR": str(tmp_path / "cluster"),
    }


def _pids(cluster: Path) -> list[int]:
    return [int((cluster / f).read_text()) for f in ("slurmctld.pid", "slurmd.pid", "reaper.pid")]


def test_the_daemons_end_when_their_owner_is_killed(standins, tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
    try:
        start = subprocess.run(
            ["bash", str(SCRIPT), "start", "--owner", str(owner.pid)],
            env=standins, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert start.returncode == 0, start.stderr
        cluster = tmp_path / "cluster"
        assert f"export SLURM_CONF={cluster / 'slurm.conf'}" in start.stderr
        pids = _pids(cluster)
        assert all(_alive(p) for p in pids)
        owner.kill()  # SIGKILL: no handler of the owner's runs
        owner.wait()
        assert _wait_gone(pids) == []
        assert not (cluster / "reaper.pid").exists()
    finally:
        owner.kill()
        subprocess.run(["bash", str(SCRIPT), "stop"], env=standins, capture_output=True)


def test_a_plain_stop_also_ends_the_watcher(standins, tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
    try:
        cmd = ["bash", str(SCRIPT), "start", "--owner", str(owner.pid)]
        subprocess.run(cmd, env=standins, check=True, capture_output=True, timeout=60)
        pids = _pids(tmp_path / "cluster")
        stop = ["bash", str(SCRIPT), "stop"]
        subprocess.run(stop, env=standins, check=True, capture_output=True, timeout=60)
        assert _wait_gone(pids) == []  # the watcher too: it must not stop a later cluster
        assert _alive(owner.pid)
    finally:
        owner.kill()
        owner.wait()
