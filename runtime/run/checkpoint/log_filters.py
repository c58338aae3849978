"""Orbax's, asyncio's and Python's reports that repeat a checkpoint failure already said in one
sentence, cut to one line or dropped. Installed when the checkpoint package is first imported
(its `__init__` imports this module); the two `quiet_abandoned_*` hooks again by a restore."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from runfolder.storage import storage_fault


def quiet_abandoned_reads() -> None:
    """When one array fails, Orbax's restore returns and closes its asyncio loop while the
    other tensorstore reads are in flight; each then completes into the closed loop and Python
    prints a RuntimeError traceback as "unraisable", after our one sentence. That noise is not
    the cause: drop exactly it, pass every other unraisable exception on."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxjob_quiet", False):
        return

    def hook(u: Any) -> None:
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        previous(u)

    hook._jaxjob_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def quiet_abandoned_futures() -> None:
    """After a failed restore, the reads Orbax abandoned are garbage-collected later (at exit,
    after our one sentence), and Python warns that their coroutines were never awaited: that
    repeats the cause, so it is dropped once a restore has failed (asyncio's own report of them
    is _QuietOrbaxLeftovers')."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                            category=RuntimeWarning)  # fmt: skip


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax logs each failed background save from every thread it ran on, each with a full
    traceback (hundreds of lines for one full disk); the save's error reaches the user once,
    in one sentence, from `CheckpointService._raise_save_error`. Keep Orbax's lines, one line
    each."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Orbax's own lines start "[process=N]" (its caller frame is not always reported).
        orbax = "orbax" in (record.pathname or "") or str(record.msg).startswith("[process=")
        if record.exc_info and orbax:
            record.msg = " ".join(record.getMessage().split())[:300]
            record.args = None
            record.exc_info = record.exc_text = None
        return True


class _QuietOrbaxLeftovers(logging.Filter):
    """After a failed save or restore, asyncio reports each of Orbax's sibling reads and writes
    that failed too but were never awaited as "exception was never retrieved", with a traceback,
    whenever the garbage collector reaches them (often after our sentence). The failure itself is
    reported once, by us (`_raise_save_error`, `unreadable`, a storage fault): drop these."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in str(record.msg):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and storage_fault(exc) is not None:
            return False
        # A task's repr names its coroutine and where it is defined (one of Orbax's); a plain
        # future's names its exception, a tensorstore error with its spec.
        text = record.getMessage()
        return "/orbax/checkpoint/" not in text and "tensorstore_spec" not in text


logging.getLogger("absl").addFilter(_OneLineOrbaxErrors())
logging.getLogger("asyncio").addFilter(_QuietOrbaxLeftovers())
# A failed save leaves the same abandoned tensorstore callbacks as a failed restore.
quiet_abandoned_reads()
