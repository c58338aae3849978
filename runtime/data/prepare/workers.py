"""Running the parts of a prepare: one after another in this process, or over worker processes.

Public API:
    default_workers() -> int                     the cores this process may use
    run_parts(plan, indices, out, folder, workers, progress, max_bytes=None)
        -> dict[int, PartResult]                 the parts written (all of `indices`, unless the
                                                 byte budget ran out first)

Workers are spawned (never forked: the parent may hold JAX's threads) and each tokenizes whole
parts, one core each (TOKENIZERS_PARALLELISM=false: the parallelism is the parts). A part's
output does not depend on which worker wrote it, so the dataset is the same for any count.
Memory is bounded per worker (one shard's buffer and one part's offsets), whatever the input.
A failing part stops the others at once; its error is raised here as it was raised there.
A worker never outlives this process: killed outright (SIGKILL, the OOM killer), it can clean
up nothing, so each worker asks Linux to kill it when its parent dies (PR_SET_PDEATHSIG) and,
where that is not available, watches its parent's pid; the multiprocessing resource tracker,
whose pipe only they still hold, then ends too.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from runtime.data.prepare.parts import PartResult, Plan, Progress, write_part

REPORT_EVERY_S = 0.25  # how often a worker sends its counts to the parent's bar
PARENT_POLL_S = 1.0  # how often a worker without PR_SET_PDEATHSIG checks its parent is alive
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_parts(
    plan: Plan,
    indices: list[int],
    out: str,
    folder: str,
    workers: int,
    progress: Progress,
    max_bytes: int | None = None,
) -> dict[int, PartResult]:
    if max_bytes is not None:
        # A byte budget is spent in input order: the parts go one after another.
        results: dict[int, PartResult] = {}
        left = max_bytes
        for i in indices:
            if left <= 0:
                break
            results[i] = write_part(plan, i, out, folder, progress, max_bytes=left)
            left -= results[i].bytes_read
        return results
    if workers <= 1 or len(indices) <= 1:
        return {i: write_part(plan, i, out, folder, progress) for i in indices}
    return _in_workers(plan, indices, out, folder, min(workers, len(indices)), progress)


class _QueueProgress:
    """A worker's counts, sent to the parent every REPORT_EVERY_S and when the part ends."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.counts = [0, 0, 0, 0]
        self.sent = time.monotonic()

    def add(self, nbytes: int = 0, documents: int = 0, tokens: int = 0, files: int = 0) -> None:
        for k, v in enumerate((nbytes, documents, tokens, files)):
            self.counts[k] += v
        if time.monotonic() - self.sent >= REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if any(self.counts):
            self.queue.put(tuple(self.counts))
            self.counts = [0, 0, 0, 0]
        self.sent = time.monotonic()


_QUEUE: Any = None


def _start_worker(queue: Any, parent: int) -> None:
    global _QUEUE
    _QUEUE = queue
    # One core per worker: the workers are the parallelism (and Rayon in a spawned child is
    # the tokenizers library's own warning otherwise).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    exit_with_parent(parent)


def exit_with_parent(parent: int) -> None:
    """End this process as soon as process `parent` (its parent) has ended."""
    if not _death_signal():
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it died before we asked: the signal will never come
        os._exit(1)


def _death_signal() -> bool:
    """Linux: SIGKILL this process when its parent dies; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    """The portable fallback: an orphan is re-parented, so its parent pid changes."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _work(plan: Plan, index: int, out: str, folder: str) -> PartResult:
    progress = _QueueProgress(_QUEUE)
    try:
        return write_part(plan, index, out, folder, progress)
    finally:
        progress.flush()


def _drain(queue: Any, progress: Progress) -> None:
    while True:
        try:
            nbytes, documents, tokens, files = queue.get_nowait()
        except queue_mod.Empty:
            return
        progress.add(nbytes, documents, tokens, files)


def _in_workers(
    plan: Plan, indices: list[int], out: str, folder: str, workers: int, progress: Progress
) -> dict[int, PartResult]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    before = set(mp.active_children())
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                               initargs=(queue, os.getpid()))  # fmt: skip
    results: dict[int, PartResult] = {}
    try:
        futures: dict[Future, int] = {pool.submit(_work, plan, i, out, folder): i for i in indices}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(queue, progress)
            for f in done:
                results[futures[f]] = f.result()  # a part's error is raised here
        _drain(queue, progress)
    except BaseException:
        # Stop the parts still running: their work is lost with the prepare anyway.
        pool.shutdown(wait=False, cancel_futures=True)
        for child in set(mp.active_children()) - before:
            child.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        queue.close()
    return results
