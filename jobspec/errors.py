"""One error type per layer; the CLI catches JaxjobError once and prints one sentence.

`exit_code` is what the process ends with: 2 (a user mistake, never restarted) unless the
failure is the environment's, not the user's (a storage fault: restartable).
"""

from jobspec.exit_codes import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_STORAGE_FAULT


class JaxjobError(Exception):
    """A user-facing failure: the message is a complete sentence naming the problem and the fix."""

    exit_code: int = EXIT_BAD_INPUT


class ConfigError(JaxjobError):
    """A run config or job spec is malformed or inconsistent."""


class DataError(JaxjobError):
    """A data manifest, shard or tokenizer is missing, corrupt or inconsistent."""


class StorageError(JaxjobError):
    """An output URI cannot be read or written because of what the user gave (a missing bucket,
    a path without permission, a file where a directory must be)."""


class StorageFaultError(StorageError):
    """Storage failed under a correct run (ENOSPC, EIO, gs:// 5xx or timeouts that outlasted the
    retries): the job ends restartable, with the original error in the message."""

    exit_code = EXIT_STORAGE_FAULT


class CheckpointError(JaxjobError):
    """A checkpoint is missing, uncommitted or incompatible with the run config."""


class DivergedError(JaxjobError):
    """Training produced a non-finite loss, gradient norm or parameter norm: the run stops before
    any non-finite state is saved. Not restartable (the same restart would diverge again)."""

    exit_code = EXIT_DIVERGED

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class RunOwnedError(JaxjobError):
    """Another live process owns the run directory; nothing was changed."""
