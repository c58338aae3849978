"""Sampled checksums: a cheap check that a dataset file still holds what the prepare wrote.

Public API:
    sample_ranges(size) -> list[(start, end)]     the byte ranges sampled from a file of `size`
    sample_digest(data: bytes) -> str             the checksum of bytes in memory (a writer's)
    Sampler(size)                                 the same over bytes written in order
        .update(chunk); .hexdigest()
    read_digests(fs, files: dict[path, size]) -> dict[path, str]   files on storage, one batch

The sha256 of a file (manifest.py) proves its content but costs a read of every byte, so only
`data check --deep` computes it. This one reads SAMPLE_BLOCKS blocks of SAMPLE_BYTES (the first,
the last and evenly spaced between; the whole file when it is smaller): a file overwritten in
place with the same size, truncated and refilled, or swapped for another prepare's is caught at
every load for ~32 KiB a file (one concurrent batch of range reads on gs://). A change confined
to the bytes between the blocks needs the deep check.
"""

from __future__ import annotations

import hashlib
from typing import Any

SAMPLE_BLOCKS = 8
SAMPLE_BYTES = 4096


def sample_ranges(size: int) -> list[tuple[int, int]]:
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return [(0, size)]
    step = (size - SAMPLE_BYTES) / (SAMPLE_BLOCKS - 1)
    return [(a, a + SAMPLE_BYTES) for a in (round(k * step) for k in range(SAMPLE_BLOCKS))]


class Sampler:
    """The checksum of a file of `size` bytes, fed its bytes in order (any chunking)."""

    def __init__(self, size: int):
        self.ranges = sample_ranges(size)
        self.pos = 0
        self.h = _start(size)

    def update(self, chunk: bytes) -> None:
        lo, hi = self.pos, self.pos + len(chunk)
        for a, b in self.ranges:
            if a < hi and b > lo:
                self.h.update(chunk[max(a, lo) - lo : min(b, hi) - lo])
        self.pos = hi

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def sample_digest(data: bytes) -> str:
    s = Sampler(len(data))
    s.update(data)
    return s.hexdigest()


def read_digests(fs: Any, files: dict[str, int]) -> dict[str, str]:
    """The checksums of files on `fs` (path -> its size, as listed), from one cat_ranges call."""
    wanted = [(path, a, b) for path, size in files.items() for a, b in sample_ranges(size)]
    hashes = {path: _start(size) for path, size in files.items()}
    if wanted:
        paths, starts, ends = (list(x) for x in zip(*wanted, strict=True))
        for path, block in zip(paths, fs.cat_ranges(paths, starts, ends, on_error="raise"),
                               strict=True):  # fmt: skip
            hashes[path].update(block)  # the blocks come back in range order
    return {path: h.hexdigest() for path, h in hashes.items()}


def _start(size: int) -> Any:
    return hashlib.sha256(f"{size}|".encode())  # the size too: part of what a file is
