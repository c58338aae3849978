"""What the checkpoint code says when something is wrong: its two errors, the one-line cause of
an Orbax or tensorstore failure, a storage fault told from the checkpoint's own, and the
warning line."""

from __future__ import annotations

import json
import re
import sys

from jobspec.errors import CheckpointError, StorageFaultError
from runfolder.storage import storage_fault


def warn(message: str) -> None:
    """One `warning:` line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


class UndeletableCheckpointError(CheckpointError):
    """A step that retention (checkpoint.keep) or a discard had to delete could not be deleted
    (no permission): exit 2, the sentence names the step and the cause; every step stays."""


class UnreadableCheckpointError(CheckpointError):
    """A committed checkpoint whose files cannot be restored (truncated, deleted, garbled).

    Exit 2: restarting the same job would read the same bytes again, so a launched job ends
    instead of looping; the sentence names the step and the way back to an older one.
    """

    def __init__(self, message: str, *, step: int, cause: str) -> None:
        super().__init__(message)
        self.step, self.cause = step, cause


def raise_if_fault(directory: str, name: int | str, e: BaseException, what: str) -> None:
    """Raise StorageFaultError when a failed save or read of checkpoint `name` under `directory`
    was the storage's fault (ENOSPC, EIO, gs:// 5xx or timeouts: the job ends restartable);
    return when it was not (the checkpoint's own problem)."""
    if isinstance(e, StorageFaultError):
        raise e
    fault = storage_fault(e)
    if fault is None:
        return
    hint = (
        "free space (or fix the disk) and restart: the run resumes from the latest "
        "committed checkpoint"
        if fault.disk
        else "restart once the storage answers again: the run resumes from the latest "
        "committed checkpoint"
    )
    raise StorageFaultError(
        f"checkpoint {name} under {directory} {what}: {fault.reason}; {hint}"
    ) from e


def short_cause(e: BaseException | str, limit: int = 200) -> str:
    """One line of an Orbax/tensorstore error: its first line, less the tensorstore spec dump."""
    text = e if isinstance(e, str) else (str(e).strip() or type(e).__name__)
    if isinstance(e, KeyError):
        text = f"missing key {text}"
    elif isinstance(e, json.JSONDecodeError):
        text = f"garbled JSON: {text}"
    line = text.splitlines()[0] if text else "unknown error"
    line = line.split(" [tensorstore_spec=")[0].split(" [source locations=")[0]
    line = re.sub(r'Error opening "\w+" driver: ', "", line).strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."
