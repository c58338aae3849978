"""One error type per layer; the CLI catches JaxjobError once and prints one sentence."""


class JaxjobError(Exception):
    """A user-facing failure: the message is a complete sentence naming the problem and the fix."""


class ConfigError(JaxjobError):
    """A run config or job spec is malformed or inconsistent."""


class DataError(JaxjobError):
    """A data manifest, shard or tokenizer is missing, corrupt or inconsistent."""


class StorageError(JaxjobError):
    """An output URI cannot be read or written."""


class CheckpointError(JaxjobError):
    """A checkpoint is missing, uncommitted or incompatible with the run config."""
