"""Fixtures of the fault-injection suite: small filesystems that fill up for real.

Every test under tests/faults/ is marked `faults` (run just them with `pytest -m faults`).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.faults)


def _mount_tmpfs(path: str, size: str) -> str | None:
    """Mount a tmpfs of `size` at `path`; None on success, else why it could not be done."""
    os.makedirs(path, exist_ok=True)
    try:
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if out.returncode == 0 else (out.stderr.strip() or f"mount exited {out.returncode}")


@pytest.fixture
def small_fs() -> Iterator[Callable[[str], str]]:
    """`small_fs("2m")` -> the path of a fresh tmpfs of that size, which fills up with ENOSPC for
    real; unmounted at teardown. Skips with the reason where mounting is not allowed (it needs
    root with CAP_SYS_ADMIN, as CI's container and this machine have)."""
    mounted: list[str] = []

    def make(size: str) -> str:
        path = tempfile.mkdtemp(prefix="jaxjob-smallfs-")
        why = _mount_tmpfs(path, size)
        if why is not None:
            os.rmdir(path)
            pytest.skip(
                f"cannot mount a {size} tmpfs to fill up ({why}); needs root with CAP_SYS_ADMIN"
            )
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        try:
            os.rmdir(path)
        except OSError:
            pass


def fill(path: str, leave_bytes: int = 0) -> None:
    """Fill the filesystem holding `path` until at most `leave_bytes` are free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize - leave_bytes
    if free <= 0:
        return
    with open(os.path.join(path, ".filler"), "wb") as f:
        chunk = b"\0" * 65536
        try:
            while free > 0:
                n = f.write(chunk[: min(len(chunk), free)])
                free -= n
                f.flush()
        except OSError:
            pass
