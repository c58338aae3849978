"""Shared fixtures: a GCS emulator for the session, and small helpers the suites share."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

GCS_TEST_BUCKET = "jaxjob-test"

# gcsfs reads this once, at import: if any test imports gcsfs before the emulator fixture runs,
# a later emulator test would otherwise wait 60 s on a gRPC probe the emulator never answers.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _emulator_command(port: int) -> list[str] | None:
    args = ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    args += ["--default-bucket", GCS_TEST_BUCKET]
    exe = shutil.which("gcp-storage-emulator")
    if exe:
        return [exe, *args]
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        return None
    return [sys.executable, "-m", "gcp_storage_emulator", *args]


def _wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with code {proc.returncode} at start")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"gcp-storage-emulator did not answer {url} in {timeout_s}s"
                ) from e
            time.sleep(0.05)


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
    """gs://jaxjob-test on an in-memory emulator; every GCS client in this process and in its
    subprocesses is pointed at it through the environment."""
    # find_spec, not import: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT once, at import time.
    if importlib.util.find_spec("gcsfs") is None:
        pytest.skip("gcsfs is not installed (pip install 'jaxjob[dev]')")
    port = free_port()
    cmd = _emulator_command(port)
    if cmd is None:
        pytest.skip("gcp-storage-emulator is not installed (pip install 'jaxjob[dev]')")
    host = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until_up(proc, f"{host}/storage/v1/b")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", host)
            mp.setenv("TENSORSTORE_GCS_HTTP_URL", host)
            # gcsfs otherwise first tries a gRPC bucket-layout call the emulator never answers.
            mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            mp.setenv("EPATH_USE_TF", "false")
            yield f"gs://{GCS_TEST_BUCKET}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def gs_run_uri(gcs_bucket: str) -> str:
    """A fresh gs:// prefix per test, so tests never see each other's objects."""
    return f"{gcs_bucket}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", pytest.param("gs", marks=pytest.mark.gcs)])
def run_uri(request: pytest.FixtureRequest, tmp_path) -> str:
    """The same test once on a local directory and once on gs:// (the emulator)."""
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gs_run_uri")

# Fixtures of the training suites (tiny corpus, prepared manifest) live in tests/runs.py.
pytest_plugins = ("runs",)
