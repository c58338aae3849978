"""Host memory for checkpoint copies: allocated once, kept, and reused by every later save.

An async checkpoint stops the train loop while the state is copied off the accelerator into new
host (numpy) arrays; only the write runs in the background. glibc serves allocations that large
with a fresh mmap and unmaps them when freed, so every save faults its whole state in again, page
by page (4 KiB pages where transparent huge pages are off). On the TPU v5e machine, for
Qwen3-0.6B's 6.66 GiB state (bench/tpu/ckpt_block.py), a save held the loop 3.3 s that way and
1.4-1.5 s with the freed memory kept in the heap and reused.

`keep_freed_memory` makes glibc do that for this process (`mallopt`: no mmap for large
allocations, no trimming of the heap), and `fault_in` grows the heap by a save's size once,
before the first save, on the thread that later copies (glibc gives other threads' large
allocations their own mappings). The cost is host memory: the process keeps the size of one
state copy after its first save, as it needs it again at the next; a copy over a quarter of the
machine's memory is not kept (`worth_keeping`).
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterable

import numpy as np

_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
_M_MMAP_MAX = -4
_PAGE = 4096
_CHUNK = 256 * 2**20

_kept = False


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and never give freed heap back to the system; True
    when in force (glibc only; elsewhere the allocator is left as it is)."""
    global _kept
    if _kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        # -1: trimming off (mallopt(3)); 0: no mmap for any allocation.
        _kept = bool(libc.mallopt(_M_TRIM_THRESHOLD, -1)) and bool(libc.mallopt(_M_MMAP_MAX, 0))
    except (OSError, AttributeError):
        return False
    return _kept


def worth_keeping(nbytes: int) -> bool:
    """Whether to keep a copy of `nbytes` for the whole run: at most a quarter of this machine's
    memory, so other processes on the host (data workers, a second job) keep theirs."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return False
    return 0 < nbytes <= total // 4


def fault_in(nbytes: int) -> int:
    """Allocate `nbytes` of heap on this thread, touch every page, and free it again (kept by
    `keep_freed_memory`), so a later copy of that size finds its pages resident. Returns the
    bytes touched (0 when the freed memory would not be kept)."""
    if not _kept or nbytes <= 0:
        return 0
    chunks = []
    for size in _sizes(nbytes):
        chunk = np.empty(size, np.uint8)
        chunk[::_PAGE] = 0  # one write a page faults it in
        chunks.append(chunk)
    del chunks
    return nbytes


def _sizes(nbytes: int) -> Iterable[int]:
    while nbytes > 0:
        yield min(_CHUNK, nbytes)
        nbytes -= _CHUNK


def copy_bytes(tree: Iterable) -> int:
    """The bytes this process copies to host to save these arrays: one replica of each of its
    addressable shards."""
    return sum(
        shard.data.nbytes for leaf in tree for shard in leaf.addressable_shards
        if shard.replica_id == 0
    )  # fmt: skip
