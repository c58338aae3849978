"""Host memory kept for checkpoint copies (runtime/host/host_memory.py): with glibc told to keep
freed memory, a copy the size of one faulted in before finds its pages resident.

Page faults are counted (getrusage's minor faults), not timed. Each case runs in a child process,
so the allocator settings never reach the test process itself.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from runs import xla_flags

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the allocator settings are glibc's (mallopt)",
)

CHILD = """
import json, resource, sys
import numpy as np
from runtime.host import host_memory

keep = sys.argv[1] == "keep"
size = 256 * 2**20
kept = host_memory.keep_freed_memory() if keep else False
touched = host_memory.fault_in(size)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
copy = np.empty(size, np.uint8)  # as a save's host copy would be
copy[::4096] = 1
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "touched": touched, "faults": faults, "pages": size // 4096}))
"""


def _child(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def test_a_copy_after_fault_in_finds_its_pages_resident() -> None:
    kept, plain = _child("keep"), _child("plain")
    assert kept["kept"] and kept["touched"] == 256 * 2**20
    assert not plain["kept"] and plain["touched"] == 0
    # Without it the copy faults its memory in: a fault a page, or one per huge page where
    # transparent huge pages serve numpy (a fault per 2 MiB: 128 for 256 MiB).
    assert plain["faults"] >= 100, plain
    assert kept["faults"] < 10, kept


COPY_BYTES = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from runtime.host.host_memory import copy_bytes

mesh = Mesh(jax.devices(), ("x",))
assert len(jax.devices()) == 4
sharded = jax.device_put(jnp.zeros((32, 4), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
replicated = jax.device_put(jnp.zeros((16,), jnp.float32), NamedSharding(mesh, PartitionSpec()))
print(copy_bytes([sharded, replicated]))
"""


def test_copy_bytes_counts_one_replica_of_each_addressable_shard() -> None:
    """On 4 devices: the sharded array once in all, the replicated one once, not 4 times."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(4),
    }
    out = subprocess.run(
        [sys.executable, "-c", COPY_BYTES], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert int(out.stdout) == 32 * 4 * 4 + 16 * 4


def test_a_copy_over_a_quarter_of_the_machine_is_not_kept() -> None:
    from runtime.host.host_memory import worth_keeping

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert worth_keeping(total // 4) and worth_keeping(1)
    assert not worth_keeping(total // 4 + 1) and not worth_keeping(0)
