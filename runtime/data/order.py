"""The seeded, process-count-independent order of records: which record id is global sample n.

The infinite global sequence wraps epochs of N records: sample n is row i = n % N of epoch
e = n // N.
  sequential      record id i
  shuffle         the records permuted per epoch from (seed, e); record id = the record index
  document_buffer record id = n = e*N + i; the packed-documents source permutes its documents per
                  epoch from (seed, e), so the seed and the id fix the tokens
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from jobspec.run_config import DataOrder

_EPOCH_CACHE = 4  # a step may straddle an epoch end; prefetch threads may be a step or two apart
RECORD_STREAM, DOCUMENT_STREAM = 0, 1  # separate permutations drawn from the same (seed, epoch)


def permutation(seed: int, epoch: int, stream: int, n: int) -> np.ndarray:
    """The permutation of n items for (seed, epoch); `stream` separates records from documents."""
    return np.random.default_rng([seed, epoch, stream]).permutation(n)


class EpochCache:
    """Per-epoch values (permutations), computed once and shared by the prefetch threads."""

    def __init__(self, build: Callable[[int], Any]):
        self._build = build
        self._items: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, epoch: int) -> Any:
        with self._lock:
            if epoch in self._items:
                return self._items[epoch]
        value = self._build(epoch)  # outside the lock: deterministic, so a duplicate is harmless
        with self._lock:
            self._items[epoch] = value
            while len(self._items) > _EPOCH_CACHE:
                del self._items[min(self._items)]
        return value


class RecordOrder(Protocol):
    """Maps global sample numbers to record ids."""

    def ids(self, n: np.ndarray) -> np.ndarray: ...


class SequentialOrder:
    """Every epoch reads the records in index order."""

    def __init__(self, records_per_epoch: int):
        self.records_per_epoch = records_per_epoch

    def ids(self, n: np.ndarray) -> np.ndarray:
        return n % self.records_per_epoch


class ShuffleOrder:
    """Every epoch reads the records in a permutation drawn from (seed, epoch)."""

    def __init__(self, records_per_epoch: int, seed: int):
        self.records_per_epoch = records_per_epoch
        self._perms = EpochCache(lambda e: permutation(seed, e, RECORD_STREAM, records_per_epoch))

    def ids(self, n: np.ndarray) -> np.ndarray:
        epoch, i = np.divmod(n, self.records_per_epoch)
        out = np.empty_like(i)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perms.get(int(e))[i[sel]]
        return out


class EpochRowOrder:
    """The record id is the global sample number e*N + i itself (the source shuffles within)."""

    def ids(self, n: np.ndarray) -> np.ndarray:
        return n


def record_order(order: DataOrder, records_per_epoch: int, seed: int) -> RecordOrder:
    """The order object for data.order over `records_per_epoch` records."""
    if order == "shuffle":
        return ShuffleOrder(records_per_epoch, seed)
    if order == "document_buffer":
        return EpochRowOrder()
    return SequentialOrder(records_per_epoch)
